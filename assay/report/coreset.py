"""The view of an `assay coreset` experiment: results table, loss curves, bf16/fp32 overlap.

Reads results.json (written at the end of the experiment; each row carries its readable label)
and each retraining run's metrics.jsonl (full/seed{S}/, retrain/{row}/seed{S}/); while the
experiment is running only the finished stages show, named by their folders.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from assay.core.results import versus_baseline
from assay.report import charts
from assay.report import html as h
from assay.report.common import missing_note, settings_block, unfinished_note
from assay.report.runs import Run, try_open_run


def _stat(entry: dict, key: str) -> str:
    s = entry.get(f"{key}_stats") or {}
    if "mean" not in s:
        return "–"
    return f"{s['mean']:.4f} ± {s.get('std', 0.0):.4f}"


def results_table(rows: dict[str, dict[str, Any]]) -> str:
    """One line per selection strategy; the best eval loss among the selections highlighted."""
    names = list(rows)
    selections = [n for n in names if n != "full"]
    best = min(selections, key=lambda n: rows[n]["eval_loss_stats"]["mean"], default=None)
    table_rows = []
    for name in names:
        e = rows[name]
        keys = ("eval_vs_random", "pool_vs_random")
        versus = [versus_baseline(e.get(key)) if name != "random" else "–" for key in keys]
        beaten = f"{e['draws_beaten']:.0%}" if "draws_beaten" in e else "–"
        seeds = ", ".join(f"{v:.4f}" for v in e.get("eval_loss", []))
        wall = (e.get("wall_s_stats") or {}).get("mean")
        table_rows.append(
            (_label(name, e), e.get("examples"), _stat(e, "eval_loss"), versus[0],
             _stat(e, "pool_loss"), versus[1], beaten, seeds, wall)
        )  # fmt: skip
    headers = [
        "selection",
        "examples",
        "eval loss (mean ± std)",
        "eval − random (wins)",
        "pool loss",
        "pool − random (wins)",
        "random draws beaten",
        "per-seed eval",
        "wall s / run",
    ]
    return h.table(
        headers, table_rows, numeric=(1, 2, 3, 4, 5, 6, 8), highlight_row=names.index(best) if best else None
    )


def _label(name: str, entry: dict[str, Any]) -> str:
    """The row's name, and for a row averaged over draws, how many per seed."""
    draws = (entry.get("draws") or {}).get("eval_loss") or [[]]
    label = entry.get("label", name)
    return f"{label} (mean of {len(draws[0])} draws)" if len(draws[0]) > 1 else label


def eval_bars(rows: dict[str, dict[str, Any]]) -> str:
    names = [n for n in rows if n != "full"]
    if not names:
        return ""
    means = [rows[n]["eval_loss_stats"]["mean"] for n in names]
    stds = [rows[n]["eval_loss_stats"].get("std", 0.0) for n in names]
    labels = [rows[n].get("label", n) for n in names]
    full = rows.get("full", {}).get("eval_loss_stats", {}).get("mean")
    best = min(range(len(means)), key=lambda i: means[i])
    return charts.bar_chart(
        labels, means, "Held-out loss after retraining on each selection", "eval loss (nats/token)",
        errors=stds, highlight=best, reference=("full data", full) if full is not None else None,
    )  # fmt: skip


def _run_folders(root: Path) -> dict[str, list[tuple[str, Run]]]:
    """{row: [(seed name, finetune run)]} for full/seed*/ and retrain/{row}/seed*/."""
    found: dict[str, list[tuple[str, Run]]] = {}
    for seed_dir in sorted((root / "full").glob("seed*")):
        run = try_open_run(seed_dir)
        if run is not None:
            found.setdefault("full", []).append((seed_dir.name.removesuffix(".part"), run))
    for row_dir in sorted((root / "retrain").glob("*")):
        for seed_dir in sorted(row_dir.glob("seed*")):
            run = try_open_run(seed_dir)
            if run is not None:
                found.setdefault(row_dir.name, []).append((seed_dir.name.removesuffix(".part"), run))
    return found


