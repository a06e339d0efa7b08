"""`assay finetune`: fine-tune a causal LM (full or LoRA) on a dataset or a selected subset."""

from __future__ import annotations

from typing import Any

from assay.core.console import say
from assay.training.finetune import FinetuneConfig, finetune

Config = FinetuneConfig


def run(cfg: FinetuneConfig) -> dict[str, Any]:
    summary = finetune(cfg)
    losses = {k: summary[k] for k in ("train_loss", "eval_loss", "pool_loss") if summary.get(k) is not None}
    say(
        f"{cfg.out}: " + ", ".join(f"{k} {v:.4f}" for k, v in losses.items()) + f" ({summary['steps']} steps)"
    )
    return summary
