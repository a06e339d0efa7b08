"""The view of an `assay build` folder: what the gradient index holds and its loss distribution."""

from __future__ import annotations

import numpy as np

from assay.report import charts
from assay.report import html as h
from assay.report.common import missing_note, settings_block, unfinished_note
from assay.report.runs import Run


def index_tiles(meta: dict) -> str:
    model = meta.get("model") or {}
    lora = model.get("lora")
    return h.tiles(
        [
            ("examples", int(meta.get("num_examples", 0))),
            ("dimensions", int(meta.get("dim", 0))),
            ("modules", len(meta.get("modules", []))),
            ("projection p", str(meta.get("projection_dim", "–"))),
            ("precision", str(meta.get("precision", "–"))),
            ("stored as", str(meta.get("store_dtype", "–"))),
            ("normalizer", str(meta.get("normalizer", "–"))),
            ("preconditioner", str(meta.get("preconditioner", "–"))),
            ("adapter", f"LoRA r={lora.get('rank')}" if isinstance(lora, dict) else "none"),
        ],
        hints={
            "dimensions": "numbers per example: p × p per module, concatenated",
            "precision": "compute precision of the forward/backward that made the gradients",
        },
    )


def loss_charts(run: Run) -> str:
    losses, tokens = run.npy("losses.npy"), run.npy("tokens.npy")
    if losses is None:
        return missing_note("loss distribution", "losses.npy")
    loss = np.asarray(losses, dtype=np.float64)
    charts_html = [h.figure(charts.histogram(loss, "Summed loss per example", "nats"))]
    if tokens is not None and len(tokens) == len(loss):
        n = np.asarray(tokens, dtype=np.float64)
        per_token = np.divide(loss, n, out=np.full_like(loss, np.nan), where=n > 0)
        charts_html.append(h.figure(charts.histogram(per_token, "Mean loss per token", "nats / token")))
        mean = float(loss.sum() / max(n.sum(), 1))
        stats = h.tiles(
            [
                ("tokens", int(n.sum())),
                ("loss / token", mean),
                ("median example loss", float(np.median(loss))),
            ]
        )
    else:
        stats = ""
    return stats + h.grid(*charts_html)


def modules_table(meta: dict) -> str:
    rows = [
        (m["name"], " × ".join(str(s) for s in m["shape"]), m["start"], m["stop"])
        for m in meta.get("modules", [])
    ]
    return h.details(
        f"{len(rows)} gradient modules (column ranges in each row)",
        h.table(["module", "block", "first column", "end column"], rows, numeric=(2, 3)),
        cls="block",
    )


def build_section(run: Run) -> h.Section:
    meta = run.json("index.json")
    body = unfinished_note(run)
    if meta is None:
        body += missing_note("index metadata", "index.json")
        return h.Section(run.name, "build", body + settings_block(run))
    model = meta.get("model") or {}
    data = meta.get("data") or {}
    subtitle = f"{model.get('name', '?')} on {data.get('dataset', '?')}:{data.get('split', '?')}"
    body += index_tiles(meta) + h.h3("Loss of the indexed examples") + loss_charts(run)
    progress = run.json("progress.json")
    if progress and progress.get("batches_done") != progress.get("num_batches"):
        body += h.note_box(f"{progress['batches_done']} of {progress['num_batches']} batches written", "warn")
    body += modules_table(meta) + settings_block(run, [("objective", meta.get("objective", "lm_loss"))])
    return h.Section(run.name, "build", body, subtitle=subtitle)