def loss_curves(root: Path, labels: dict[str, str]) -> str:
    """Train loss and eval loss against the step for every row (in the order of `labels`, {row:
    label}; rows found on disk only follow, named by their folder), at the first seed."""
    runs = _run_folders(root)
    rows = [r for r in labels if r in runs] + [r for r in runs if r not in labels]
    train, evals = {}, {}
    for row in rows:
        _, run = runs[row][0]
        log = run.jsonl("metrics.jsonl")
        label = labels.get(row, row)
        t = [
            (r["step"], r["train_loss"])
            for r in log
            if "train_loss" in r and not r.get("final") and "step" in r
        ]
        e = [(r["step"], r["eval_loss"]) for r in log if r.get("eval_loss") is not None and "step" in r]
        if t:
            train[label] = ([p[0] for p in t], [p[1] for p in t])
        if e:
            evals[label] = ([p[0] for p in e], [p[1] for p in e])
    if not train and not evals:
        return missing_note("loss curves", "retraining runs with metrics.jsonl")
    styles = {labels.get(r, r): "--" for r in rows if r.endswith("_fp32")}  # the fp32 twin of a bf16 row
    seed = runs[rows[0]][0][0] if rows else ""
    blocks = []
    if train:
        blocks.append(
            h.figure(
                charts.line_chart(
                    train, f"Training loss ({seed})", "optimizer step", "nats / token", styles=styles
                )
            )
        )
    if evals:
        blocks.append(
            h.figure(
                charts.line_chart(
                    evals,
                    f"Held-out loss ({seed})",
                    "optimizer step",
                    "nats / token",
                    markers=True,
                    styles=styles,
                )
            )
        )
    return h.grid(*blocks)


def selection_block(facts: dict[str, Any], labels: dict[str, str]) -> str:
    out = ""
    overlaps = facts.get("overlap_bf16_fp32") or {}
    if "overlap_trackstar_bf16_fp32" in facts:  # experiments made before every strategy was compared
        overlaps = {"trackstar": facts["overlap_trackstar_bf16_fp32"]}
    if overlaps:
        out += h.tiles(
            [(f"{labels.get(k, k)}: bf16 ∩ fp32 selection", f"{v:.1%}") for k, v in overlaps.items()]
        )
        out += (
            "<p class='muted'>Share of each selection made from the bf16 index that the fp32 index also "
            "selects: mixed-precision attribution picks (almost) the same data.</p>"
        )
    shares = facts.get("collection_share")
    if shares:
        groups = list(shares.get("pool", {}))
        rows = [[labels.get(r, r)] + [f"{s.get(g, 0):.0%}" for g in groups] for r, s in shares.items()]
        out += h.h3("Share of each collection in the selections") + h.table(
            ["selection", *groups], rows, numeric=tuple(range(1, len(groups) + 1))
        )
    return out


def coreset_section(run: Run) -> h.Section:
    results = run.json("results.json")
    body = unfinished_note(run)
    if results is None:
        body += missing_note("results table", "results.json (the experiment has not finished)")
        body += h.h3("Loss curves") + loss_curves(run.path, {})
        return h.Section(run.name, "coreset", body + settings_block(run))
    rows = results.get("rows", {})
    seeds = results.get("seeds", [])
    body += h.tiles(
        [("fraction kept", f"{results.get('fraction', 0):.0%}"), ("seeds", len(seeds)),
         ("query", str(results.get("query", "–"))), ("strategies", max(len(rows) - 1, 0))]
    )  # fmt: skip
    body += h.h3("Results") + results_table(rows)
    body += h.grid(h.figure(eval_bars(rows)) if rows else "")
    labels = {name: str(row.get("label", name)) for name, row in rows.items()}
    body += h.h3("Loss curves per strategy and precision") + loss_curves(run.path, labels)
    body += h.h3("bf16 vs fp32 selection") + selection_block(results.get("selection", {}), labels)
    stage_s = results.get("stage_s") or {}
    if stage_s:
        body += h.details(
            "Wall time per stage",
            h.table(["stage", "seconds"], sorted(stage_s.items()), numeric=(1,)),
            cls="block",
        )
    subtitle = f"retrain on {results.get('fraction', 0):.0%} of the pool, {len(seeds)} seed(s)"
    return h.Section(run.name, "coreset", body + settings_block(run), subtitle=subtitle)
