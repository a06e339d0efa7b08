"""LDS of attribution results against a ground truth: reading them, the table, the plot.

A result is an `assay score` run made with --save_scores (its scores.npy [Q, N_index], its
queries.jsonl and its index's ids are aligned to the ground truth's queries and pool, refusing
any other pool or query set), or a .npy matrix [Q, N] already in the ground truth's order.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from assay.attribution.index import open_index
from assay.core.errors import AssayError
from assay.core.runs import CONFIG_FILE, read_json, write_json
from assay.counterfactual.ground_truth import GroundTruth
from assay.counterfactual.lds import linear_datamodel_score
from assay.counterfactual.methods import method_facts

LDS_FILE = "lds.json"


def load_scores(source: Path, truth: GroundTruth) -> tuple[str, np.ndarray, dict[str, Any]]:
    """(label, [Q, N] scores in the ground truth's order, facts) of a score run or a .npy file."""
    if source.is_dir():
        return _score_run(source, truth)
    if source.suffix != ".npy" or not source.exists():
        raise AssayError(f"{source} is neither an assay score run folder nor a .npy scores matrix")
    scores = np.load(source, allow_pickle=False)
    want = (len(truth.query_ids), len(truth.ids))
    if scores.shape != want:
        raise AssayError(
            f"{source} holds scores of shape {scores.shape}; the ground truth needs {want} [Q, N]"
        )
    return source.stem, scores, method_facts(source)


def _score_run(folder: Path, truth: GroundTruth) -> tuple[str, np.ndarray, dict[str, Any]]:
    saved = read_json(folder / CONFIG_FILE) if (folder / CONFIG_FILE).exists() else {}
    if saved.get("command") != "score":
        raise AssayError(f"{folder} is not an assay score run")
    if not (folder / "scores.npy").exists():
        raise AssayError(f"{folder} has no scores.npy; rerun that `assay score` with --save_scores")
    summary = read_json(folder / "summary.json")
    if summary.get("aggregate", "none") != "none":
        raise AssayError(f"{folder} aggregated its queries (--aggregate); LDS needs one column per query")
    queries = [json.loads(line) for line in (folder / "queries.jsonl").read_text().splitlines() if line]
    rows = _query_rows(folder, queries, truth)
    if summary.get("index"):
        row_ids = np.asarray(open_index(summary["index"]).ids)
    else:  # metagradients through a finetune run: its training examples, saved beside the scores
        row_ids = np.load(folder / "ids.npy", allow_pickle=False)
    columns = _pool_columns(folder, row_ids, truth.ids)
    scores = np.load(folder / "scores.npy", mmap_mode="r", allow_pickle=False)
    facts = {"mode": summary.get("mode"), "precision": summary.get("precision"),
             "index": summary.get("index") or summary.get("finetune")}  # fmt: skip
    return folder.name, np.asarray(scores[rows][:, columns], dtype=np.float32), facts


def _query_rows(folder: Path, queries: list[dict[str, Any]], truth: GroundTruth) -> list[int]:
    """Rows of the run's scores for each ground-truth query (matched by id and text)."""
    where = {str(q["query"]): i for i, q in enumerate(queries)}
    rows = []
    for qid, text in zip(truth.query_ids, truth.query_texts):
        i = where.get(str(qid))
        if i is None or queries[i].get("text") != text:
            raise AssayError(
                f"{folder} scored other queries than the ground truth (query {qid!r} differs or is missing)"
            )
        rows.append(i)
    return rows


def _pool_columns(folder: Path, index_ids: np.ndarray, pool_ids: np.ndarray) -> np.ndarray:
    where = {int(v): i for i, v in enumerate(index_ids)}
    missing = [int(v) for v in pool_ids if int(v) not in where]
    if missing or len(index_ids) != len(pool_ids):
        raise AssayError(
            f"{folder} scored an index of {len(index_ids)} examples, another pool than the ground truth's "
            f"{len(pool_ids)}" + (f" (id {missing[0]} missing)" if missing else "")
        )
    return np.array([where[int(v)] for v in pool_ids], dtype=np.int64)


def evaluate_all(root: Path, truth: GroundTruth, sources: list[Path], bootstrap: int) -> dict[str, Any]:
    """LDS of every source; lds.json (merged with earlier results), lds.md and lds.png in ROOT."""
    saved = read_json(root / LDS_FILE)["results"] if (root / LDS_FILE).exists() else {}
    for source in sources:
        label, scores, facts = load_scores(source, truth)
        lds = linear_datamodel_score(
            scores,
            truth.masks,
            truth.outputs,
            higher_is_better=truth.higher_is_better,
            num_resamples=bootstrap,
        )
        saved[label] = {"source": str(source), **facts, **lds.to_dict()}
    result = {
        "ground_truth": {
            "num_subsets": int(truth.masks.shape[0]), "pool": int(truth.masks.shape[1]),
            "queries": len(truth.query_ids), "alpha": float(truth.masks.sum(1).mean() / truth.masks.shape[1]),
        },
        "results": saved,
    }  # fmt: skip
    write_json(root / LDS_FILE, result)
    (root / "lds.md").write_text(markdown(result))
    if saved:
        plot(result, root / "lds.png")
    return result


def markdown(result: dict[str, Any]) -> str:
    gt = result["ground_truth"]
    lines = [
        f"LDS over {gt['num_subsets']} retrained subsets (α = {gt['alpha']:.2f} of {gt['pool']} examples), "
        f"{gt['queries']} queries; 95% bootstrap interval over queries.",
        "",
        "| method | LDS | 95% CI | queries | index + score s | peak GB |",
        "|---|---:|---|---:|---:|---:|",
    ]
    for label, r in sorted(result["results"].items(), key=lambda kv: -(kv[1]["mean"] or -9)):
        seconds = (r.get("index_seconds") or 0) + (r.get("score_seconds") or 0)
        mean = "n/a" if r["mean"] is None else f"{r['mean']:.3f}"
        ci = "n/a" if r["ci_low"] is None else f"[{r['ci_low']:.3f}, {r['ci_high']:.3f}]"
        peak = f"{r['peak_gb']:.2f}" if r.get("peak_gb") else "—"
        lines.append(f"| {label} | {mean} | {ci} | {r['num_defined']} | {seconds:.1f} | {peak} |")
    return "\n".join(lines) + "\n"


def plot(result: dict[str, Any], path: Path) -> None:
    """One bar per method with its confidence interval."""
    import matplotlib  # lazy: plotting only at the end of a validation

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after use("Agg"): no display

    items = sorted(result["results"].items(), key=lambda kv: -(kv[1]["mean"] or -9))
    labels = [k for k, _ in items]
    means = np.array([v["mean"] or 0.0 for _, v in items])
    low = means - np.array([v["ci_low"] if v["ci_low"] is not None else m for (_, v), m in zip(items, means)])
    high = (
        np.array([v["ci_high"] if v["ci_high"] is not None else m for (_, v), m in zip(items, means)]) - means
    )
    fig, ax = plt.subplots(figsize=(max(5, 0.7 * len(labels) + 2), 3.5))
    ax.bar(range(len(labels)), means, yerr=[low, high], capsize=3, color="#4a7ab5")
    ax.set_xticks(range(len(labels)), labels, rotation=30, ha="right", fontsize=8)
    ax.axhline(0, color="black", lw=0.6)
    ax.set(ylabel="LDS (Spearman)", title="Linear datamodeling score by method")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
