"""Collector variants `bench/bench_build.py` times beside the default: each a context manager
that, within its block, undoes one of assay's choices (or probes one not made), so the loop
benchmark can show what that choice is worth on the machine it runs on."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from assay.lm import lean, padding


@contextmanager
def plain_rotary_embedding(on: bool) -> Iterator[None]:
    """Within the block (when `on`), the collector leaves transformers' rotary embedding as is."""
    saved = lean._llama_rotary_globals
    if on:
        lean._llama_rotary_globals = lambda model: []  # type: ignore[assignment]
    try:
        yield
    finally:
        lean._llama_rotary_globals = saved  # type: ignore[assignment]


@contextmanager
def forced_mask() -> Iterator[None]:
    """Within the block, forward passes are given the padding mask even where it is not needed."""
    saved = padding.mask_needed
    padding.mask_needed = lambda model, mask: mask is not None  # type: ignore[assignment]
    try:
        yield
    finally:
        padding.mask_needed = saved


@contextmanager
def norm_output_cast(on: bool) -> Iterator[None]:
    """Within the block (when `on`), each frozen RMSNorm's output is cast to the autocast dtype
    once, so the layers that share it (q, k, v; gate, up) read one copy instead of casting their
    own, and their input gradients meet in that dtype before one cast back.

    A probe of what one cast per shared input would save in time, not an option: its gradient
    sum runs in the autocast dtype, so its rows differ from the default's.
    """
    norm = lean._FrozenRMSNorm
    saved = norm.apply  # inherited from torch.autograd.Function: deleting the patch restores it

    def apply(*args: object) -> torch.Tensor:
        out = saved(*args)
        dtype = torch.get_autocast_dtype(out.device.type)
        return out.to(dtype) if torch.is_autocast_enabled(out.device.type) else out

    if on:
        norm.apply = apply  # type: ignore[method-assign]
    try:
        yield
    finally:
        if on:
            del norm.apply
