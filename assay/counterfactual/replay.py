"""A functional replay of an AdamW fine-tuning run, with a weight on every training example.

`Replay` re-runs a finished run's optimizer steps on a model: the same effective batches cut into
the same micro-batches, the same step loss, the same global-norm clipping and the same AdamW
arithmetic as `torch.optim.AdamW(foreach=False)` after `torch.nn.utils.clip_grad_norm_`. With
every weight 1 and fp32 it reproduces the original run bit for bit (tests/counterfactual checks
it against assay's own `train_step` + `optimizer_update`). The step loss with weights w is

    L_t(θ, w) = Σ_{i in step t} w_i ℓ_i(θ) / (loss tokens of step t),

ℓ_i the summed token loss of example i, so d L_t / d w_i = ℓ_i / tokens. The reverse pass
(`assay.counterfactual.metagradient`) differentiates the final parameters with respect to w.

Memory: the forward replay keeps the state (θ, m, v) and the step's gradient every
`checkpoint_every` steps, in memory or in files (`offload`); the reverse pass recomputes one
segment at a time from its checkpoint (`segment`), keeping that segment's states and gradients.
See `metagradient.py` for the time/memory trade-off.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from assay.core.errors import AssayError
from assay.core.precision import PrecisionPolicy, full_precision

LossFn = Callable[[nn.Module, np.ndarray], torch.Tensor]
"""(model, positions [B]) -> [B] summed token loss of each of those training examples."""

RECORD_KEYS = ("params", "exp_avg", "exp_avg_sq", "grads")
"""Tensor name prefixes of an offloaded checkpoint file."""

CLIP_EPS = 1e-6
"""What `torch.nn.utils.clip_grad_norm_` adds to the norm before dividing (clip = M / (n + 1e-6))."""


def balanced_interval(num_steps: int) -> int:
    """⌈√T⌉ steps per segment: the checkpoint interval that keeps the fewest states.

    The forward replay keeps T/k checkpoints and the reverse pass one segment of k states, so
    memory grows as T/k + k, least at k = √T (about 2√T states instead of T at k = 1), for one
    extra forward replay of time: each segment is recomputed once on the way back."""
    return max(1, math.ceil(math.sqrt(num_steps)))


@dataclass(frozen=True)
class AdamWSettings:
    """AdamW's hyperparameters for every step, as `assay finetune` sets them."""

    lrs: tuple[float, ...]
    """Learning rate of each optimizer step (the schedule already applied)."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Adam's beta1 and beta2."""
    eps: float = 1e-8
    """Adam's epsilon, added to the bias-corrected sqrt(v)."""
    weight_decay: float = 0.0
    """Decoupled weight decay (θ ← θ (1 − lr·wd) before the Adam update)."""
    max_grad_norm: float = 0.0
    """Clip the global gradient norm to this before the update (0: no clipping)."""


