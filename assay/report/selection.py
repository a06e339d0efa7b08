"""The view of an `assay filter` run: what was kept, how the pool scored, the kept examples' texts.

Reads summary.json, selection.jsonl (rank order, with each example's weight for weighted
strategies), scores.npy (every pool example's score) and texts.jsonl (the first kept
examples' texts, written by the filter run for this page).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from assay.report import charts
from assay.report import html as h
from assay.report.common import config_get, missing_note, settings_block, unfinished_note
from assay.report.runs import Run

SHOWN = 20
"""Kept examples listed with their text."""


def _tiles(summary: dict[str, Any]) -> str:
    kept, pool = summary.get("num_selected"), summary.get("pool_size")
    share = kept / pool if isinstance(kept, int) and isinstance(pool, int) and pool else None
    tiles: list[tuple[str, Any]] = [("kept", kept), ("pool", pool), ("kept share", share)]
    tiles.append(("index precision", summary.get("precision", "–")))
    tiles += [(k, summary[k]) for k in ("objective", "mean_distance", "radius") if k in summary]
    return h.tiles(tiles)


def _scores_figure(run: Run, summary: dict[str, Any]) -> str:
    """The pool's scores (a score strategy) with the kept range, or the kept examples' weights."""
    if summary.get("kind") == "coverage":
        weights = [
            r["weight"] for r in run.jsonl("selection.jsonl") if isinstance(r.get("weight"), int | float)
        ]
        if not weights:
            return ""
        title = "How many pool examples each kept example stands for (its weight)"
        return h.figure(charts.histogram(weights, title, "weight"))
    scores = run.npy("scores.npy")
    if scores is None:
        return missing_note("the pool's scores", "scores.npy")
    low, high = (summary.get("score_range") or [None, None])[:2]
    tail = "lowest" if summary.get("lowest") else "highest"
    caption = f"kept: the {tail} scores, {h.fmt(low)} to {h.fmt(high)}" if low is not None else ""
    return h.figure(charts.histogram(np.asarray(scores), "Every pool example's score", "score"), caption)


def _kept_table(run: Run) -> str:
    records = run.jsonl("selection.jsonl", limit=SHOWN)
    if not records:
        return missing_note("the selection", "selection.jsonl")
    texts = {
        int(r["id"]): r["text"]
        for r in run.jsonl("texts.jsonl")
        if "id" in r and isinstance(r.get("text"), str)
    }
    weighted = any("weight" in r for r in records)
    headers = ["rank", "id", "weight" if weighted else "score", "text"]
    rows = [
        [r.get("rank", "–"), r.get("id", "–"), r.get("weight" if weighted else "score", "–"),
         h.folded_text(texts.get(int(r.get("id", -1)), "–"))]
        for r in records
    ]  # fmt: skip
    return h.table(headers, rows, numeric=(0, 1, 2), raw_columns=(3,))


def filter_section(run: Run) -> h.Section:
    """Tiles, the scores (or weights) figure and the first kept examples with their texts."""
    summary = run.json("summary.json") or {}
    body = unfinished_note(run) + _tiles(summary) + _scores_figure(run, summary)
    body += h.h3(f"The first {SHOWN} kept examples, in the strategy's order") + _kept_table(run)
    strategy = summary.get("strategy", config_get(run.config, "strategy", "?"))
    subtitle = f"{strategy} ({summary.get('kind', 'score')}), query {summary.get('query', '?')}, of "
    subtitle += str(config_get(run.config, "data.dataset", "?"))
    return h.Section(run.name, run.command, body + settings_block(run), subtitle=subtitle)
