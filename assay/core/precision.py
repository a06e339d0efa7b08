"""The precision policy: one object, resolved once, used by every command.

Mixed precision here means what real training does: fp32 master weights, forward and
backward under `torch.autocast`, and everything that accumulates (statistics, optimizer
state, metrics) in fp32 with autocast switched off. Linear algebra runs in fp64.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from assay.core.errors import AssayError

PRECISIONS: tuple[str, ...] = ("auto", "fp32", "bf16", "fp16", "bf16-pure")

STATS_DTYPE = torch.float32
"""Accumulated statistics, normalizers, preconditioners, optimizer state and metrics."""
LINALG_DTYPE = torch.float64
"""Eigendecompositions and inverses."""


def autocast_device_type(device: torch.device | str) -> str:
    """`torch.autocast` wants a device *type*: "cuda:1" -> "cuda"."""
    return torch.device(device).type


def cpu_has_fast_bf16() -> bool:
    """True on CPUs with AMX-BF16 or AVX512-BF16 (where bf16 matmuls beat fp32)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


def slow_bf16_note(precisions: Sequence[str], device: str = "cpu") -> str | None:
    """For an experiment that builds an index at each of `precisions`: a line saying that its bf16
    one will run emulated here (a CPU without bf16 units), or None."""
    on_cpu = device == "cpu" or (device == "auto" and not torch.cuda.is_available())
    if not on_cpu or cpu_has_fast_bf16():
        return None
    if not any(p.startswith("bf16") for p in precisions):
        return None
    return (
        "--index_precisions includes bf16, which this CPU (no AMX or AVX512-BF16) runs emulated, an "
        "order of magnitude slower than fp32: --index_precisions fp32 leaves that index out"
    )


def _resolve_auto(device: torch.device) -> tuple[str, str]:
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported():
            return "bf16", "CUDA device supports bf16"
        return "fp32", "CUDA device lacks fast bf16"
    if device.type == "cpu" and cpu_has_fast_bf16():
        return "bf16", "CPU has AMX/AVX512-BF16"
    return "fp32", f"no fast bf16 on {device.type}"


@dataclass(frozen=True)
class PrecisionPolicy:
    """How tensors are stored and computed. Build with `PrecisionPolicy.resolve`."""

    name: Literal["fp32", "bf16", "fp16", "bf16-pure"]
    device: torch.device
    reason: str

    @classmethod
    def resolve(cls, name: str, device: torch.device | str = "cpu") -> PrecisionPolicy:
        """Turn a user's `--precision` choice into a policy, with the reason for it."""
        device = torch.device(device)
        if name not in PRECISIONS:
            raise AssayError(f"unknown precision {name!r}; choose one of {', '.join(PRECISIONS)}")
        reason = "asked for"
        if name == "auto":
            name, reason = _resolve_auto(device)
        if name == "fp16" and device.type == "cpu":
            reason += " (fp16 on CPU is slow; bf16 is the better mixed precision here)"
        elif name.startswith("bf16") and device.type == "cpu" and not cpu_has_fast_bf16():
            # Without AMX-BF16 or AVX512-BF16, torch falls back to slow bf16 kernels: on an
            # AVX2-only AMD EPYC linear layers ran 6.5x and plain matmuls 140-175x slower than
            # fp32, and `assay build`'s loop 20x (docs/BENCHMARKS.md, "AMD EPYC (AVX2 only...)").
            reason += (
                "; this CPU has no bf16 matmul units (AMX or AVX512-BF16), so bf16 runs emulated, "
                "an order of magnitude slower than fp32, which --precision auto picks here"
            )
        return cls(name=name, device=device, reason=reason)  # type: ignore[arg-type]

    @property
    def weight_dtype(self) -> torch.dtype:
        """Dtype of the model's parameters: fp32 master weights except in bf16-pure."""
        return torch.bfloat16 if self.name == "bf16-pure" else torch.float32

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        """Dtype matmuls run in under autocast, or None when autocast is off."""
        return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.name)

    @property
    def compute_dtype(self) -> torch.dtype:
        """Dtype most activations and gradients have inside the forward/backward."""
        return self.autocast_dtype or self.weight_dtype

    @property
    def uses_loss_scaling(self) -> bool:
        """fp16's narrow exponent range needs the loss scaled so gradients don't underflow."""
        return self.name == "fp16"

    def autocast(self) -> contextlib.AbstractContextManager[object]:
        """The region forward (and backward) run in."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(autocast_device_type(self.device), dtype=self.autocast_dtype)

    def describe(self) -> str:
        """One line for the start of a run: what was chosen and why."""
        return f"precision: {self.name} ({self.reason})"


@contextlib.contextmanager
def full_precision(device: torch.device | str = "cpu") -> Iterator[None]:
    """Switch autocast off: statistics and updates must never accumulate in bf16/fp16."""
    with torch.autocast(autocast_device_type(device), enabled=False):
        yield


def check_finite(tensor: torch.Tensor, what: str, policy: PrecisionPolicy) -> None:
    """Fail with a clear message when fp16 (or anything) over/underflowed to inf or NaN."""
    if not bool(torch.isfinite(tensor).all()):
        hint = (
            "fp16 overflowed; use --precision bf16 (same speed, fp32's range) or fp32"
            if policy.name == "fp16"
            else "check the inputs and the learning rate, or try --precision fp32"
        )
        raise AssayError(f"non-finite values (inf/NaN) in {what}: {hint}")