@dataclass
class TrainingRun:
    """What a replay needs to know about a run: its batches, its loss and its optimizer."""

    steps: list[np.ndarray]
    """Positions (0..N-1) of each optimizer step's examples, in micro-batch order. To match
    `assay finetune`, sort each step as its `train_step` does (`finetune_order`)."""
    loss_tokens: np.ndarray
    """[N] loss-carrying tokens of each training example (a step's loss is divided by their sum)."""
    loss_fn: LossFn
    """Per-example summed token losses; runs under the policy's autocast."""
    optimizer: AdamWSettings
    """AdamW hyperparameters and the per-step learning rates."""
    micro_batch_size: int
    """Examples per forward/backward when accumulating a step's gradient (as in the run)."""
    policy: PrecisionPolicy | None = None
    """The run's precision (fp32 or bf16 autocast); None: no autocast."""
    curvature_loss_fn: LossFn | None = None
    """A twice-differentiable version of loss_fn for Hessian-vector products (None: loss_fn).
    Needed when loss_fn uses a custom autograd Function without a second derivative, such as
    assay's chunked output-head loss."""
    curvature_micro_batch_size: int = 0
    """Examples per Hessian-vector product (0: micro_batch_size). Smaller bounds the memory of
    the double backward, which holds about twice a training step's activations."""

    def __post_init__(self) -> None:
        self.loss_tokens = np.asarray(self.loss_tokens, dtype=np.int64).reshape(-1)
        self.steps = [np.asarray(s, dtype=np.int64).reshape(-1) for s in self.steps]
        n = len(self.loss_tokens)
        if not self.steps or any(len(s) == 0 for s in self.steps):
            raise AssayError("a replayed run needs at least one step and no empty steps")
        if any(int(s.min()) < 0 or int(s.max()) >= n for s in self.steps):
            raise AssayError(f"a step lists an example position outside 0..{n - 1}")
        if len(self.optimizer.lrs) != len(self.steps):
            raise AssayError(
                f"{len(self.optimizer.lrs)} learning rates for {len(self.steps)} steps; give one per step"
            )
        if self.micro_batch_size < 1 or self.curvature_micro_batch_size < 0:
            raise AssayError("micro_batch_size must be >= 1 (curvature_micro_batch_size >= 0)")
        if self.policy is not None and self.policy.name in ("fp16", "bf16-pure"):
            raise AssayError(
                f"replaying a {self.policy.name} run is not supported (fp16's dynamic loss scaling skips "
                "steps; bf16-pure keeps bf16 moments); replay fp32 or bf16 runs"
            )

    @property
    def num_examples(self) -> int:
        """N, the number of training examples (columns of the scores)."""
        return len(self.loss_tokens)

    def step_tokens(self, step: int) -> int:
        """Loss tokens of a step's effective batch (at least 1, as `train_step` divides)."""
        return max(int(self.loss_tokens[self.steps[step]].sum()), 1)


@dataclass
class AdamState:
    """θ and AdamW's moments before optimizer step `step` (0-based), one tensor per parameter."""

    step: int
    """Optimizer steps taken so far."""
    params: list[torch.Tensor]
    """θ, in the order of `trainable_parameters`."""
    exp_avg: list[torch.Tensor]
    """Adam's first moment m (zeros before the first step, as torch initialises it)."""
    exp_avg_sq: list[torch.Tensor]
    """Adam's second moment v, not bias-corrected."""

    def clone(self) -> AdamState:
        """A copy that later in-place updates do not touch."""
        return AdamState(
            self.step,
            [t.detach().clone() for t in self.params],
            [t.clone() for t in self.exp_avg],
            [t.clone() for t in self.exp_avg_sq],
        )


