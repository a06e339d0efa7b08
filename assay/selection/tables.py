"""The coreset experiment's report: markdown + JSON tables, selection overlap, loss curves."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from assay.core.results import versus_baseline
from assay.core.runs import read_json, write_json
from assay.selection.filter import overlap, read_selection

LABELS = {
    "full": "full data",
    "random": "random",
    "loss": "loss (highest)",
    "gradcos": "gradient cosine",
    "trackstar_bf16": "TrackStar bf16",
    "trackstar_fp32": "TrackStar fp32",
    "facility": "facility location (CRAIG)",
    "kcenter": "k-center",
    "balanced": "cluster-balanced",
    "typiclust": "TypiClust",
}


def _stats(values: list[float]) -> dict[str, float]:
    arr = np.asarray(values, dtype=np.float64)
    return {"mean": float(arr.mean()), "std": float(arr.std(ddof=1)) if len(arr) > 1 else 0.0}


def _summaries(cfg: Any, lay: Any, row: str, seed: int) -> list[dict[str, Any]]:
    """The finished runs of a row at one seed: the full run, or each draw's retraining."""
    if row == "full":
        return [read_json(lay.full(seed) / "summary.json")]
    return [read_json(lay.retrain(row, seed, d) / "summary.json") for d in range(cfg.draws_of(row))]


def collect_rows(cfg: Any, lay: Any, rows: list[str]) -> dict[str, dict[str, Any]]:
    """Per row: per-seed pool/eval/train losses and wall times, and their mean ± std. A row drawn
    more than once per seed (random, and the seeded strategies) holds the means over its draws
    (each draw's in `draws`)."""
    out: dict[str, dict[str, Any]] = {}
    for row in ["full", *rows]:
        per_seed = [_summaries(cfg, lay, row, s) for s in cfg.seeds]
        pools = [[_pool_loss(r, row) for r in runs] for runs in per_seed]
        evals = [[r["eval_loss"] for r in runs] for runs in per_seed]
        walls = [float(np.mean([r["wall_s"] for r in runs])) for runs in per_seed]
        pool, ev = [float(np.mean(v)) for v in pools], [float(np.mean(v)) for v in evals]
        out[row] = {
            "label": LABELS.get(row, row),
            "seeds": list(cfg.seeds),
            "pool_loss": pool,
            "eval_loss": ev,
            "train_loss": [float(np.mean([r["train_loss"] for r in runs])) for runs in per_seed],
            "wall_s": walls,
            "examples": per_seed[0][0]["examples"],
            "steps": per_seed[0][0]["steps"],
            "pool_loss_stats": _stats(pool),
            "eval_loss_stats": _stats(ev),
            "wall_s_stats": _stats(walls),
        }
        if row == "random" or any(len(v) > 1 for v in evals):
            spread = [np.std(v, ddof=1) for v in evals if len(v) > 1]
            out[row]["draws"] = {"eval_loss": evals, "pool_loss": pools}
            out[row]["draw_spread"] = float(np.mean(spread)) if spread else None
    if "random" in out:
        _compare_with_random(out)
    return out


def _pool_loss(summary: dict[str, Any], row: str) -> float:
    value = summary["train_loss"] if row == "full" else summary["pool_loss"]
    return float("nan") if value is None else float(value)


def _compare_with_random(out: dict[str, dict[str, Any]]) -> None:
    """Each row against random, seed by seed (random: the mean of its draws at that seed): the
    mean difference and the seeds won in eval and pool loss, the share of the random-to-full gap
    closed, and the share of all random draws the row's retraining beats at the same seed."""
    random = out["random"]
    base, pool_base = np.asarray(random["eval_loss"]), np.asarray(random["pool_loss"])
    full = np.asarray(out["full"]["eval_loss"])
    for name, entry in out.items():
        diff = np.asarray(entry["eval_loss"]) - base
        entry["eval_vs_random"] = {
            "mean": float(diff.mean()),
            "wins": int((diff < 0).sum()),
            "of": len(diff),
            # share of the random-to-full gap this selection closes (1: as good as full data)
            "gap_closed": float(np.mean(-diff / np.where(base - full == 0, np.nan, base - full))),
        }
        pool_diff = np.asarray(entry["pool_loss"]) - pool_base
        entry["pool_vs_random"] = {
            "mean": float(pool_diff.mean()),
            "wins": int((pool_diff < 0).sum()),
            "of": len(pool_diff),
        }
        if name != "random":
            beaten = [np.asarray(d) > v for d, v in zip(random["draws"]["eval_loss"], entry["eval_loss"])]
            entry["draws_beaten"] = float(np.concatenate(beaten).mean())


def selection_facts(cfg: Any, lay: Any, rows: list[str], agreement: tuple[str, ...] = ()) -> dict[str, Any]:
    """bf16 vs fp32 overlap of every gradient strategy's selection, and (with a collection column)
    the share of each collection."""
    seed = cfg.seeds[0]
    chosen = {row: read_selection(lay.selection(row, seed)) for row in [*rows, *agreement]}
    facts: dict[str, Any] = {"overlap_bf16_fp32": {}}
    for row in chosen:
        name, _, precision = row.partition("_")
        pair = (f"{name}_bf16", f"{name}_fp32" if f"{name}_fp32" in chosen else name)
        if precision == "bf16" and pair[1] in chosen:
            facts["overlap_bf16_fp32"][name] = overlap(chosen[pair[0]], chosen[pair[1]])
    pool_file = Path(lay.data.dataset)
    if pool_file.suffix == ".jsonl":
        with open(pool_file, encoding="utf-8") as f:
            groups = [json.loads(line).get("collection") for line in f if line.strip()]
        if any(groups):
            # the table's rows only: the extra selections made for the bf16/fp32 overlap repeat them
            facts["collection_share"] = {row: _shares(groups, chosen[row]) for row in rows}
            facts["collection_share"]["pool"] = _shares(groups, np.arange(len(groups)))
    return facts


