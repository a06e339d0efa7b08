"""Padding-free batches: a batch's examples concatenated into one row, attention kept within each.

A right-padded batch ([B, T], `assay.lm.data.collate`) runs every linear layer, norm and
elementwise step over its padding too: on 17 ABC tunes sorted by length, 2,048-token batches
held 1.2 padded positions per real token. A packed batch is one row [1, Σ n_i] of the examples'
tokens, position_ids restarting at 0 for each, so only real tokens pass through those layers.

Attention must still stay within each example. transformers would build a [Σn, Σn]
block-diagonal mask for that and run SDPA over the whole row (quadratic in the batch, not the
example). Here a registered attention function (`PACKED_ATTENTION`) copies the row's queries,
keys and values into the right-padded [B, heads, width, d] layout, runs SDPA's causal kernel
there as a padded batch would, and copies the real tokens' outputs back: only attention sees the
padding. Each example sees exactly the queries, keys and values it would see alone, rotary
positions included, so its outputs, loss and gradients are those of the padded batch up to the
order of floating-point sums (tests/lm/test_packing.py). (SDPA once per example instead was
slower on CPU: each slice's gradient is a full-row buffer, and the kernel runs best batched.)

The label of each example's first token is -100 in a packed row, so no target crosses from one
example into the next; the padded batch never makes that position a target either.

Only model types whose attention is called through transformers' attention interface with the
forward's keyword arguments, and whose positions come from position_ids, qualify
(`PACKED_MODEL_TYPES`); sliding-window attention does not (the slice would not apply it).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from assay.lm.data import Examples, bucket_length

PACKED_ATTENTION = "assay_packed"
SEGMENTS = "segment_lengths"
"""Batch key of a packed batch: [B] long, each example's token count in row order."""
_REPADDING_KWARG = "assay_repadding"  # how the layout reaches the attention function
PACKED_MODEL_TYPES = frozenset({"llama", "qwen2", "qwen3"})
_registered = False


def packable(model: Any) -> bool:
    """Whether `model`'s forward gives the same numbers on a packed batch (see the module)."""
    config = getattr(model, "config", None)
    if getattr(config, "model_type", None) not in PACKED_MODEL_TYPES:
        return False
    layer_types = set(getattr(config, "layer_types", None) or ["full_attention"])
    if getattr(config, "use_sliding_window", False) or layer_types != {"full_attention"}:
        return False
    return getattr(config, "_attn_implementation", None) in ("sdpa", "eager")


def is_packed(batch: dict[str, torch.Tensor]) -> bool:
    return SEGMENTS in batch


def pack(
    examples: Examples, positions: np.ndarray, device: torch.device | str = "cpu"
) -> dict[str, torch.Tensor]:
    """The examples at `positions` as one row: input_ids, position_ids, labels (-100 where no
    loss and on each example's first token), an all-ones attention_mask (no padding) and
    `segment_lengths`."""
    ids, pos, labels, lengths = [], [], [], []
    for p in positions:
        toks = torch.from_numpy(examples.tokens_of(int(p)).astype(np.int64))
        lab = toks.clone()
        lab[: max(int(examples.loss_start[p]), 1)] = -100
        ids.append(toks)
        pos.append(torch.arange(len(toks)))
        labels.append(lab)
        lengths.append(len(toks))
    row = torch.cat(ids)[None]
    return {
        "input_ids": row.to(device),
        "position_ids": torch.cat(pos)[None].to(device),
        "labels": torch.cat(labels)[None].to(device),
        "attention_mask": torch.ones_like(row).to(device),
        SEGMENTS: torch.tensor(lengths, dtype=torch.long),
    }


def forward_inputs(batch: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Keyword inputs of one forward over a packed batch (run it inside `packed_attention`)."""
    return {
        "input_ids": batch["input_ids"],
        "position_ids": batch["position_ids"],
        "use_cache": False,
        _REPADDING_KWARG: Repadding.of(batch[SEGMENTS], batch["input_ids"].device),
    }


def segment_ids(lengths: torch.Tensor, device: torch.device | str = "cpu") -> torch.Tensor:
    """[Σ n_i] long: the example (row of the padded batch) of each packed token."""
    return torch.repeat_interleave(torch.arange(len(lengths)), lengths).to(device)


@dataclass(frozen=True)
class Repadding:
    """Where each token of a packed row sits in the right-padded batch [B, width]."""

    batch: int
    width: int
    flat: torch.Tensor  # [Σ n_i] long: b * width + t of each packed token

    @classmethod
    def of(cls, lengths: torch.Tensor, device: torch.device | str = "cpu") -> Repadding:
        width = bucket_length(int(lengths.max()))  # the width a padded batch would have
        offsets = torch.cumsum(lengths, 0) - lengths
        token = torch.arange(int(lengths.sum())) - torch.repeat_interleave(offsets, lengths)
        return cls(len(lengths), width, (segment_ids(lengths) * width + token).to(device))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """[1, Σ n_i, k] packed -> [B, width, k], zeros after each example."""
        out = x.new_zeros(self.batch * self.width, x.shape[-1]).index_copy_(0, self.flat, x[0])
        return out.view(self.batch, self.width, x.shape[-1])

    def heads(self, x: torch.Tensor) -> torch.Tensor:
        """[1, heads, Σ n_i, d] -> [B, heads, width, d], zeros after each example."""
        tokens = x[0].transpose(0, 1)  # [Σn, heads, d]
        out = tokens.new_zeros(self.batch * self.width, *tokens.shape[1:]).index_copy_(0, self.flat, tokens)
        return out.view(self.batch, self.width, *tokens.shape[1:]).transpose(1, 2)

    def unpad_heads(self, x: torch.Tensor) -> torch.Tensor:
        """[B, heads, width, d] -> [Σ n_i, heads, d]: the real tokens, in packed order."""
        return (
            x.transpose(1, 2)
            .reshape(self.batch * self.width, *x.shape[1:2], x.shape[-1])
            .index_select(0, self.flat)
        )


def _attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """[1, heads, Σn, d] packed -> SDPA's causal kernel on the examples right-padded into
    [B, heads, width, d] -> [1, Σn, heads, d]. Zeros after each example are never attended to
    by its real tokens (causal), and their outputs are dropped."""
    repad: Repadding = kwargs[_REPADDING_KWARG]
    device = query.device.type
    if torch.is_autocast_enabled(device):  # SDPA casts them anyway: copy the narrow ones
        dtype = torch.get_autocast_dtype(device)
        query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
    q, k, v = (repad.heads(x) for x in (query, key, value))
    gqa = q.shape[1] != k.shape[1]
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling, enable_gqa=gqa)
    return repad.unpad_heads(out)[None], None


@contextmanager
def packed_attention(model: Any) -> Iterator[None]:
    """Within the block the model attends within each packed example (see the module)."""
    global _registered
    if not _registered:
        from transformers import AttentionInterface  # lazy: transformers is imported with the model

        AttentionInterface.register(PACKED_ATTENTION, _attention)
        _registered = True
    config = model.config
    before = config._attn_implementation
    config._attn_implementation = PACKED_ATTENTION
    try:
        yield
    finally:
        config._attn_implementation = before
