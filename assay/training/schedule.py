"""Learning-rate schedules: linear warm-up, then cosine, linear or constant (fine-tuning), or
warm-up / stable / decay (SAEs)."""

from __future__ import annotations

import math
from typing import Literal

ScheduleName = Literal["cosine", "linear", "constant"]


def warmup_steps_for(total_steps: int, warmup_ratio: float, warmup_steps: int) -> int:
    """Explicit warm-up steps win; else a fraction of the run (at least 1 step when > 0)."""
    if warmup_steps > 0:
        return min(warmup_steps, total_steps)
    return min(total_steps, math.ceil(warmup_ratio * total_steps)) if warmup_ratio > 0 else 0


def lr_factor(step: int, total_steps: int, warmup: int, kind: ScheduleName) -> float:
    """Multiplier on the peak learning rate for optimizer step `step` (0-based).

    Warm-up ramps linearly from 1/(warmup+1) to 1 so the first step already moves; decay
    goes from 1 at the end of warm-up towards 0 at the last step.
    """
    if step < warmup:
        return (step + 1) / (warmup + 1)
    if kind == "constant":
        return 1.0
    span = max(total_steps - warmup, 1)
    progress = min((step - warmup) / span, 1.0)
    if kind == "linear":
        return 1.0 - progress
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def warmup_stable_decay(step: int, total_steps: int, warmup: int, decay_fraction: float) -> float:
    """Multiplier for step `step` (0-based) of the warm-up / stable / decay schedule (the SAEs'):
    linear warm-up from 1/warmup to 1 over `warmup` steps, constant, then linear decay to 0
    over the final `decay_fraction` of the steps (reaching 1/decay_steps at the last step)."""
    scale = min(1.0, (step + 1) / warmup) if warmup > 0 else 1.0
    decay_steps = int(total_steps * decay_fraction)
    if decay_steps > 0 and step >= total_steps - decay_steps:
        scale *= (total_steps - step) / decay_steps
    return scale
