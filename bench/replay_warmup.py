"""Replay with the warm-up held fixed, on the first queries of an `assay validate` experiment.

`assay validate OUT --methods replay --replay_from_step S` computes this for every query; this
script does it for the first --queries only (batches of 4, each saved as it finishes, so a rerun
resumes) and prints the LDS of those rows beside every method already in OUT/methods, on the same
queries, against each ground truth given (experiments over the same pool, queries and full run,
e.g. the abc preset at α = 0.5 and at α = 0.95):

    python bench/replay_warmup.py lds-out --ground_truths lds-out lds-95 --first_step 8 --queries 12
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from assay.core.config import QueryConfig
from assay.counterfactual.from_run import load_replay, metagradient_scores
from assay.counterfactual.ground_truth import GroundTruth
from assay.counterfactual.lds import linear_datamodel_score
from assay.lm.queries import load_queries

BATCH = 4


def replay_rows(experiment: Path, first_step: int, queries: int, out: Path) -> np.ndarray:
    """[queries, N] metagradient scores from `first_step` on, in the ground truth's column order."""
    out.mkdir(parents=True, exist_ok=True)
    starts = range(0, queries, BATCH)
    missing = [s for s in starts if not (out / f"rows-{s:04d}.npy").exists()]
    if missing:
        replayed = load_replay(experiment / "full", "cpu")
        query_cfg = QueryConfig(query_dataset=str(experiment / "data" / "query.jsonl"), query_split="train")
        examples = load_queries(query_cfg, replayed.max_length, replayed.tokenizer).examples
        where = {int(i): k for k, i in enumerate(np.asarray(replayed.train.ids))}
        order = [where[int(i)] for i in np.load(experiment / "ground_truth" / "ids.npy")]
        for s in missing:
            rows = list(range(s, min(s + BATCH, queries)))
            scores = metagradient_scores(replayed, examples.subset(rows), False, BATCH, first_step)
            np.save(out / f"rows-{s:04d}.npy", scores[:, order])
    return np.concatenate([np.load(out / f"rows-{s:04d}.npy") for s in starts])


def warmup_weight(experiment: Path, first_step: int) -> None:
    """How much of replay's (every step) scores sit on the examples first seen before first_step."""
    path = next(iter(sorted((experiment / "methods").glob("replay-fp32.npy"))), None)
    if path is None:
        return
    size = json.loads((experiment / "full" / "config.json").read_text())["config"]["recipe"]
    batch = int(size["effective_batch_size"])
    first_epoch = json.loads((experiment / "full" / "order.json").read_text())["epochs"][0]
    ids = np.load(experiment / "ground_truth" / "ids.npy")
    step = {int(i): j // batch for j, i in enumerate(first_epoch)}
    early = np.array([step[int(i)] < first_step for i in ids])
    magnitude = np.abs(np.load(path))  # [Q, N]
    size_of = magnitude.mean(axis=0)  # [N] mean |score| over queries
    top5 = np.sort(magnitude, axis=1)[:, -5:].sum(1) / magnitude.sum(1)
    print(
        f"replay-fp32: examples first seen before step {first_step} ({early.sum()}) score "
        f"{size_of[early].mean() / size_of[~early].mean():.1f}x the others' mean |score|; "
        f"the 5 largest carry {top5.min():.0%}-{top5.max():.0%} of a query's total"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("experiment", type=Path, help="an assay validate folder (its full/, data/, methods/)")
    ap.add_argument("--ground_truths", type=Path, nargs="+", required=True)
    ap.add_argument("--first_step", type=int, default=8)
    ap.add_argument("--queries", type=int, default=12)
    ap.add_argument("--out", type=Path, help="where the rows are kept (default: EXPERIMENT/replay-warmup)")
    args = ap.parse_args()
    out = args.out or args.experiment / f"replay-warmup-from{args.first_step}"
    warmup_weight(args.experiment, args.first_step)
    late = replay_rows(args.experiment, args.first_step, args.queries, out)
    q = len(late)
    methods = {p.stem: np.load(p)[:q] for p in sorted((args.experiment / "methods").glob("*.npy"))}
    for folder in args.ground_truths:
        truth = GroundTruth.load(folder / "ground_truth")
        print(f"{folder}: LDS on the first {q} queries")
        for name, scores in {f"replay-from{args.first_step}": late, **methods}.items():
            r = linear_datamodel_score(scores, truth.masks, truth.outputs[:, :q])
            print(f"  {name:24s} {r.mean:.3f} [{r.ci_low:.3f}, {r.ci_high:.3f}]")


if __name__ == "__main__":
    main()
