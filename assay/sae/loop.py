"""The SAE training loop: one step (`train_step`), and `fit`, which trains one SAE or several
from the same batches (several hookpoints, widths or k from one pass of the language model).

Precision (one policy, applied here): with bf16 the forward of the train step (encode,
decode, losses) runs under autocast; backward, gradient clipping and the optimizer step run
outside it; parameters and optimizer state (Adam's moments, signum's z and x) are fp32; the
BatchTopK threshold EMA, decoder renormalisation, dead-latent counters and metrics are updated
with autocast off, in fp32. With signum the parameters hold the gradient point y while
training; evaluations and the saved SAE use the average x. A BatchTopK kind's threshold is
set for each evaluation, and for the trained SAE, from a batch at the evaluated weights
(`calibrate_threshold`).

A transcoder trains the same way on rows [input | target]: the input is encoded, the target
reconstructed, each normalised by its own scale.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from assay.core.console import note
from assay.core.distributed import Distributed
from assay.core.memory import reuse_freed_memory
from assay.core.precision import PrecisionPolicy, full_precision
from assay.core.progress import Progress
from assay.sae.activations import ShuffledBatches
from assay.sae.architectures import architecture_class
from assay.sae.checkpoint import CHECKPOINT, TrainState, load_checkpoint, save_checkpoint
from assay.sae.config import SaeTrainConfig
from assay.sae.metrics import DeadLatents, fvu
from assay.sae.model import SparseAutoencoder, TrainOutput
from assay.sae.optim import (
    ScheduleFreeSignSGD,
    averaged,
    default_learning_rate,
    make_optimizer,
    normalise_decoder,
)
from assay.training.checkpoint import find_checkpoint
from assay.training.metrics import MetricsLog
from assay.training.schedule import warmup_stable_decay


def lr_at(step: int, total: int, base: float, warmup: int, decay_fraction: float) -> float:
    """Linear warm-up over `warmup` steps, constant, linear decay to 0 over the last fraction."""
    return base * warmup_stable_decay(step, total, warmup, decay_fraction)


def sparsity_coef_at(step: int, total: int, cfg: SaeTrainConfig) -> float:
    """The architecture's sparsity coefficient (L1 for relu, L0 for jumprelu, else 0), ramped
    up linearly from 0 over the first --l1_warmup_fraction of the steps."""
    base = architecture_class(cfg.sae.architecture)(cfg.sae).sparsity_coefficient()
    warm = int(total * cfg.l1_warmup_fraction)
    return base * min(1.0, (step + 1) / warm) if warm > 0 else base


def train_step(
    sae: SparseAutoencoder,
    opt: torch.optim.Optimizer,
    x: torch.Tensor,
    dead: DeadLatents,
    policy: PrecisionPolicy,
    lr: float,
    sparsity_coef: float,
    grad_clip: float,
    first: bool,
    target: torch.Tensor | None = None,
) -> TrainOutput:
    """One SAE update on a batch x [N, d_in] of normalised activations (a transcoder: against
    target [N, d_out])."""
    for group in opt.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)  # JumpReLU's thresholds: their own multiple
    aux = dead.aux_mask()  # on the host: asking whether any latent is dead costs no device sync
    mask = aux.to(x.device) if bool(aux.any()) else None
    with policy.autocast():  # encode, decode, losses
        out = sae.train_forward(x, mask, sparsity_coef, target)
    out.loss.backward()  # outside autocast: gradients land in the fp32 parameters
    # Data-parallel: every rank holds an equal share of the global batch and the loss is a
    # per-token mean, so the mean of the ranks' gradients is the global batch's gradient.
    dist = Distributed.current()
    if dist.active and sae.rule.normalised_loss:
        # the loss divides by the batch's variance: rescale each rank's share to the global one
        ratio = _variance_ratio(dist, x if target is None else target)
        for p in sae.parameters():
            if p.grad is not None:
                p.grad.mul_(ratio)
    dist.all_reduce_grads_(sae.parameters(), op="mean")
    sae.project_decoder_grad_()  # unit decoder: before clipping, so the norm clipped is the one applied
    if grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(sae.parameters(), grad_clip)
    opt.step()
    opt.zero_grad(set_to_none=True)
    with full_precision(x.device):
        normalise_decoder(sae, opt)
        dist.all_reduce_(out.counts)  # global firing counts: every rank keeps the same dead mask
        sae.update_threshold(_global_min(dist, out.min_kept), first)
        dead.update(out.counts, len(x) * dist.world_size)
    return out


def _variance_ratio(dist: Distributed, x: torch.Tensor) -> float:
    """This rank's batch variance over the global batch's (fp64; equal-sized shares)."""
    x64 = x.detach().double()
    local = float((x64 - x64.mean(0)).pow(2).sum(-1).mean())
    n, squares = dist.sum_scalars(len(x), float(x64.pow(2).sum()))
    total = dist.all_reduce_(x64.sum(0))  # [d_in] fp64 sum of the global batch
    glob = squares / n - float(total.pow(2).sum()) / n**2
    return max(local, 1e-12) / max(glob, 1e-12)


def _global_min(dist: Distributed, value: torch.Tensor | None) -> torch.Tensor | None:
    """The smallest of the ranks' BatchTopK kept activations (None where no rank kept any)."""
    if not dist.active:
        return value
    t = torch.tensor(math.inf if value is None else float(value), dtype=torch.float32)
    dist.all_reduce_(t, "min")
    return None if math.isinf(float(t)) else t


