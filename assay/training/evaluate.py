"""How well a model predicts a dataset, per example and per token (`assay eval`)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import tyro

from assay.core.config import DataConfig, ModelSource, RuntimeConfig
from assay.core.errors import AssayError
from assay.core.runs import run_folder, write_json
from assay.lm.data import load_examples
from assay.lm.losses import evaluate_losses
from assay.lm.models import load_model, load_tokenizer, setup_runtime


@dataclass
class EvalConfig:
    """Per-example and mean loss (nats/token) of a model on a dataset."""

    out: tyro.conf.Positional[str]
    """Output folder (written atomically; holds losses.jsonl and summary.json). An interrupted
    eval keeps no partial work: rerunning it starts afresh."""
    model: tyro.conf.OmitArgPrefixes[ModelSource] = field(default_factory=ModelSource)
    data: tyro.conf.OmitArgPrefixes[DataConfig] = field(default_factory=DataConfig)
    runtime: tyro.conf.OmitArgPrefixes[RuntimeConfig] = field(default_factory=RuntimeConfig)
    token_batch_size: int = 4096
    """Most tokens (padding included) in one forward batch."""
    overwrite: bool = False
    """Replace a finished run in OUT."""

    def __post_init__(self) -> None:
        if self.token_batch_size < 1:
            raise AssayError(f"--token_batch_size must be positive, got {self.token_batch_size}")


def mean_token_loss(
    model_cfg: ModelSource, data_cfg: DataConfig, runtime: RuntimeConfig, token_batch_size: int = 4096
) -> dict[str, Any]:
    """Load, tokenize and evaluate: per-example summed losses and the token-weighted mean."""
    _, policy = setup_runtime(runtime)
    tokenizer = load_tokenizer(model_cfg)
    _, examples = load_examples(data_cfg, tokenizer)
    model = load_model(model_cfg, policy, runtime.attention)
    losses = evaluate_losses(
        model,
        examples,
        policy,
        tokenizer.pad_token_id,
        token_batch_size,
        desc=f"loss {data_cfg.dataset}:{data_cfg.split}",
    )
    counts = examples.num_loss_tokens()
    return {
        "ids": examples.ids,
        "losses": losses,
        "tokens": counts,
        "mean_loss": float(losses.sum() / max(counts.sum(), 1)),
        "examples": len(examples),
        "total_tokens": int(counts.sum()),
        "precision": policy.name,
    }


def evaluate(cfg: EvalConfig) -> dict[str, Any]:
    """Write losses.jsonl (per example) and summary.json (mean nats/token, perplexity) to cfg.out."""
    with run_folder(cfg.out, "eval", cfg, cfg.overwrite, resumable=False) as run:
        result = mean_token_loss(cfg.model, cfg.data, cfg.runtime, cfg.token_batch_size)
        with open(run.path / "losses.jsonl", "w") as f:
            for i, loss, n in zip(result["ids"], result["losses"], result["tokens"]):
                f.write(json.dumps({"id": int(i), "loss": float(loss), "tokens": int(n)}) + "\n")
        summary = {k: result[k] for k in ("mean_loss", "examples", "total_tokens", "precision")}
        summary["perplexity"] = math.exp(summary["mean_loss"])
        write_json(run.path / "summary.json", summary)
    return summary


def token_weighted_mean(losses: np.ndarray, tokens: np.ndarray) -> float:
    """Mean loss per token over examples with summed losses."""
    return float(np.sum(losses) / max(int(np.sum(tokens)), 1))
