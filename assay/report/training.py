"""Views of `assay eval` (loss distribution) and `assay finetune` (loss curves) folders."""

from __future__ import annotations

import numpy as np

from assay.report import charts
from assay.report import html as h
from assay.report.common import config_get, missing_note, settings_block, unfinished_note
from assay.report.runs import Run


def eval_section(run: Run) -> h.Section:
    summary = run.json("summary.json") or {}
    body = unfinished_note(run)
    body += h.tiles(
        [
            ("mean loss (nats/token)", summary.get("mean_loss")),
            ("perplexity", summary.get("perplexity")),
            ("examples", summary.get("examples")),
            ("tokens", summary.get("total_tokens")),
            ("precision", str(summary.get("precision", "–"))),
        ]
    )
    records = run.jsonl("losses.jsonl")
    if records:
        per_token = [r["loss"] / r["tokens"] for r in records if r.get("tokens")]
        body += h.figure(charts.histogram(per_token, "Mean loss per token of each example", "nats / token"))
    else:
        body += missing_note("per-example losses", "losses.jsonl")
    data = f"{config_get(run.config, 'data.dataset', '?')}:{config_get(run.config, 'data.split', '?')}"
    subtitle = f"{config_get(run.config, 'model.model', '?')} on {data}"
    return h.Section(run.name, "eval", body + settings_block(run), subtitle=subtitle)


def curves(records: list[dict], keys: list[str]) -> dict[str, tuple[list[float], list[float]]]:
    """{key: (steps, values)} for each key present in the metric records."""
    out = {}
    for key in keys:
        pts = [(r["step"], r[key]) for r in records if isinstance(r.get(key), int | float) and "step" in r]
        if pts:
            out[key] = ([p[0] for p in pts], [p[1] for p in pts])
    return out


def finetune_charts(records: list[dict]) -> str:
    """Train and eval loss against the step, plus learning rate and throughput when logged."""
    found = curves([r for r in records if not r.get("final")], ["train_loss", "eval_loss"])
    losses = {{"train_loss": "train", "eval_loss": "held-out"}[k]: v for k, v in found.items()}
    blocks = []
    if losses:
        blocks.append(
            h.figure(
                charts.line_chart(
                    losses,
                    "Loss",
                    ylabel="nats / token",
                    markers=len(losses.get("held-out", ([], []))[0]) < 30,
                )
            )
        )
    other = curves(records, ["lr", "tokens_per_s", "grad_norm"])
    for key, title in (
        ("lr", "Learning rate"),
        ("grad_norm", "Gradient norm"),
        ("tokens_per_s", "Tokens / s"),
    ):
        if key in other:
            blocks.append(h.figure(charts.line_chart({key: other[key]}, title)))
    return h.grid(*blocks)


def finetune_section(run: Run) -> h.Section:
    summary = run.json("summary.json") or {}
    body = unfinished_note(run)
    body += h.tiles(
        [
            ("train loss", summary.get("train_loss")),
            ("eval loss", summary.get("eval_loss")),
            ("pool loss", summary.get("pool_loss")),
            ("steps", summary.get("steps")),
            ("examples", summary.get("examples")),
            ("trainable params", summary.get("trainable_parameters")),
            ("precision", str(summary.get("precision", "–"))),
            ("train seconds", summary.get("train_s")),
        ]
    )
    records = run.jsonl("metrics.jsonl")
    body += finetune_charts(records) if records else missing_note("training curves", "metrics.jsonl")
    subset = run.config.get("subset") or run.config.get("select")
    subtitle = (
        f"{config_get(run.config, 'model.model', '?')} on {config_get(run.config, 'data.dataset', '?')}"
    )
    if subset:
        subtitle += f", subset {subset}"
    return h.Section(run.name, "finetune", body + settings_block(run), subtitle=subtitle)


def mean_or_none(values: list[float]) -> float | None:
    return float(np.mean(values)) if values else None