def calibrate_threshold(sae: SparseAutoencoder, x: torch.Tensor, every_rank: bool = True) -> None:
    """BatchTopK kinds: the inference threshold set to the smallest activation the training rule
    keeps on batch x (normalised) at the SAE's current weights, in place of the lagging EMA; so
    the saved JumpReLU fires as the evaluated SAE selects. Other architectures: nothing.
    every_rank: every rank calls it and the ranks' minimum is taken (one collective), as the
    EMA takes it; else this rank's batch alone."""
    if not sae.rule.tracks_min_kept:
        return
    with full_precision(x.device):
        value = sae.rule.kept_minimum(sae, x)
        value = _global_min(Distributed.current(), value) if every_rank else value
    if value is not None:
        sae.threshold_buf.fill_(float(value))


@contextmanager
def threshold_from(sae: SparseAutoencoder, x: torch.Tensor) -> Iterator[None]:
    """`calibrate_threshold` inside the block (a mid-run evaluation); the EMA back after it.
    On this rank's batch alone: evaluations run on the main rank only."""
    ema = sae.threshold_buf.clone()
    calibrate_threshold(sae, x, every_rank=False)
    try:
        yield
    finally:
        sae.threshold_buf.copy_(ema)


def step_record(out: TrainOutput, x: torch.Tensor, state: TrainState, dead: DeadLatents, extra: dict) -> dict:
    """One metrics.jsonl line (fp32/fp64, autocast off); x is the batch's target."""
    with full_precision(x.device):
        f = fvu(x, out.x_hat)
        return {
            "step": state.step,
            "tokens": state.tokens,
            "loss": float(out.loss.detach()),
            "mse": float(out.mse.detach()),
            "fvu": f,
            "explained_variance": 1.0 - f,
            "l0": float(out.l0),
            "dead_fraction": dead.fraction(),
            "aux_loss": float(out.aux.detach()),
            "sparsity_loss": float(out.sparsity.detach()),
            **extra,
        }


