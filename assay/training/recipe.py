"""A fine-tuning recipe: optimizer, learning-rate schedule and how examples become steps.

One typed object shared by `assay finetune`, `assay validate` (which retrains the recipe on
random subsets) and the metagradient replay (which differentiates through it), so the three
can never drift apart.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import typing
from dataclasses import dataclass

import numpy as np
import torch

from assay.core.config import refuse_non_finite
from assay.core.errors import AssayError
from assay.training.schedule import ScheduleName, lr_factor, warmup_steps_for

Step = tuple[int, np.ndarray]
"""(epoch, ids of the examples in this optimizer step)."""
SCHEDULES: tuple[str, ...] = typing.get_args(ScheduleName)


@dataclass
class TrainRecipe:
    """How the model is trained: AdamW, its schedule and its batches."""

    learning_rate: float = 1e-4
    """Peak learning rate (AdamW)."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay."""
    adam_betas: tuple[float, float] = (0.9, 0.999)
    """AdamW's beta1 and beta2."""
    adam_eps: float = 1e-8
    """AdamW's epsilon."""
    num_epochs: int = 1
    """Passes over the (sub)set."""
    max_steps: int = 0
    """Stop after this many optimizer steps (0: run every epoch to the end)."""
    effective_batch_size: int = 32
    """Examples per optimizer step."""
    micro_batch_size: int = 8
    """Examples per forward/backward; gradients accumulate over effective/micro of them."""
    schedule: ScheduleName = "cosine"
    """Learning-rate decay after warm-up."""
    warmup_ratio: float = 0.1
    """Fraction of the steps spent warming up linearly (ignored when --warmup_steps > 0)."""
    warmup_steps: int = 0
    """Warm-up steps (0: use --warmup_ratio)."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this (0: no clipping)."""

    def __post_init__(self) -> None:
        _check_types(self)
        refuse_non_finite(self)
        if self.schedule not in SCHEDULES:
            raise AssayError(f"--schedule must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}")
        if self.effective_batch_size < 1 or self.micro_batch_size < 1:
            raise AssayError("--effective_batch_size and --micro_batch_size must be >= 1")
        if self.effective_batch_size % self.micro_batch_size:
            raise AssayError(
                f"--effective_batch_size {self.effective_batch_size} must be a multiple of "
                f"--micro_batch_size {self.micro_batch_size}"
            )
        if self.num_epochs < 1 or not 0 < self.learning_rate < math.inf:
            raise AssayError("--num_epochs must be >= 1 and --learning_rate a finite number > 0")
        if self.max_steps < 0 or self.warmup_steps < 0 or not 0.0 <= self.warmup_ratio <= 1.0:
            raise AssayError("--max_steps and --warmup_steps must be >= 0 and --warmup_ratio in [0, 1]")
        if not (0 <= self.weight_decay < math.inf and 0 <= self.max_grad_norm < math.inf):
            raise AssayError("--weight_decay and --max_grad_norm must be finite numbers >= 0")
        if not 0 < self.adam_eps < math.inf:
            raise AssayError(f"--adam_eps must be a finite number > 0, got {self.adam_eps}")

    def steps(self, plan: list[np.ndarray]) -> list[Step]:
        """Each epoch's ids (in visit order) cut into optimizer steps; the last of an epoch may be
        short; at most --max_steps of them."""
        steps = [
            (epoch, ids[start : start + self.effective_batch_size])
            for epoch, ids in enumerate(plan)
            for start in range(0, len(ids), self.effective_batch_size)
        ]
        return steps[: self.max_steps] if self.max_steps > 0 else steps

    def learning_rates(self, total_steps: int) -> list[float]:
        """The learning rate of every optimizer step of a run of `total_steps` steps."""
        warmup = warmup_steps_for(total_steps, self.warmup_ratio, self.warmup_steps)
        return [
            self.learning_rate * lr_factor(s, total_steps, warmup, self.schedule) for s in range(total_steps)
        ]

    def optimizer(self, params: list[torch.nn.Parameter]) -> torch.optim.AdamW:
        """AdamW over `params`; its moments take the parameters' dtype (fp32 masters). foreach=False:
        the per-parameter loop whose arithmetic the metagradient replay reproduces bit for bit."""
        if not params:
            raise AssayError("the model has no trainable parameters")
        return torch.optim.AdamW(
            params,
            lr=self.learning_rate,
            betas=self.adam_betas,
            eps=self.adam_eps,
            weight_decay=self.weight_decay,
            foreach=False,
        )


def _is_number(value: object, integer: bool) -> bool:
    """An int (integer=True) or real number, never a bool or a str that merely spells one."""
    kind = numbers.Integral if integer else numbers.Real
    return isinstance(value, kind) and not isinstance(value, bool)


def _check_types(recipe: TrainRecipe) -> None:
    """One line for a setting of the wrong type (`learning_rate="1e-4"`), which would otherwise
    fail in a comparison or train with a silently different value."""
    for f in dataclasses.fields(recipe):
        value = getattr(recipe, f.name)
        if f.type in ("int", "float") and not _is_number(value, f.type == "int"):
            kind = "an integer" if f.type == "int" else "a number"
            raise AssayError(f"--{f.name} must be {kind}, got {value!r} ({type(value).__name__})")
    betas = recipe.adam_betas
    two = isinstance(betas, tuple | list) and len(betas) == 2
    if not two or not all(_is_number(b, False) and 0.0 <= b < 1.0 for b in betas):
        raise AssayError(f"--adam_betas must be two numbers in [0, 1) (beta1, beta2), got {betas!r}")
