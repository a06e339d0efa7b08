"""Schedule-free sign-SGD ("signum"): Defazio et al.'s schedule-free averaging around sign-SGD.

Three points per parameter (all fp32, same shape as the parameter):
  z  the base iterate: z <- z - lr * s * sign(grad)  (s: the group's "step_scale", default 1)
  x  the running average of the z's (the evaluation point): x <- (1 - c) x + c z,
     c = w_k / sum(w) with w_k = k^r * lr_max^2 at step k (lr_max: the largest rate so far)
  y  the point where gradients are taken: y = beta * x + (1 - beta) * z
During training the parameters hold y; `eval()` puts x into them (for evaluation, saving and
the final SAE) and `train()` puts y back, bit for bit. The same recurrence as
`schedulefree.ScheduleFreeWrapper(SignSGD(params, lr), momentum=beta, r=r)` (sparsify's
"signum": beta = 0.95, r = 0; checked against it to fp32 rounding),
with x kept explicitly instead of being recovered from y and z (so `shift_y_` can move y, e.g.
to renormalise decoder rows, without losing the average).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from assay.sae.model import SparseAutoencoder


class ScheduleFreeSignSGD(torch.optim.Optimizer):
    """Schedule-free sign-SGD; parameters hold y while training (see the module docstring)."""

    def __init__(self, params: Iterable[Any], lr: float, momentum: float = 0.95, r: float = 0.0):
        """params: tensors, or groups (dicts) that may set their own "step_scale"."""
        if lr <= 0 or not 0 < momentum <= 1 or r < 0:
            raise ValueError(f"need lr > 0, 0 < momentum <= 1, r >= 0; got {lr}, {momentum}, {r}")
        super().__init__(params, {"lr": lr, "momentum": momentum, "r": r, "step_scale": 1.0})
        self.train_mode = True

    def _point(self, p: torch.Tensor) -> dict[str, torch.Tensor]:
        """The (z, x) state of p, created at the first step as copies of p (x = y = z)."""
        state = self.state[p]
        if "z" not in state:
            state["z"] = p.detach().clone()
            state["x"] = p.detach().clone()
        return state

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        if closure is not None:
            raise ValueError("ScheduleFreeSignSGD takes no closure")
        if not self.train_mode:
            raise RuntimeError("ScheduleFreeSignSGD.step() in eval mode: call train() first")
        for group in self.param_groups:
            lr, beta = group["lr"], group["momentum"]
            group["lr_max"] = max(lr, group.get("lr_max", 0.0))
            group["k"] = group.get("k", 0) + 1
            weight = group["k"] ** group["r"] * group["lr_max"] ** 2  # r > 0: recent steps weigh more
            group["weight_sum"] = group.get("weight_sum", 0.0) + weight
            c = weight / group["weight_sum"] if group["weight_sum"] > 0 else 0.0  # lr 0 so far
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self._point(p)
                z, x = state["z"], state["x"]
                z.add_(p.grad.sign(), alpha=-lr * group["step_scale"])
                x.lerp_(z, c)
                p.copy_(x).lerp_(z, 1 - beta)  # y

    @torch.no_grad()
    def shift_y_(self, p: torch.Tensor, new_y: torch.Tensor) -> None:
        """Set y (the parameter) to new_y and move x by (new_y - y) / beta, so that y = beta x +
        (1 - beta) z still holds: what renormalising y in place does under ScheduleFreeWrapper,
        which recovers x from y and z."""
        if p not in self.state or "x" not in self.state[p]:
            p.copy_(new_y)
            return
        beta = next(g["momentum"] for g in self.param_groups if any(q is p for q in g["params"]))
        self.state[p]["x"].add_(new_y - p, alpha=1 / beta)
        p.copy_(new_y)

    @torch.no_grad()
    def eval(self) -> None:
        """Parameters to x (the averaged point); y is kept aside for `train()`."""
        if not self.train_mode:
            return
        for p, state in self._stepped():
            state["y"] = p.detach().clone()
            p.copy_(state["x"])
        self.train_mode = False

    @torch.no_grad()
    def train(self) -> None:
        """Parameters back to y, exactly as they were before `eval()`."""
        if self.train_mode:
            return
        for p, state in self._stepped():
            p.copy_(state.pop("y"))
        self.train_mode = True

    def scalars(self) -> list[dict[str, float]]:
        """Per-group step scales and averaging counters (lr_max, weight_sum, k) for checkpoints
        (JSON)."""
        keys = ("step_scale", "lr_max", "weight_sum", "k")
        return [{k: g[k] for k in keys if k in g} for g in self.param_groups]

    def load_scalars(self, saved: list[dict[str, float]]) -> None:
        for group, values in zip(self.param_groups, saved, strict=True):
            group.update({"step_scale": 1.0, **values})  # checkpoints before step scales: 1

    def _stepped(self) -> Iterator[tuple[torch.Tensor, dict[str, torch.Tensor]]]:
        for group in self.param_groups:
            for p in group["params"]:
                if "x" in self.state.get(p, {}):
                    yield p, self.state[p]


@contextmanager
def averaged(opt: torch.optim.Optimizer) -> Iterator[None]:
    """Parameters at the evaluation point inside the block (x for schedule-free; a no-op else)."""
    if not isinstance(opt, ScheduleFreeSignSGD) or not opt.train_mode:
        yield
        return
    opt.eval()
    try:
        yield
    finally:
        opt.train()


# ---- the SAE's optimizers and their defaults ----------------------------------------
UNIT_LR_C = 3.2e-3  # default_learning_rate's constant for unit-norm decoders (docs/BENCHMARKS.md)
SIGNUM_LR_C = 7e-3  # signum's constant (1.4x sparsify's 5e-3; measured, docs/BENCHMARKS.md)
RENORM = "zx"  # signum: which points normalise_decoder puts back on the unit sphere (measured)


def default_learning_rate(d_sae: int, unit_decoder: bool = False, optimizer: str = "adam") -> float:
    """C / sqrt(d_sae / 2^14): Gao et al.'s width scaling (sparsify's Adam: C = 2e-4).

    Small start, C = 8e-4: rows of norm 0.1 must grow; on SmolLM2 activations (576 x 2304, 60
    steps of 1,024 tokens) held-out FVU was 0.59 / 0.31 / 0.14 / 0.11 / 0.14 at C = 2e-4 x 1 /
    2 / 4 / 8 / 16. Unit start, C = UNIT_LR_C: on assay-tiny's block 2 (256 x 4096, 100 steps
    of 4,096 tokens; bench/bench_sae.py --inits unit --lr ...) held-out FVU was 0.055 / 0.039 /
    0.031 / 0.027 with 2% / 2% / 15% / 56% of latents dead at C = 8e-4 x 1 / 2 / 4 / 8: x 4 is
    the best FVU short of losing half the latents (docs/BENCHMARKS.md).
    """
    if optimizer == "signum":
        return SIGNUM_LR_C / math.sqrt(d_sae / 2**14)
    return (UNIT_LR_C if unit_decoder else 8e-4) / math.sqrt(d_sae / 2**14)


def make_optimizer(
    sae: SparseAutoencoder,
    lr: float,
    kind: str = "adam",
    momentum: float = 0.98,
    average_power: float = 1.0,
    encoder_step: float | None = None,
) -> torch.optim.Optimizer:
    """Adam or schedule-free sign-SGD ("signum") on the fp32 parameters (state fp32 too);
    JumpReLU's thresholds step at their own rate (`threshold_groups`).

    Signum moves every weight by lr per step whatever its size, and the fitted unit start makes
    the encoder c times smaller than the decoder (c ~ 0.5): W_enc gets its own group whose
    steps are scaled by its size relative to W_dec's now, times `encoder_step` (default: the
    architecture's `signum_encoder_step`). Build it after the start is set; a checkpoint
    restores the scale it was trained with.
    """
    encoder: list[dict[str, Any]] = []
    if kind == "signum":
        encoder = [{"params": [sae.W_enc], "step_scale": encoder_step_scale(sae, encoder_step)}]
    thresholds = threshold_groups(sae)
    own = {id(p) for group in encoder + thresholds for p in group["params"]}
    rest: dict[str, Any] = {"params": [p for p in sae.parameters() if id(p) not in own]}
    groups = [*encoder, rest, *thresholds]
    if kind == "signum":
        return ScheduleFreeSignSGD(groups, lr=lr, momentum=momentum, r=average_power)
    return torch.optim.Adam(groups, lr=lr, betas=(0.9, 0.999))


def threshold_groups(sae: SparseAutoencoder) -> list[dict[str, Any]]:
    """JumpReLU's learned thresholds in a group of their own, whose learning rate is the
    schedule's times "lr_scale" (--jumprelu_threshold_lr; the training step applies it)."""
    if not sae.rule.learned_threshold:
        return []
    return [{"params": [sae.jumprelu_threshold], "lr_scale": sae.arch.jumprelu_threshold_lr}]


