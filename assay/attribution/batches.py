"""What the Python entry points take as a model, batches and a loss, each refused in one line.

Batches are dicts as a DataLoader yields them: their tensors are moved to the model's device
and any other value (a list of texts, an id) reaches `loss_fn` as it is. `loss_fn(model, batch)`
returns one float per example, [B], B the batch's leading size.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from assay.core.errors import AssayError
from assay.lm.packing import SEGMENTS

BATCHES = "an iterable of batches, each a dict of tensors (a list of dicts, or a DataLoader yielding dicts)"


def model_device(model: Any) -> torch.device:
    """The device of the model's parameters, or one line for what is not a model with some."""
    if not isinstance(model, nn.Module):
        raise AssayError(f"model must be a torch nn.Module, not a {type(model).__name__}")
    first = next(model.parameters(), None)
    if first is None:
        raise AssayError(
            f"the model ({type(model).__name__}) has no parameters: attribution needs one with linear layers"
        )
    return first.device


def check_batches(batches: Any, what: str = "batches") -> None:
    """Refuse one batch given instead of a collection of them, or anything that is not an iterable
    of dicts. A list is checked whole here; an iterator's batches are checked as they are read."""
    if isinstance(batches, Mapping):
        raise AssayError(f"{what} must be {BATCHES}, not one dict: pass [batch] for a single batch")
    if isinstance(batches, str | bytes | torch.Tensor) or not isinstance(batches, Iterable):
        raise AssayError(f"{what} must be {BATCHES}, not a {type(batches).__name__}")
    if isinstance(batches, Sequence):
        for batch in batches:
            _check_batch(batch)


def _check_batch(batch: Any) -> None:
    if not isinstance(batch, Mapping):
        raise AssayError(
            f"each batch must be a dict of tensors, e.g. {{'x': x, 'y': y}}, not a {type(batch).__name__}: "
            "for a TensorDataset's batches pass [{'x': x, 'y': y} for x, y in loader]"
        )


def to_device(batch: Any, device: torch.device | str) -> dict[str, Any]:
    """The batch with its tensors on `device` and every other value as it was."""
    _check_batch(batch)
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def batch_examples(batch: Any) -> int | None:
    """Examples in a batch: a packed batch's segments (`assay.lm.packing`), else the leading size
    of its first tensor (None: no tensor tells)."""
    if not isinstance(batch, Mapping):
        return None
    if SEGMENTS in batch:
        return len(batch[SEGMENTS])
    first = next((v for v in batch.values() if isinstance(v, torch.Tensor) and v.ndim), None)
    return None if first is None else int(first.shape[0])


def check_losses(values: Any, batch: Any) -> torch.Tensor:
    """`loss_fn`'s [B] float tensor, or one line saying what it returned instead: a [B-1] or
    [B, 2] result would otherwise leave a zero row or sum two losses into one."""
    size = batch_examples(batch)
    if (
        isinstance(values, torch.Tensor)
        and values.is_floating_point()
        and values.ndim == 1
        and (size is None or values.shape[0] == size)
    ):
        return values
    got = (
        f"a {values.dtype} tensor of shape {list(values.shape)}"
        if isinstance(values, torch.Tensor)
        else f"a {type(values).__name__}"
    )
    b = "B" if size is None else f"B = {size}"
    raise AssayError(
        f"loss_fn must return a float tensor [B], one loss per example ({b}, the batch's leading size), "
        f"not {got}: use an unreduced loss, e.g. F.cross_entropy(..., reduction='none')"
    )
