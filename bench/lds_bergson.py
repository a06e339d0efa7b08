"""bergson's estimators on an `assay validate` experiment: their LDS beside assay's, same ground truth.

An `assay validate` run folder (e.g. the `abc` preset's) holds everything a peer needs: the
full run's model (`full/model`, a Hugging Face folder), the pool and the queries as jsonl
(`data/pool.jsonl`, `data/query.jsonl`, in the ground truth's order) and the retrained subsets'
measured losses (`ground_truth/`). This script runs bergson 2.5.1's own pipelines on that model
and data, one query column each (`--query.aggregation none`), as a new user would call them:

- `bergson-trackstar`: `bergson trackstar` (autocorrelation second moments of the pool and the
  queries, mixed as in Chang et al. 2024, unit-normalised, projection 16 per side — assay's
  TrackStar settings on the preset).
- `bergson-kfac`, `bergson-ekfac`: `bergson ekfac --method kfac` without / with
  `--hessian_cfg.ev_correction` (factors fitted on the pool, inverse applied to each query's
  unprojected gradient, bergson's default damping rule).

Each run's scores are turned into assay's sign convention (positive = lowers the query's loss;
bergson's `load_scores_loss_signed` gives the opposite) and saved as `[Q, N]` matrices with a
sidecar of the whole process's wall time and peak memory, then scored against the experiment's
ground truth with assay's LDS (Spearman per query, bootstrap interval over queries). The
matrices can be added to the experiment's own table with
`assay validate OUT --scores WORK/bergson-*.npy`.

Run it with the peers' interpreter (bergson is never a dependency of assay):

    PYTHONPATH=. .venv-peers/bin/python bench/lds_bergson.py lds-out --work bergson-lds

Whole-process wall times include bergson's start-up and model loading; run it on a quiet
machine for times worth quoting.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

from assay.counterfactual.ground_truth import GroundTruth
from assay.counterfactual.lds import linear_datamodel_score

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_build import timed  # noqa: E402  (whole-process wall time and peak memory)
from machine import header  # noqa: E402

PIPELINES: dict[str, list[str]] = {
    "bergson-trackstar": ["trackstar", "--projection_dim", "16", "--precision", "fp32"],
    "bergson-kfac": ["ekfac", "--method", "kfac", "--index_cfg.precision", "fp32"],
    "bergson-ekfac": [
        "ekfac",
        "--method",
        "kfac",
        "--hessian_cfg.ev_correction",
        "true",
        "--index_cfg.precision",
        "fp32",
    ],
}


def bergson_command(python: str, name: str, experiment: Path, run: Path, max_length: int) -> list[str]:
    """The bergson CLI call for one pipeline on the experiment's full-run model, pool and queries."""
    data = experiment / "data"
    cmd = [python, "-m", "bergson", *PIPELINES[name][:1], str(run), *PIPELINES[name][1:]]
    cmd += ["--model", str(experiment / "full" / "model"), "--data.dataset", str(data / "pool.jsonl")]
    cmd += ["--query.dataset", str(data / "query.jsonl"), "--query.aggregation", "none"]
    # bergson cuts documents at its token batch size: the only way to cut them where the
    # experiment did (its pool was trained and its queries measured at --max_length tokens)
    cmd += ["--data.truncation", "true", "--query.truncation", "true", "--token_batch_size", str(max_length)]
    return cmd + ["--overwrite", "true"]


def assay_signed_scores(run: Path, shape: tuple[int, int]) -> np.ndarray:
    """[Q, N] scores of a finished bergson run, positive where the example lowers the query's loss."""
    from bergson.data import load_scores_loss_signed  # the peers' venv only

    loss_signed, _ = load_scores_loss_signed(str(run / "scores"))  # [N, Q], negative = proponent
    scores = -np.asarray(loss_signed, dtype=np.float64).reshape(shape[1], shape[0]).T
    if not np.isfinite(scores).all():
        raise SystemExit(f"{run}: bergson wrote non-finite scores")
    return np.ascontiguousarray(scores)


def run_pipeline(args, name: str, truth: GroundTruth) -> dict:
    """Run one bergson pipeline (unless its matrix is already saved) and return its LDS row."""
    matrix, facts_file = args.work / f"{name}.npy", args.work / f"{name}.json"
    if not matrix.exists():
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        env["OMP_NUM_THREADS"] = str(args.threads)
        cmd = bergson_command(args.peer_python, name, args.experiment, args.work / name, args.max_length)
        cost = timed(cmd, env)
        if "error" in cost:
            return {"method": name, "error": cost["error"]}
        np.save(matrix, assay_signed_scores(args.work / name, (len(truth.query_ids), len(truth.ids))))
        facts_file.write_text(json.dumps({"seconds": cost["wall_s"], "peak_gb": cost.get("peak_gb")}) + "\n")
    facts = json.loads(facts_file.read_text())
    lds = linear_datamodel_score(
        np.load(matrix), truth.masks, truth.outputs, higher_is_better=truth.higher_is_better
    )
    return {
        "method": name,
        "lds": lds.mean,
        "ci": [lds.ci_low, lds.ci_high],
        "queries": lds.num_defined,
        **facts,
    }


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "experiment", type=Path, help="an `assay validate` run folder (full run and ground truth done)"
    )
    ap.add_argument(
        "--work", type=Path, default=Path("bergson-lds"), help="bergson's runs and the [Q, N] matrices"
    )
    ap.add_argument(
        "--ground_truth", type=Path, default=None, help="another experiment's ground_truth/ (same pool)"
    )
    ap.add_argument("--methods", nargs="+", default=list(PIPELINES), choices=list(PIPELINES))
    ap.add_argument("--peer_python", default=sys.executable, help="python of the venv with bergson 2.5.1")
    ap.add_argument("--threads", type=int, default=2, help="OMP threads bergson may use")
    ap.add_argument(
        "--max_length", type=int, default=256, help="tokens the experiment cut examples to (abc preset: 256)"
    )
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    print(header())
    truth = GroundTruth.load(args.ground_truth or args.experiment / "ground_truth")
    args.work.mkdir(parents=True, exist_ok=True)
    rows = [run_pipeline(args, name, truth) for name in args.methods]
    for row in rows:
        if "error" in row:
            print(f"{row['method']}: failed ({row['error']})")
        else:
            lo, hi = row["ci"]
            print(
                f"{row['method']}: LDS {row['lds']:.3f} [{lo:.3f}, {hi:.3f}] over {row['queries']} queries; "
                f"{row['seconds']:.1f} s whole process, peak {row['peak_gb'] or float('nan'):.2f} GB"
            )
    (args.work / "lds.json").write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
