"""`assay eval`: per-example and mean loss of a model on a dataset."""

from __future__ import annotations

from typing import Any

from assay.core.console import say
from assay.training.evaluate import EvalConfig, evaluate

Config = EvalConfig


def run(cfg: EvalConfig) -> dict[str, Any]:
    summary = evaluate(cfg)
    say(
        f"{cfg.data.dataset}:{cfg.data.split}: {summary['mean_loss']:.4f} nats/token "
        f"over {summary['total_tokens']:,} tokens ({summary['examples']} examples)"
    )
    return summary