@dataclass
class StepRecord:
    """One step as the reverse pass needs it: the state before it and its gradient there."""

    state: AdamState
    """θ_t, m_t, v_t before the step."""
    grads: list[torch.Tensor]
    """The step loss's gradient before clipping, g_raw = ∇θ L_t(θ_t, w)."""
    norm: float
    """Global L2 norm of g_raw (as clip_grad_norm_ computes it)."""
    clip: torch.Tensor
    """0-d clip factor applied to g_raw: min(max_grad_norm / (norm + 1e-6), 1); 1 without clipping."""

    @property
    def coef(self) -> float:
        """The clip factor as a number."""
        return float(self.clip)


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters that require grad, in `named_parameters` order (the optimizer's order)."""
    params = [p for _, p in model.named_parameters() if p.requires_grad]
    if not params:
        raise AssayError("the model has no trainable parameters (set requires_grad on those the run trained)")
    return params


def micro_batches(positions: np.ndarray, size: int) -> Iterator[np.ndarray]:
    """Consecutive slices of `size` positions, as `train_step` cuts an effective batch."""
    for start in range(0, len(positions), size):
        yield positions[start : start + size]


def finetune_order(lengths: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """A step's positions in the order `assay finetune`'s train_step visits them (longest first)."""
    positions = np.asarray(positions, dtype=np.int64)
    return positions[np.argsort(-np.asarray(lengths)[positions], kind="stable")]


def weighted_step_loss(
    run: TrainingRun, model: nn.Module, chunk: np.ndarray, weights: torch.Tensor, tokens: int, fn: LossFn
) -> torch.Tensor:
    """Σ_i w_i ℓ_i / tokens over one micro-batch; the forward under autocast, the sum in full precision."""
    autocast = run.policy.autocast() if run.policy is not None else torch.autocast("cpu", enabled=False)
    with autocast:
        losses = fn(model, chunk)  # [b]
    with full_precision(losses.device):
        return (losses * weights.to(losses.dtype)).sum() / tokens


def step_gradient(
    run: TrainingRun, model: nn.Module, params: list[nn.Parameter], step: int, weights: torch.Tensor
) -> list[torch.Tensor]:
    """g_raw = ∇θ L_t(θ, w), accumulated over micro-batches in order (as `.grad` accumulates)."""
    positions, tokens = run.steps[step], run.step_tokens(step)
    total: list[torch.Tensor] | None = None
    for chunk in micro_batches(positions, run.micro_batch_size):
        loss = weighted_step_loss(run, model, chunk, weights[chunk], tokens, run.loss_fn)
        grads = torch.autograd.grad(loss, params, materialize_grads=True)
        total = list(grads) if total is None else [t + g for t, g in zip(total, grads)]
    assert total is not None
    return total


def clip_factor(grads: Sequence[torch.Tensor], max_norm: float) -> tuple[float, torch.Tensor]:
    """(global norm, clip factor tensor) exactly as `clip_grad_norm_(..., foreach=False)` computes them."""
    norm = torch.nn.utils.get_total_norm(grads, 2.0, foreach=False)
    limit = max_norm if max_norm > 0 else float("inf")
    coef = torch.clamp(limit / (norm + CLIP_EPS), max=1.0)  # the same expression, for the same bits
    return float(norm), coef


@torch.no_grad()
def adamw_update(state: AdamState, grads: Sequence[torch.Tensor], lr: float, opt: AdamWSettings) -> None:
    """One AdamW step in place, op for op as torch's `_single_tensor_adam` (decoupled decay)."""
    beta1, beta2 = opt.betas
    state.step += 1
    step = float(state.step)
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    step_size = lr / bias_correction1
    bias_correction2_sqrt = bias_correction2**0.5
    for param, grad, exp_avg, exp_avg_sq in zip(state.params, grads, state.exp_avg, state.exp_avg_sq):
        if opt.weight_decay != 0:
            param.mul_(1 - lr * opt.weight_decay)
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(opt.eps)
        param.addcdiv_(exp_avg, denom, value=-step_size)


@dataclass
class Replay:
    """Replays a run on `model` (whose trainable parameters must hold θ_0 when it is made)."""

    model: nn.Module
    """The model; its parameters are overwritten with the replayed states."""
    run: TrainingRun
    """The run to replay."""
    checkpoint_every: int = 0
    """Keep the state every k steps (0: one checkpoint, at the start; 1: every step)."""
    offload: Path | None = None
    """A folder to keep the checkpoints in (safetensors, 4 parameter copies each) instead of memory:
    the reverse pass then holds only one segment's states. None: in memory."""
    params: list[nn.Parameter] = field(init=False)
    """The trainable parameters (those that require grad), in the optimizer's order."""
    checkpoints: dict[int, StepRecord | Path] = field(init=False, default_factory=dict)
    """State before step t and the gradient there, for t = 0, k, 2k, ... (filled by `forward`);
    a file when offloaded."""
    final: list[torch.Tensor] = field(init=False, default_factory=list)
    """θ_T of the last forward replay."""
    grad_norms: list[float] = field(init=False, default_factory=list)
    """Global gradient norm of each step of the last forward replay (before clipping)."""

    def __post_init__(self) -> None:
        self.params = trainable_parameters(self.model)
        if self.checkpoint_every < 0:
            raise AssayError("checkpoint_every must be >= 0 (0: only the start)")
        for name, module in self.model.named_modules():
            if isinstance(module, nn.Dropout) and module.p > 0 and module.training:
                raise AssayError(f"{name or 'the model'} has active dropout; a replay must be deterministic")
        self.start = [p.detach().clone() for p in self.params]  # θ_0
        self.weights = self.unit_weights()

    @property
    def interval(self) -> int:
        """Steps per segment (k)."""
        return self.checkpoint_every or len(self.run.steps)

    def unit_weights(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """[N] ones: every example at its weight in the original run."""
        dtype = dtype or torch.promote_types(self.params[0].dtype, torch.float32)
        return torch.ones(self.run.num_examples, dtype=dtype, device=self.params[0].device)

    def load(self, values: Sequence[torch.Tensor]) -> None:
        """Copy θ into the model's trainable parameters."""
        with torch.no_grad():
            for p, v in zip(self.params, values):
                p.copy_(v)

    def forward(self, weights: torch.Tensor | None = None) -> list[torch.Tensor]:
        """Train from θ_0 with example weights (default all 1); returns θ_T, which the model then holds.

        Keeps the state and the gradient every `interval` steps for `segment` (and the reverse pass).
        """
        self.weights = self.unit_weights() if weights is None else weights.detach()
        zeros = [torch.zeros_like(p) for p in self.start]  # Adam's moments before the first step
        state = AdamState(0, [p.clone() for p in self.start], zeros, [z.clone() for z in zeros])
        self.checkpoints, self.grad_norms = {}, []
        for t in range(len(self.run.steps)):
            record = self.gradient_at(state, t)
            self.grad_norms.append(record.norm)
            if t % self.interval == 0:
                self.keep_checkpoint(t, replace(record, state=state.clone()))
            self.advance(state, record, t)
        self.final = [p.detach().clone() for p in state.params]
        self.load(self.final)
        return self.final

    def keep_checkpoint(self, t: int, record: StepRecord) -> None:
        """Keep step t's record, in memory or in the offload folder."""
        if self.offload is None:
            self.checkpoints[t] = record
            return
        self.offload.mkdir(parents=True, exist_ok=True)
        path = self.offload / f"step-{t:07d}.safetensors"
        tensors = {"clip": record.clip.detach().cpu().contiguous()}
        parts = (record.state.params, record.state.exp_avg, record.state.exp_avg_sq, record.grads)
        for key, values in zip(RECORD_KEYS, parts):
            tensors |= {f"{key}.{i}": v.detach().cpu().contiguous() for i, v in enumerate(values)}
        save_file(tensors, str(path), metadata={"step": str(record.state.step), "norm": repr(record.norm)})
        self.checkpoints[t] = path

    def checkpoint(self, t: int) -> StepRecord:
        """The record kept at step t (read back when offloaded)."""
        kept = self.checkpoints[t]
        if isinstance(kept, StepRecord):
            return kept
        device, n = self.params[0].device, len(self.params)
        with safe_open(str(kept), "pt") as f:
            meta = f.metadata()
            tensors = {k: f.get_tensor(k).to(device) for k in f.keys()}
        params, exp_avg, exp_avg_sq, grads = ([tensors[f"{k}.{i}"] for i in range(n)] for k in RECORD_KEYS)
        state = AdamState(int(meta["step"]), params, exp_avg, exp_avg_sq)
        return StepRecord(state, grads, float(meta["norm"]), tensors["clip"])

    def gradient_at(self, state: AdamState, t: int) -> StepRecord:
        """Step t's gradient and clip factor at `state` (the record holds `state` itself, not a copy)."""
        self.load(state.params)
        grads = step_gradient(self.run, self.model, self.params, t, self.weights)
        norm, clip = clip_factor(grads, self.run.optimizer.max_grad_norm)
        return StepRecord(state, grads, norm, clip)

    def advance(self, state: AdamState, record: StepRecord, t: int) -> None:
        """Apply step t (clip, AdamW) to `state` in place with the record's gradient."""
        clipped = [g * record.clip.to(g.device) for g in record.grads]  # as clip_grad_norm_, even by 1.0
        adamw_update(state, clipped, self.run.optimizer.lrs[t], self.run.optimizer)

    def segment(self, start: int) -> list[StepRecord]:
        """The records of the segment that starts at checkpoint `start`, the steps after it recomputed.

        k − 1 gradient evaluations for a segment of k steps (none with k = 1). The model holds θ_T
        again on return."""
        if start not in self.checkpoints:
            raise AssayError("no checkpoint at that step: run Replay.forward first")
        records = [self.checkpoint(start)]
        state = records[0].state.clone()
        for t in range(start + 1, min(start + self.interval, len(self.run.steps))):
            self.advance(state, records[-1], t - 1)
            record = self.gradient_at(state, t)
            records.append(replace(record, state=state.clone()))
        self.load(self.final)
        return records
