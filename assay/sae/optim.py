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

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch


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
