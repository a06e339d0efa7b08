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
example into the next; the padded batch never makes that position a target either. Filler
tokens round the row's length to a multiple of `ROW_MULTIPLE`: they carry no loss, attention
leaves them out, and every other layer treats tokens one by one, so no example sees them.

Only model types whose attention is called through transformers' attention interface with the
forward's keyword arguments, and whose positions come from position_ids, qualify
(`PACKED_MODEL_TYPES`); sliding-window attention does not (the padded layout here applies no
window). An eager-attention model packs too: its attention then runs through SDPA, the same
numbers up to rounding.
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

MIN_SAVING = 1 / 16
"""A batch is packed when that removes at least this share of its padded positions; below it
the copies into and out of attention's layout cost about what the padding does."""
PACKED_ATTENTION = "assay_packed"
SEGMENTS = "segment_lengths"
"""Batch key of a packed batch: [B] long, each example's token count in row order."""
_REPADDING_KWARG = "assay_repadding"  # how the layout reaches the attention function
PACKED_MODEL_TYPES = frozenset({"llama", "qwen2", "qwen3"})
ROW_MULTIPLE = 256
"""A packed row's length is rounded up to this with filler tokens. CPU kernels (oneDNN's) are set
up, and keep memory, per shape, and a row of every length would be a new shape per batch."""
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


def saves_padding(examples: Examples, positions: np.ndarray) -> bool:
    """Whether the packed row is shorter than the padded batch by `MIN_SAVING` of it."""
    lengths = examples.lengths[positions]
    padded = len(positions) * bucket_length(int(lengths.max()))
    row = -(-int(lengths.sum()) // ROW_MULTIPLE) * ROW_MULTIPLE
    return row <= (1 - MIN_SAVING) * padded


def is_packed(batch: dict[str, torch.Tensor]) -> bool:
    return SEGMENTS in batch


def pack(
    examples: Examples, positions: np.ndarray, device: torch.device | str = "cpu"
) -> dict[str, torch.Tensor]:
    """The examples at `positions` as one row: input_ids, position_ids, labels (-100 where no
    loss and on each example's first token), attention_mask (1 on the examples' tokens) and
    `segment_lengths`. Filler after the examples rounds the row to `ROW_MULTIPLE` tokens: no
    loss, and no example attends to it (`Repadding` leaves it out of attention)."""
    ids, pos, labels, lengths = [], [], [], []
    for p in positions:
        toks = torch.from_numpy(examples.tokens_of(int(p)).astype(np.int64))
        lab = toks.masked_fill(~torch.from_numpy(examples.targets_of(int(p))), -100)
        lab[:1] = -100
        ids.append(toks)
        pos.append(torch.arange(len(toks)))
        labels.append(lab)
        lengths.append(len(toks))
    filler = -sum(lengths) % ROW_MULTIPLE
    ids.append(torch.zeros(filler, dtype=torch.long))
    pos.append(torch.arange(filler))
    labels.append(torch.full((filler,), -100))
    row = torch.cat(ids)[None]
    mask = torch.ones_like(row)
    mask[0, row.shape[1] - filler :] = 0
    return {
        "input_ids": row.to(device),
        "position_ids": torch.cat(pos)[None].to(device),
        "labels": torch.cat(labels)[None].to(device),
        "attention_mask": mask.to(device),
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
    """[Σ n_i] long: the example (row of the padded batch) of each packed example token."""
    return torch.repeat_interleave(torch.arange(len(lengths)), lengths).to(device)


def token_examples(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """[1, row length] long: each position's example; 0 on the filler (which carries no loss)."""
    ids = segment_ids(batch[SEGMENTS], batch["labels"].device)
    return F.pad(ids, (0, batch["labels"].shape[1] - len(ids)))[None]


@dataclass(frozen=True)
class Repadding:
    """Where each token of a packed row sits in the right-padded batch [B, width]."""

    batch: int
    width: int
    flat: torch.Tensor  # [Σ n_i] long: b * width + t of each packed example token

    @classmethod
    def of(cls, lengths: torch.Tensor, device: torch.device | str = "cpu") -> Repadding:
        width = bucket_length(int(lengths.max()))  # the width a padded batch would have
        offsets = torch.cumsum(lengths, 0) - lengths
        token = torch.arange(int(lengths.sum())) - torch.repeat_interleave(offsets, lengths)
        return cls(len(lengths), width, (segment_ids(lengths) * width + token).to(device))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """[1, row, k] packed -> [B, width, k], zeros after each example (filler dropped)."""
        tokens = x[0, : len(self.flat)]
        out = x.new_zeros(self.batch * self.width, x.shape[-1]).index_put_((self.flat,), tokens)
        return out.view(self.batch, self.width, x.shape[-1])

    def heads(self, x: torch.Tensor) -> torch.Tensor:
        """[1, heads, row, d] -> [B, heads, width, d], zeros after each example (filler dropped)."""
        tokens = x[0, :, : len(self.flat)].transpose(0, 1)  # [Σn, heads, d]
        # index_put_, not index_copy_: autograd keeps only the indices, where index_copy_ would
        # keep the queries, keys and values themselves alive until backward
        out = tokens.new_zeros(self.batch * self.width, *tokens.shape[1:]).index_put_((self.flat,), tokens)
        return out.view(self.batch, self.width, *tokens.shape[1:]).transpose(1, 2)

    def unpad_heads(self, x: torch.Tensor, row: int) -> torch.Tensor:
        """[B, heads, width, d] -> [row, heads, d]: the example tokens in packed order, then
        zeros for the filler (its attention output: it feeds no example)."""
        tokens = x.transpose(1, 2).reshape(self.batch * self.width, *x.shape[1:2], x.shape[-1])
        return F.pad(tokens.index_select(0, self.flat), (0, 0, 0, 0, 0, row - len(self.flat)))


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
    """[1, heads, row, d] packed -> SDPA's causal kernel on the examples right-padded into
    [B, heads, width, d] -> [1, row, heads, d]. Zeros after each example are never attended to
    by its real tokens (causal), and their outputs are dropped."""
    repad: Repadding = kwargs[_REPADDING_KWARG]
    device = query.device.type
    if torch.is_autocast_enabled(device):  # SDPA casts them anyway: copy the narrow ones
        dtype = torch.get_autocast_dtype(device)
        query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
    q, k, v = (repad.heads(x) for x in (query, key, value))
    gqa = q.shape[1] != k.shape[1]
    out = F.scaled_dot_product_attention(
        q, k, v, dropout_p=dropout, is_causal=True, scale=scaling, enable_gqa=gqa
    )
    return repad.unpad_heads(out, query.shape[2])[None], None


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