def _shares(groups: list[Any], ids: np.ndarray) -> dict[str, float]:
    picked = [groups[int(i)] for i in ids]
    return {g: picked.count(g) / len(picked) for g in sorted(set(groups), key=str)}


def stage_times(root: Path) -> dict[str, float]:
    """Seconds per stage kind (summed over seeds), from stages.json."""
    times = read_json(root / "stages.json") if (root / "stages.json").exists() else {}
    kinds: dict[str, float] = {}
    for name, seconds in times.items():
        parts = name.split("/")
        kind = "/".join(parts[:2]) if parts[0] in ("index", "retrain") else parts[0]
        kinds[kind] = kinds.get(kind, 0.0) + seconds
    return kinds


def markdown(results: dict[str, Any]) -> str:
    rows, facts = results["rows"], results["selection"]
    n = len(results["seeds"])
    lines = [
        f"| selection | examples | pool loss (mean ± std) | eval loss (mean ± std) "
        f"| eval − random (wins of {n}) | pool − random (wins of {n}) | random draws beaten "
        "| gap to full closed | per-seed eval | wall s / run |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    for row in rows.values():
        p, e, w = row["pool_loss_stats"], row["eval_loss_stats"], row["wall_s_stats"]
        pool_text = "–" if np.isnan(p["mean"]) else f"{p['mean']:.4f} ± {p['std']:.4f}"
        vs = row.get("eval_vs_random")
        gap = f"{vs['gap_closed']:.0%}" if vs and np.isfinite(vs["gap_closed"]) else "–"
        beaten = f"{row['draws_beaten']:.0%}" if "draws_beaten" in row else "–"
        seeds = ", ".join(f"{v:.4f}" for v in row["eval_loss"])
        lines.append(
            f"| {row['label']} | {row['examples']} | {pool_text} | {e['mean']:.4f} ± {e['std']:.4f} "
            f"| {versus_baseline(vs)} | {versus_baseline(row.get('pool_vs_random'))} "
            f"| {beaten} | {gap} | {seeds} "
            f"| {w['mean']:.1f} |"
        )
    drawn = [row for row in rows.values() if "draws" in row]
    if drawn:
        lines.append("")
    for row in drawn:
        draws = len(row["draws"]["eval_loss"][0])
        spread = row["draw_spread"]
        about = f"; one draw's eval loss spreads ±{spread:.4f} (sd) about the seed's mean" if spread else ""
        lines.append(
            f"{row['label']}: the mean of {draws} draw(s) per seed, each retrained with that seed{about}."
        )
    if facts.get("overlap_bf16_fp32"):
        shown = ", ".join(f"{LABELS.get(k, k)} {v:.0%}" for k, v in facts["overlap_bf16_fp32"].items())
        lines += ["", f"Selection overlap, bf16 vs fp32 index: {shown}"]
    if "collection_share" in facts:
        lines += [
            "",
            "Share of each collection in the selections (seed " + str(results["seeds"][0]) + "):",
            "",
        ]
        groups = list(facts["collection_share"]["pool"])
        lines += ["| selection | " + " | ".join(groups) + " |", "|---|" + "---:|" * len(groups)]
        for row, share in facts["collection_share"].items():
            lines.append(
                f"| {LABELS.get(row, row)} | " + " | ".join(f"{share[g]:.0%}" for g in groups) + " |"
            )
    lines += [
        "",
        "Wall time per stage (s): " + ", ".join(f"{k} {v:.0f}" for k, v in results["stage_s"].items()),
    ]
    return "\n".join(lines) + "\n"


def plot_curves(lay: Any, rows: list[str], seed: int, path: Path) -> None:
    """Train loss and eval loss of every row's run at `seed` against training progress (one PNG).

    The x axis is the fraction of each run's optimizer steps, so a 10% subset's short run and
    the full run's long one share an axis.
    """
    import matplotlib  # lazy: only the experiment's last step plots

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after use("Agg"): no display

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for row in ["full", *rows]:
        folder = lay.full(seed) if row == "full" else lay.retrain(row, seed)
        log = [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines()]
        steps = max(int(r["step"]) for r in log) or 1
        train = [
            (r["step"] / steps, r["train_loss"]) for r in log if "train_loss" in r and not r.get("final")
        ]
        evals = [(r["step"] / steps, r["eval_loss"]) for r in log if r.get("eval_loss") is not None]
        label = f"{LABELS.get(row, row)} ({steps} steps)"
        left.plot(*zip(*train), label=label, lw=1)
        if evals:
            right.plot(*zip(*evals), marker="o", label=label, lw=1)
    left.set(
        xlabel="fraction of the run", ylabel="train loss (nats/token)", title=f"training loss (seed {seed})"
    )
    right.set(xlabel="fraction of the run", ylabel="eval loss (nats/token)", title=f"eval loss (seed {seed})")
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_report(
    cfg: Any, lay: Any, rows: list[str], root: Path, agreement: tuple[str, ...] = ()
) -> dict[str, Any]:
    results = {
        "seeds": list(cfg.seeds),
        "fraction": cfg.fraction,
        "query": lay.query,
        "rows": collect_rows(cfg, lay, rows),
        "selection": selection_facts(cfg, lay, rows, agreement),
        "stage_s": stage_times(root),
    }
    write_json(root / "results.json", results)
    (root / "results.md").write_text(markdown(results))
    plot_curves(lay, rows, cfg.seeds[0], root / "curves.png")
    return results
