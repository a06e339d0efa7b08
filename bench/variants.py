"""Collector variants `bench/bench_build.py` times beside the default: each a context manager
that, within its block, undoes one of assay's choices (or probes one not made), so the loop
benchmark can show what that choice is worth on the machine it runs on."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

from assay.attribution import collector
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


def own_input_casts(on: bool) -> AbstractContextManager[None]:
    """Within the block (when `on`), every linear layer under autocast casts its own input, as
    before `assay.lm.shared_cast`: the same rows, one cast per layer instead of per input."""
    return _patched(collector, "shared_input_casts", lambda model: nullcontext(0)) if on else nullcontext()