# ---- the loop ------------------------------------------------------------------------
def split_rows(sae: SparseAutoencoder, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Raw rows -> (input [N, d_in], target [N, d_out] or None for an SAE), both normalised."""
    if not sae.transcoder:
        return (rows * sae.act_scale).contiguous(), None
    x, y = rows[:, : sae.d_in], rows[:, sae.d_in :]
    return (x * sae.act_scale).contiguous(), (y * sae.target_scale).contiguous()


def _mean_norm_scale(sample: torch.Tensor) -> float:
    """The factor that makes the mean row norm sqrt(width)."""
    return math.sqrt(sample.shape[1]) / float(sample.norm(dim=-1).mean().clamp_min(1e-12))


def init_from_data(sae: SparseAutoencoder, sample: torch.Tensor, fit_rows: int = 4096) -> None:
    """Scale so the mean activation norm is sqrt(d_in) (a transcoder's targets: sqrt(d_out));
    b_dec at the (scaled) mean of what is reconstructed; with a unit decoder, the encoder's
    scale fitted on the first `fit_rows` rows (bounds the [N, d_sae] scratch)."""
    with torch.no_grad():
        x = sample[:, : sae.d_in]
        scale = _mean_norm_scale(x)
        sae.act_scale.fill_(scale)
        if not sae.transcoder:
            sae.b_dec.copy_(sample.mean(0) * scale)
            sae.fit_encoder_scale(sample[:fit_rows].to(sae.b_dec.device) * scale)
            return
        y = sample[:, sae.d_in :]
        sae.target_scale.fill_(_mean_norm_scale(y))
        sae.b_dec.copy_(y.mean(0) * sae.target_scale)
        fit_x, fit_y = split_rows(sae, sample[:fit_rows].to(sae.b_dec.device))
        sae.fit_encoder_scale(fit_x, fit_y)


@dataclass
class Trainee:
    """One SAE being trained, with everything its run keeps: a run trains one, or several from
    the same batches (each reads its own columns of the rows)."""

    sae: SparseAutoencoder
    """The SAE (parameters fp32)."""
    cfg: SaeTrainConfig
    """Its config (hookpoint, architecture, schedule)."""
    run_dir: Path
    """Where its metrics.jsonl and checkpoint go."""
    cols: slice = field(default_factory=lambda: slice(None))
    """Its columns of the source's rows (one hookpoint's, or a transcoder's input and target)."""
    evaluate: Callable[[SparseAutoencoder], dict[str, float]] | None = None
    """Splice metrics on held-out text (None: none)."""
    wandb_run: Any = None
    """A W&B run mirroring metrics.jsonl (None: local only)."""
    opt: Any = None
    dead: Any = None
    log: Any = None
    state: TrainState = field(default_factory=TrainState)
    base_lr: float = 0.0
    last: dict[str, Any] | None = None
    final_batch: torch.Tensor | None = None
    """The last batch (normalised input), kept to calibrate a BatchTopK threshold at the end."""
    density: torch.Tensor | None = None
    density_tokens: int = 0

    def start(self, first_fill: torch.Tensor | None) -> None:
        """Initialise from the first buffer fill [rows, width] (None only when resuming), or
        resume from the run's checkpoint."""
        cfg, sae = self.cfg, self.sae
        kind = cfg.optimizer_name
        self.base_lr = cfg.learning_rate or default_learning_rate(sae.d_sae, sae.arch.unit_decoder, kind)
        resuming = find_checkpoint(self.run_dir / CHECKPOINT) is not None
        if not resuming:
            assert first_fill is not None
            init_from_data(sae, first_fill[:, self.cols])
        Distributed.current().broadcast_module_(sae)  # rank 0's initialisation everywhere (as DDP does)
        self.opt = make_optimizer(
            sae, self.base_lr, kind, cfg.signum_momentum, cfg.signum_average_power, cfg.signum_encoder_step
        )
        self.dead = DeadLatents(sae.d_sae, cfg.dead_window_tokens, cfg.aux_window)
        self.log = MetricsLog(self.run_dir / "metrics.jsonl", self.wandb_run)
        if resuming:  # every rank reads the same files
            self.state = load_checkpoint(self.run_dir, sae, self.opt, self.dead)
            note(f"resuming from step {self.state.step:,} ({self.state.tokens:,} tokens)")
        self.log.truncate_after(self.state.step if resuming else -1)  # killed before a checkpoint
        self.density = torch.zeros(sae.d_sae, dtype=torch.float64)

    def step(self, x_raw: torch.Tensor, policy: PrecisionPolicy, rate: Callable[[int], float]) -> int:
        """One update on a batch of raw rows; returns the tokens it counted."""
        cfg, sae, state, dist = self.cfg, self.sae, self.state, Distributed.current()
        total = cfg.total_steps
        x, target = split_rows(sae, x_raw[:, self.cols].to(policy.device))
        lr = lr_at(state.step, total, self.base_lr, cfg.warmup_steps, cfg.decay_fraction)
        coef = sparsity_coef_at(state.step, total, cfg)
        out = train_step(
            sae, self.opt, x, self.dead, policy, lr, coef, cfg.grad_clip, state.step == 0, target
        )
        state.step, state.tokens = state.step + 1, state.tokens + len(x) * dist.world_size
        if state.step == total and sae.rule.tracks_min_kept:
            self.final_batch = x
        if state.step > total - max(1, total // 10):  # densities over the last 10% of steps
            assert self.density is not None
            self.density += out.counts.double().cpu()  # global counts (reduced in train_step)
            self.density_tokens += len(x) * dist.world_size
        if state.step % cfg.metrics_every == 0 or state.step == total:
            extra = {"lr": lr, "sparsity_coefficient": coef, "tokens_per_s": rate(state.tokens)}
            self.last = step_record(out, x if target is None else target, state, self.dead, extra)
            self.log.log(self.last)
        if (
            self.evaluate is not None
            and cfg.eval_every > 0
            and state.step % cfg.eval_every == 0
            and state.step < total
        ):
            with averaged(self.opt), threshold_from(sae, x):  # signum: at the averaged point
                self.log.log({"step": state.step, "tokens": state.tokens, **_prefixed(self.evaluate(sae))})
        if cfg.checkpoint_every > 0 and state.step % cfg.checkpoint_every == 0 and state.step < total:
            dist.barrier()  # no rank runs ahead of a checkpoint it could be resumed from
            if dist.is_main:
                save_checkpoint(self.run_dir, sae, self.opt, self.dead, state)
        return len(x)

    def finish(self, rate: float) -> dict[str, Any]:
        """The trained SAE's final evaluation and log densities (signum: at the averaged point;
        BatchTopK kinds: with the threshold calibrated on the last batch there)."""
        if isinstance(self.opt, ScheduleFreeSignSGD):
            self.opt.eval()  # the trained SAE is the averaged point x: evaluated and saved from here on
        if self.final_batch is not None:
            calibrate_threshold(self.sae, self.final_batch)
        final = _prefixed(self.evaluate(self.sae)) if self.evaluate is not None else {}
        if final:
            self.log.log({"step": self.state.step, "tokens": self.state.tokens, **final})
        assert self.density is not None
        log_density = torch.log10(self.density / max(self.density_tokens, 1) + 1e-10).float()
        return {"train": self.last or {}, "eval": final, "log_densities": log_density, "tokens_per_s": rate}


def fit_all(
    trainees: list[Trainee], batches: ShuffledBatches, policy: PrecisionPolicy
) -> list[dict[str, Any]]:
    """Train every trainee to its cfg.total_steps on the same batches (resuming each from its
    checkpoint); returns each one's result (`Trainee.finish`)."""
    reuse_freed_memory()  # every step allocates the same [tokens, latents] temporaries: keep them
    fresh = any(find_checkpoint(t.run_dir / CHECKPOINT) is None for t in trainees)
    first_fill = batches.fill(0) if fresh else None  # the LM's first pass, only when some SAE starts
    for t in trainees:
        t.start(first_fill)
    dist, cfg = Distributed.current(), trainees[0].cfg
    total, start = cfg.total_steps, min(t.state.step for t in trainees)
    tokens_at_start, started = trainees[0].state.tokens, time.perf_counter()

    def rate(tokens: int) -> float:
        return (tokens - tokens_at_start) / max(time.perf_counter() - started, 1e-9)

    label = f"sae {cfg.sae.architecture}" + (f" x{len(trainees)}" if len(trainees) > 1 else "")
    with Progress(total, label, enabled=dist.is_main, initial=start, unit="step") as bar:
        for step, x_raw in enumerate(batches.iterate(start), start=start):
            if step >= total:
                break
            n = 0
            for t in trainees:
                if t.state.step == step:  # a trainee resumed further along skips the batches it saw
                    n = t.step(x_raw, policy, rate)
            last = trainees[0].last
            bar.update(1, n, fvu=f"{last['fvu']:.3f}" if last else "-")
    final_rate = rate(trainees[0].state.tokens)
    return [t.finish(final_rate) for t in trainees]


def fit(
    sae: SparseAutoencoder,
    batches: ShuffledBatches,
    cfg: SaeTrainConfig,
    policy: PrecisionPolicy,
    run_dir: Path,
    evaluate: Any = None,
    wandb_run: Any = None,
) -> dict[str, Any]:
    """Train one SAE to cfg.total_steps (resuming from run_dir/checkpoint when present)."""
    return fit_all([Trainee(sae, cfg, run_dir, evaluate=evaluate, wandb_run=wandb_run)], batches, policy)[0]


def _prefixed(metrics: dict[str, float]) -> dict[str, float]:
    return {f"eval/{k}": v for k, v in metrics.items()}
