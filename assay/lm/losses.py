"""Per-example language-model losses: the quantity every pillar starts from."""

from __future__ import annotations

from contextlib import nullcontext

import numpy as np
import torch
import torch.nn.functional as F

from assay.core.precision import PrecisionPolicy, full_precision
from assay.core.progress import Progress
from assay.lm.data import Examples, collate, token_batches
from assay.lm.head_loss import chunked_head_losses, fusable_head, head_bypassed
from assay.lm.packing import SEGMENTS, is_packed, packed_attention, token_examples
from assay.lm.packing import forward_inputs as packed_inputs
from assay.lm.padding import forward_inputs


def token_losses(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """[B, T] cross-entropy of each next-token target in fp32 (0 where labels are -100)."""
    shift_logits = logits[:, :-1].float()  # [B, T-1, V]
    shift_labels = labels[:, 1:]  # [B, T-1]
    loss = F.cross_entropy(shift_logits.transpose(1, 2), shift_labels, ignore_index=-100, reduction="none")
    return F.pad(loss, (1, 0))


def example_losses(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """[B] summed token loss of each example (the loss whose gradient we attribute).

    The head and its loss run chunk-wise where that is exact (see `assay.lm.head_loss`), so
    the [tokens, vocabulary] logits are never held at once; the padding mask is left out where
    that is exact (see `assay.lm.padding`). A packed batch (`assay.lm.packing`) is one row of
    several examples: its token losses are summed per example.
    """
    packed = is_packed(batch)
    inputs = (
        packed_inputs(batch)
        if packed
        else forward_inputs(model, batch["input_ids"], batch.get("attention_mask"))
    )
    head = fusable_head(model)
    with packed_attention(model) if packed else nullcontext():
        if head is not None:
            with head_bypassed(model, head) as captured:
                model(**inputs)
            assert captured.hidden is not None
            losses = chunked_head_losses(captured.hidden, head, batch["labels"])
        else:
            logits = model(**inputs).logits
            with full_precision(logits.device):
                losses = token_losses(logits, batch["labels"])
    return per_example(losses, batch)


def per_example(token_values: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """[B] sums of [rows, T] per-position values over each example's positions: row b is
    example b, or (a packed batch) one row holds them all."""
    if not is_packed(batch):
        return token_values.sum(dim=1)
    examples = token_examples(batch)[0]
    return token_values.new_zeros(len(batch[SEGMENTS])).index_add(0, examples, token_values[0])


@torch.no_grad()
def evaluate_losses(
    model: torch.nn.Module,
    examples: Examples,
    policy: PrecisionPolicy,
    pad_id: int,
    token_batch_size: int = 4096,
    desc: str = "loss",
) -> np.ndarray:
    """[N] summed loss of each example, in the examples' order."""
    out = np.zeros(len(examples), dtype=np.float64)
    with Progress(len(examples), desc) as bar:
        for positions in token_batches(examples, token_batch_size):
            batch = collate(examples, positions, pad_id, policy.device)
            with policy.autocast():
                losses = example_losses(model, batch)
            out[positions] = losses.double().cpu().numpy()
            bar.update(len(positions), int(batch["attention_mask"].sum()))
    return out
