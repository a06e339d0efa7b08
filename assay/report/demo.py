"""The overview of a folder that holds other runs (the demo, an experiment): what is inside."""

from __future__ import annotations

from typing import Any

from assay.report import html as h
from assay.report.common import config_get, settings_block, unfinished_note
from assay.report.runs import Run

WHAT = {
    "build": "gradient index of the training data",
    "score": "attribution of queries to training examples",
    "coreset": "data selection proven by retraining",
    "sae train": "sparse autoencoder and its feature browser",
    "sae eval": "sparse autoencoder evaluation",
    "eval": "held-out loss",
    "finetune": "fine-tuning run",
    "filter": "selected training examples",
}


def _number_tables(run: Run) -> str:
    """Every top-level JSON file of flat values (e.g. the demo's losses.json) as headline tiles."""
    blocks = []
    for path in sorted(run.path.glob("*.json")):
        if path.name in ("config.json", "run.json"):
            continue
        data = run.json(path.name)
        if not isinstance(data, dict):
            continue
        flat = [
            (k, v) for k, v in data.items() if isinstance(v, int | float | str) and not isinstance(v, bool)
        ]
        nested = [(f"{k}: {k2}", v2) for k, v in data.items() if isinstance(v, dict) for k2, v2 in v.items()
                  if isinstance(v2, int | float) and not isinstance(v2, bool)]  # fmt: skip
        items = (flat + nested)[:16]
        if items:
            blocks.append(f"<h4>{h.esc(path.stem.replace('_', ' '))}</h4>" + h.tiles(items))
    return "".join(blocks)


def demo_overview(run: Run, children: list[Run]) -> h.Section:
    """Headline numbers and the list of stages, each with one line on what it shows."""
    body = unfinished_note(run)
    rows: list[tuple[Any, ...]] = []
    for child in children:
        status = "done" if child.finished else "unfinished"
        rows.append((child.name, f"assay {child.command}", WHAT.get(child.command, ""), status))
    model = config_get(run.config, "model") or config_get(run.config, "model.model", "")
    intro = (
        f"This folder holds {len(children)} runs made by one `assay {run.command}`. "
        "Each has its own section below; the contents on the left jump to them."
    )
    body += f"<p>{h.esc(intro)}</p>"
    body += _number_tables(run)
    if rows:
        body += h.h3("Stages") + h.table(["folder", "command", "what it shows", "status"], rows)
    body += settings_block(run)
    subtitle = f"model {model}" if isinstance(model, str) and model else ""
    return h.Section(run.name, run.command, body, subtitle=subtitle)