@torch.no_grad()
def encoder_step_scale(sae: SparseAutoencoder, factor: float | None = None) -> float:
    """factor * |W_enc| / |W_dec| (Frobenius norms; the ratio 1 where either is 0); factor
    defaults to the architecture's `signum_encoder_step`."""
    enc, dec = float(sae.W_enc.float().norm()), float(sae.W_dec.float().norm())
    ratio = enc / dec if enc > 0 and dec > 0 and math.isfinite(enc / dec) else 1.0
    return (sae.rule.signum_encoder_step if factor is None else factor) * ratio


@torch.no_grad()
def normalise_decoder(sae: SparseAutoencoder, opt: torch.optim.Optimizer, where: str | None = None) -> None:
    """Unit decoder: rows back to norm 1 after a step (fp32).

    Signum (`where`, default RENORM): "zx" puts the rows of z and of the average x on the sphere
    and recomputes y = beta x + (1 - beta) z (the saved x keeps unit rows); "z" does z only;
    "y" renormalises y itself and shifts x with it (what renormalising the parameters in place
    under sparsify's ScheduleFreeWrapper amounts to). Compared in docs/BENCHMARKS.md.
    """
    w = sae.W_dec
    if not sae.arch.unit_decoder:
        return
    if not isinstance(opt, ScheduleFreeSignSGD) or "z" not in opt.state.get(w, {}):
        sae.normalise_decoder_()
        return
    where = where or RENORM
    state = opt.state[w]
    if where == "y":
        opt.shift_y_(w, w / w.norm(dim=1, keepdim=True).clamp_min(1e-12))
        return
    for key in ("z", "x") if where == "zx" else ("z",):
        state[key].div_(state[key].norm(dim=1, keepdim=True).clamp_min(1e-12))
    beta = opt.param_groups[0]["momentum"]
    w.copy_(state["x"]).lerp_(state["z"], 1 - beta)
