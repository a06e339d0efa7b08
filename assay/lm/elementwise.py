"""The elementwise math of `assay.lm.lean`'s written-out backwards, eager or compiled.

Two implementations of the same four functions (a SwiGLU gate and a Llama RMSNorm, each forward
and backward):

- `EAGER`: autograd's own ops in the plain graph's order, in place where it can be, so the
  collector's numbers are the plain path's bit for bit (tests/lm/test_lean.py).
- `compiled_kernels()`: the same formulas, functional, through `torch.compile` (`--compile`):
  each function becomes one fused kernel, where eager runs five to nine passes over
  activation-sized tensors, each a fresh buffer. Fused kernels may order a row's sum
  differently, so the results agree with `EAGER` to rounding, not bit for bit. The first call
  of each compiles (seconds; on CPU with the C++ compiler inductor finds); shapes are dynamic,
  so later batches of other lengths do not recompile.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

import torch
import torch.nn.functional as F

from assay.core.errors import AssayError

Pair = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class Kernels:
    """One implementation of the four functions."""

    silu_gate: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    """(gate, up) -> silu(gate) * up."""
    silu_gate_backward: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], Pair]
    """(grad, gate, up) -> (d gate, d up)."""
    rms_norm: Callable[[torch.Tensor, torch.Tensor, float], Pair]
    """(x, weight, eps) -> (weight * x * rstd, rstd) with rstd = rsqrt(mean(x²) + eps) per row."""
    rms_norm_backward: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], Pair]
    """(grad, x, weight, rstd) -> x's two gradient terms: through x * rstd, and through x²."""


def _silu_gate_inplace(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate).mul_(up)


def _silu_gate_backward_inplace(grad: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> Pair:
    d_up = F.silu(gate).mul_(grad)  # MulBackward's two products, then silu_backward
    return torch.ops.aten.silu_backward(grad * up, gate), d_up


def _rms_norm_inplace(x: torch.Tensor, weight: torch.Tensor, eps: float) -> Pair:
    rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return (x * rstd).mul_(weight), rstd


def _rms_norm_backward_inplace(
    grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor
) -> Pair:
    d_normed = grad * weight  # d(w ⊙ n)/dn
    buffer = d_normed * x
    d_rstd = buffer.sum(-1, keepdim=True)  # x ⊙ rstd, rstd broadcast over the row
    d_var = (-0.5 * d_rstd) * rstd.pow(3)  # rsqrt's derivative, as autograd writes it
    d_squares = torch.mul(x, 2.0, out=buffer).mul_(d_var / x.shape[-1])  # mean, then pow(2)
    return d_normed.mul_(rstd), d_squares


EAGER = Kernels(
    _silu_gate_inplace, _silu_gate_backward_inplace, _rms_norm_inplace, _rms_norm_backward_inplace
)


def _silu_gate(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def _silu_gate_backward(grad: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> Pair:
    return torch.ops.aten.silu_backward(grad * up, gate), F.silu(gate) * grad


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> Pair:
    rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return x * rstd * weight, rstd


def _rms_norm_backward(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor) -> Pair:
    d_normed = grad * weight
    d_var = -0.5 * (d_normed * x).sum(-1, keepdim=True) * rstd.pow(3)
    return d_normed * rstd, x * (2.0 * d_var / x.shape[-1])


@cache
def compiled_kernels(device_type: str) -> Kernels:
    """The four functions compiled once per process (inductor; dynamic shapes)."""
    if device_type == "cpu":
        _require_cpp_compiler()

    def compiled(fn: Callable) -> Callable:
        return torch.compile(fn, dynamic=True, fullgraph=True)

    return Kernels(*(compiled(fn) for fn in (_silu_gate, _silu_gate_backward, _rms_norm, _rms_norm_backward)))


def _require_cpp_compiler() -> None:
    """On CPU inductor writes C++: refuse --compile in one line where no compiler is installed."""
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler  # inductor: only when compiling

        get_cpp_compiler()
    except Exception as e:  # inductor raises its own error types across versions
        raise AssayError(
            f"--compile on CPU needs a C++ compiler for torch.compile ({e}); "
            "install gcc or clang, or drop --compile"
        ) from None
