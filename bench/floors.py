"""The floor of gradient collection: the fastest plain forward+backward (a training step minus the
optimizer) torch and transformers give over the same examples, chosen among attention paths and
batch layouts side by side.

Variants (`FLOORS`), each a training step with parameter gradients over the same token batches:
  eager         transformers' eager attention, right-padded batches with the padding mask
  sdpa          SDPA with the padding mask (a 4-D boolean mask; what HF does given a padded batch)
  sdpa-causal   SDPA on the same right-padded batches without a mask: causal attention never lets
                a real token see the padding to its right, so real tokens' outputs and gradients
                are the masked ones (SDPA's `is_causal` kernel; what bergson does)
  sdpa-packed   each batch's examples concatenated into one row with restarting position_ids
                (padding-free); transformers turns that into a block-diagonal causal mask
  sdpa-segments the same packed row; attention alone sees the examples right-padded, one batched
                causal SDPA call (`assay.lm.packing`, what `assay build` runs on the models it packs)
  flash-varlen  the same packed row through `attn_implementation="flash_attention_2"` (CUDA and
                the flash-attn package only: its variable-length kernel attends within each example)

Losses are summed next-token cross-entropy of the real tokens, in fp32, as assay's.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from assay.core.config import ModelConfig
from assay.core.precision import PrecisionPolicy
from assay.lm import packing
from assay.lm.data import Examples, collate
from assay.lm.losses import token_losses
from assay.lm.models import load_model


@dataclass(frozen=True)
class Floor:
    """One way to run the plain forward+backward."""

    name: str
    attention: str
    """transformers' attn_implementation."""
    layout: str
    """masked: right-padded with the mask; causal: right-padded, no mask; packed: one row per batch;
    segments: one row per batch, attention on the examples re-padded (`assay.lm.packing`)."""


FLOORS = {
    f.name: f
    for f in (
        Floor("eager", "eager", "masked"),
        Floor("sdpa", "sdpa", "masked"),
        Floor("sdpa-causal", "sdpa", "causal"),
        Floor("sdpa-packed", "sdpa", "packed"),
        Floor("sdpa-segments", "sdpa", "segments"),
        Floor("flash-varlen", "flash_attention_2", "packed"),
    )
}


def available(name: str, device: torch.device) -> str | None:
    """Why a floor cannot run here, or None."""
    if FLOORS[name].attention != "flash_attention_2":
        return None
    if device.type != "cuda":
        return "flash_attention_2 needs CUDA"
    try:
        import flash_attn  # noqa: F401  (only asking whether it is installed)
    except ImportError:
        return "the flash-attn package is not installed"
    return None


def packed(examples: Examples, positions: np.ndarray, device: torch.device) -> dict[str, Any]:
    """The batch's examples as one row [1, Σ n_i]: input_ids, position_ids restarting at 0 for each
    example, labels -100 before each example's first loss position (so no target crosses examples)."""
    ids, pos, labels = [], [], []
    for p in positions:
        toks = torch.from_numpy(examples.tokens_of(int(p)).astype(np.int64))
        lab = toks.clone()
        lab[: int(examples.loss_start[p])] = -100
        ids.append(toks), pos.append(torch.arange(len(toks))), labels.append(lab)
    return {
        "input_ids": torch.cat(ids)[None].to(device),
        "position_ids": torch.cat(pos)[None].to(device),
        "labels": torch.cat(labels)[None].to(device),
        "use_cache": False,  # transformers looks for packed rows only without a cache
    }


def floor_batches(
    floor: Floor, examples: Examples, batches: list[np.ndarray], pad_id: int, device: torch.device
) -> list[dict[str, Any]]:
    """The model's keyword inputs plus `labels`, per batch, in the floor's layout."""
    out = []
    for positions in batches:
        if floor.layout == "packed":
            out.append(packed(examples, positions, device))
            continue
        if floor.layout == "segments":
            out.append(packing.pack(examples, positions, device))
            continue
        b = collate(examples, positions, pad_id, device)
        if floor.layout == "causal":
            b = {"input_ids": b["input_ids"], "labels": b["labels"]}
        out.append(b)
    return out


def floor_loss(model: Any, batch: dict[str, Any], policy: PrecisionPolicy) -> torch.Tensor:
    """The batch's summed next-token loss through the plain forward, in the floor's layout."""
    segments = packing.is_packed(batch)
    inputs = packing.forward_inputs(batch) if segments else {k: v for k, v in batch.items() if k != "labels"}
    with policy.autocast(), packing.packed_attention(model) if segments else nullcontext():
        logits = model(**inputs).logits
    return token_losses(logits, batch["labels"]).sum()


def floor_pass(model: Any, batches: list[dict[str, Any]], policy: PrecisionPolicy) -> None:
    """A training step without the optimizer: loss, backward into every parameter's .grad."""
    for batch in batches:
        floor_loss(model, batch, policy).backward()
        model.zero_grad(set_to_none=True)
    if policy.device.type == "cuda":
        torch.cuda.synchronize()


def load_floor_models(model_name: str, names: list[str], policy: PrecisionPolicy) -> dict[str, Any]:
    """One model per attention implementation the named floors use (trainable, fp32 masters)."""
    models: dict[str, Any] = {}
    for name in names:
        attention = FLOORS[name].attention
        if attention not in models:
            models[attention] = load_model(ModelConfig(model=model_name), policy, attention)
    return models


def time_alternating(passes: dict[str, Callable[[], Any]], repeats: int) -> dict[str, list[float]]:
    """Seconds of each pass, `repeats` times, the passes alternated (load drift hits all alike);
    one untimed warm-up round first (every shape once, every path)."""
    for run in passes.values():
        run()
    times: dict[str, list[float]] = {name: [] for name in passes}
    for _ in range(repeats):
        for name, run in passes.items():
            t = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - t)
    return times
