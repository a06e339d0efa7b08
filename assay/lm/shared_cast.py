"""One autocast cast per input that several linear layers read, the numbers unchanged.

Under autocast each linear layer casts its fp32 input to the autocast dtype itself, so the
layers that read one tensor (a Llama block's q, k and v projections; its MLP's gate and up)
cast the same numbers two or three times. `shared_input_casts` makes the cast once and hands
each layer the same bf16/fp16 values through its own autograd node, `_SharedCast`.

Why a node per layer rather than one tensor they all read: the plain path upcasts each layer's
input gradient to fp32 separately (one `ToCopyBackward` per layer) and autograd adds the three
in fp32. One shared low-precision tensor would have them added in bf16 first, which changes the
gradients. `_SharedCast`'s backward is `ToCopyBackward`'s own upcast, and each node is created
where the plain path creates its cast (just before the layer's matmul), so the backward runs
the same kernels in the same order, and the gradients are the same bit for bit
(tests/lm/test_shared_cast.py checks Llama, Qwen2's biased projections and Qwen3's per-head
norms, in bf16 and fp16).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class _SharedCast(torch.autograd.Function):
    """`low`, the autocast cast of `x` made once outside, as this layer's own cast of `x`."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, low: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.dtype = x.dtype
        return low.view_as(low)  # a tensor of its own per layer, sharing the cast's memory

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return grad.to(ctx.dtype), None  # what ToCopyBackward does


class _LastCast:
    """The cast of the last fp32 input a patched layer read, for the next layer reading it."""

    def __init__(self) -> None:
        self.source: torch.Tensor | None = None
        self.version = -1
        self.low: torch.Tensor | None = None

    def of(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """x cast to dtype: made again unless x is the last input, unchanged in place since."""
        fresh = self.source is x and self.version == x._version and self.low is not None
        if not fresh or self.low is None or self.low.dtype != dtype:
            self.source, self.version, self.low = x, x._version, x.detach().to(dtype)
        return self.low

    def clear(self) -> None:
        self.source = self.low = None


def _linear_forward(layer: nn.Linear, last: _LastCast) -> Callable[[torch.Tensor], torch.Tensor]:
    def forward(x: torch.Tensor) -> torch.Tensor:
        device = x.device.type
        if x.dtype != torch.float32 or not torch.is_autocast_enabled(device):
            last.clear()  # nothing to share: the plain layer, and nothing kept alive
            return F.linear(x, layer.weight, layer.bias)
        low = last.of(x, torch.get_autocast_dtype(device))
        if torch.is_grad_enabled() and x.requires_grad:
            low = _SharedCast.apply(x, low)
        return F.linear(low, layer.weight, layer.bias)

    return forward


@contextmanager
def shared_input_casts(model: nn.Module) -> Iterator[int]:
    """Within the block, the model's plain `nn.Linear` layers (not its output head, not LoRA
    layers) share the autocast cast of an input the previous layer read too; yields how many
    layers were switched. Their own forwards are back on exit."""
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    last = _LastCast()
    patched = [m for m in model.modules() if type(m) is nn.Linear and m is not head]
    for layer in patched:
        layer.forward = _linear_forward(layer, last)  # type: ignore[method-assign,assignment]
    try:
        yield len(patched)
    finally:
        last.clear()
        for layer in patched:
            del layer.forward
