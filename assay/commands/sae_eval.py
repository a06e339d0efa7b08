"""`assay sae eval`: reconstruction and splice metrics of an SAE in SAELens format (or its
feature recovery against a ground-truth dictionary)."""

from __future__ import annotations

from typing import Any

from assay.core.console import say
from assay.sae.config import SaeEvalConfig
from assay.sae.evaluate import METRIC_ORDER, evaluate_sae


def format_metrics(metrics: dict[str, float]) -> str:
    """The metrics as aligned `name  value` lines, in a fixed order."""
    keys = [k for k in METRIC_ORDER if k in metrics] + [k for k in metrics if k not in METRIC_ORDER]
    return "\n".join(f"  {k:<22} {metrics[k]:.4f}" for k in keys if isinstance(metrics[k], (int, float)))


def run(cfg: SaeEvalConfig) -> dict[str, Any]:
    metrics = evaluate_sae(cfg)
    say(metrics.pop("about") + ":")
    say(format_metrics(metrics))
    return metrics


Config = SaeEvalConfig
