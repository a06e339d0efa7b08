"""Collector variants `bench/bench_build.py` times beside the default: each a context manager
that, within its block, undoes one of assay's choices (or probes one not made), so the loop
benchmark can show what that choice is worth on the machine it runs on."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch

from assay.lm import lean, padding


@contextmanager
def _patched(owner: Any, name: str, value: Any) -> Iterator[None]:
    """`owner.name = value` within the block; after it, the owner's own attribute as it was (or
    none, so that an inherited one shows through again)."""
    own = vars(owner)
    had, saved = name in own, own.get(name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        if had:
            setattr(owner, name, saved)
        else:
            delattr(owner, name)


def plain_rotary_embedding(on: bool) -> AbstractContextManager[None]:
    """Within the block (when `on`), the collector leaves transformers' rotary embedding as is."""
    return _patched(lean, "_llama_rotary_globals", lambda model: []) if on else nullcontext()


def forced_mask(on: bool) -> AbstractContextManager[None]:
    """Within the block (when `on`), forward passes are given the padding mask even where it is
    not needed."""
    return _patched(padding, "mask_needed", lambda model, mask: mask is not None) if on else nullcontext()


def norm_output_cast(on: bool) -> AbstractContextManager[None]:
    """Within the block (when `on`), each frozen RMSNorm's output is cast to the autocast dtype
    once, so the layers that share it (q, k, v; gate, up) read one copy instead of casting their
    own, and their input gradients meet in that dtype before one cast back.

    A probe of what one cast per shared input would save in time, not an option: its gradient
    sum runs in the autocast dtype, so its rows differ from the default's.
    """
    if not on:
        return nullcontext()
    apply = lean._FrozenRMSNorm.apply  # inherited from torch.autograd.Function

    def cast_once(*args: object) -> torch.Tensor:
        out = apply(*args)
        device = out.device.type
        return out.to(torch.get_autocast_dtype(device)) if torch.is_autocast_enabled(device) else out

    return _patched(lean._FrozenRMSNorm, "apply", cast_once)
