"""Exact attribution through a training run: metagradients of a query with respect to example weights.

Every training example i carries a weight w_i in its steps' losses (all 1 = the original run;
see `replay.py`). For a query objective f(θ_T) of the final parameters (a query's summed loss,
or any scalar) this module computes df/dw_i for every i by reverse-mode differentiation through
every optimizer step of the run (MAGIC, Ilyas & Engstrom 2025), and scores in `assay score`'s
convention: score = −df/dw_i, positive = a proponent (up-weighting i lowers the query's loss).

One AdamW step t (s = t + 1, α = lr_t / (1 − β1^s), b = sqrt(1 − β2^s)) maps (θ, m, v) to

    g_raw = ∇θ L_t(θ, w)        n = ‖g_raw‖        c = min(M / (n + 1e-6), 1)        g = c g_raw
    m' = β1 m + (1 − β1) g      v' = β2 v + (1 − β2) g²      D = sqrt(v') / b + eps
    θ' = θ (1 − lr_t λ) − α m' / D

and its adjoint, given θ̄, m̄, v̄ (the adjoints of θ', m', v'), is

    m̃ = m̄ − α θ̄ / D          ṽ = v̄ + α θ̄ m' / (2 b sqrt(v') D²)   (0 where v' = 0)
    ḡ = (1 − β1) m̃ + 2 (1 − β2) g ṽ
    u = c ḡ − [clipped] c ⟨ḡ, g_raw⟩ g_raw / (n (n + 1e-6))          (u = adjoint of g_raw)
    θ̄ ← (1 − lr_t λ) θ̄ + H_t u      m̄ ← β1 m̃      v̄ ← β2 ṽ      df/dw_i += ⟨u, ∇ℓ_i(θ_t)⟩ / tokens_t

with H_t the Hessian of the step loss. Everything in it is differentiated exactly: both moments,
the bias corrections (constants), decoupled weight decay, the learning rate of each step and the
clip factor, whose dependence on the gradient norm is the second term of u when clipping is
active (at the kink n + 1e-6 = M exactly the unclipped branch is taken). Where v' = 0 (a
coordinate whose gradient has been exactly 0 so far, e.g. embedding rows of unseen tokens, or a
LoRA factor facing a zero-initialised one) sqrt has no derivative; ṽ is set to 0 there, which is
the limit: every path from it to w is multiplied by a gradient coordinate that is 0 (as g → 0
the v-path term of ḡ vanishes like |g|). The m-path, −α θ̄ / eps there, is kept: it is exact.
The learning rates, betas and eps are not differentiated (they do not depend on w).

H_t u and the per-example products ⟨u, ∇ℓ_i⟩ come from one double backward of
φ = ⟨u, ∇θ L_t(θ_t, w)⟩ with respect to (θ, w) per micro-batch: ∂φ/∂θ = H_t u and
∂φ/∂w_i = ⟨u, ∇ℓ_i⟩ / tokens_t, so the per-example terms cost nothing extra. Q queries share the
forward and the first (graph-building) backward; each adds one double backward.

Cost. The forward replay is one training run, plus copies of the state and gradient every k
steps. The reverse pass needs, at each step, θ_t and g_raw(θ_t) before it can form u: a
checkpointed step has them, the other k − 1 steps of a segment are recomputed from its checkpoint
(one gradient evaluation each, T − T/k in all). Each step then takes one forward with a
graph-building backward (shared by the Q queries) and one double backward per query. Time ≈
(1 − 1/k) training + T (graph + Q double backwards); memory ≈ 4P (T/k + k) for the checkpoints
and one segment's records (θ, m, v, g_raw each) + 3PQ adjoints + the double backward's graph.
k = 1 (a checkpoint every step) recomputes nothing and holds 4PT; k ≈ sqrt(T) holds least
(≈ 8P sqrt(T)) for ≈ one training run more; k = 0 (one checkpoint) holds 4PT and recomputes
everything. With `Replay(offload=FOLDER)` the checkpoints live in files and memory holds one
segment (4Pk) + the adjoints: k = 1 then costs no recomputation and ≈ 7P + 3PQ of memory. The
double backward holds about three times a training micro-batch's activations:
`TrainingRun.curvature_micro_batch_size` bounds it (the bundled benchmark uses 2 for 8).

Precision. The model's forward/backward (and the double backward) run under the run's autocast;
the adjoints, moments' adjoints and the [Q, N] accumulators are fp32 (fp64 when the model is
fp64, as in the tests) and the scores fp64. SDPA attention runs its math kernel during the
double backward (the fused CPU/CUDA kernels have no second derivative).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from assay.core.errors import AssayError
from assay.core.precision import PrecisionPolicy, full_precision
from assay.core.progress import Progress
from assay.counterfactual.replay import (
    CLIP_EPS,
    LossFn,
    Replay,
    StepRecord,
    micro_batches,
    weighted_step_loss,
)
from assay.lm.data import collate
from assay.lm.losses import example_losses

Gradient = list[torch.Tensor]
"""One tensor per trainable parameter, in `trainable_parameters` order."""


@dataclass
class Adjoint:
    """d f / d (θ, m, v) at a step boundary, for one query objective f."""

    params: Gradient
    """θ̄ (starts as ∇f(θ_T))."""
    exp_avg: Gradient
    """m̄ (starts at 0: f does not read the moments)."""
    exp_avg_sq: Gradient
    """v̄ (starts at 0)."""

    @classmethod
    def start(cls, grad: Sequence[torch.Tensor], dtype: torch.dtype) -> Adjoint:
        """The adjoint after the last step: θ̄ = ∇f(θ_T), m̄ = v̄ = 0."""
        params = [g.detach().to(dtype).clone() for g in grad]
        return cls(params, [torch.zeros_like(p) for p in params], [torch.zeros_like(p) for p in params])


def adjoint_dtype(replay: Replay) -> torch.dtype:
    """fp32 for fp32 (or bf16-autocast) runs, fp64 for fp64 models."""
    return torch.promote_types(replay.params[0].dtype, torch.float32)


def gradient_adjoint(replay: Replay, t: int, record: StepRecord, adj: Adjoint) -> Gradient:
    """Adjoint of the unclipped gradient g_raw (the HVP direction u); moves adj to before step t.

    On return adj.exp_avg and adj.exp_avg_sq are m̄, v̄ of the state before step t and adj.params
    holds (1 − lr λ) θ̄, to which the caller adds H_t u.
    """
    opt = replay.run.optimizer
    beta1, beta2 = opt.betas
    dtype = adj.params[0].dtype
    s = float(record.state.step + 1)
    alpha = opt.lrs[t] / (1 - beta1**s)
    b = (1 - beta2**s) ** 0.5
    g_bar: Gradient = []
    for i, (m, v, raw) in enumerate(zip(record.state.exp_avg, record.state.exp_avg_sq, record.grads)):
        g = raw.to(dtype) * record.coef
        m_new = m.to(dtype).lerp(g, 1 - beta1)
        root = (v.to(dtype) * beta2 + (1 - beta2) * g * g).sqrt()  # sqrt(v')
        denom = root / b + opt.eps
        theta_bar = adj.params[i]
        m_tilde = adj.exp_avg[i] - alpha * theta_bar / denom
        safe = torch.where(root > 0, root, torch.ones_like(root))
        v_term = alpha * theta_bar * m_new / (2 * b * safe * denom * denom)
        v_tilde = adj.exp_avg_sq[i] + torch.where(root > 0, v_term, torch.zeros_like(v_term))
        g_bar.append((1 - beta1) * m_tilde + 2 * (1 - beta2) * g * v_tilde)
        adj.exp_avg[i] = beta1 * m_tilde
        adj.exp_avg_sq[i] = beta2 * v_tilde
        if opt.weight_decay != 0:
            adj.params[i] = theta_bar * (1 - opt.lrs[t] * opt.weight_decay)
    return clip_adjoint(replay, record, g_bar)


def clip_adjoint(replay: Replay, record: StepRecord, g_bar: Gradient) -> Gradient:
    """u = d f / d g_raw from ḡ = d f / d g, through g = c(g_raw) g_raw (exact when clipping is active)."""
    limit = replay.run.optimizer.max_grad_norm
    active = limit > 0 and limit / (record.norm + CLIP_EPS) < 1.0
    if not active:
        return g_bar  # c = 1 exactly
    c, n = record.coef, record.norm
    dot = sum(float((gb * raw.to(gb.dtype)).sum()) for gb, raw in zip(g_bar, record.grads))
    shift = c * dot / (n * (n + CLIP_EPS))
    return [c * gb - shift * raw.to(gb.dtype) for gb, raw in zip(g_bar, record.grads)]


def curvature_products(
    replay: Replay, t: int, directions: Sequence[Gradient], into: Sequence[Gradient]
) -> torch.Tensor:
    """Adds H_t u_q to into[q] for each direction u_q; returns [Q, B] ⟨u_q, ∇ℓ_i(θ_t)⟩ / tokens_t.

    At the model's current θ (θ_t). Adding in place saves a parameter-sized copy per query.
    """
    run, params = replay.run, replay.params
    positions, tokens = run.steps[t], run.step_tokens(t)
    fn = run.curvature_loss_fn or run.loss_fn
    size = run.curvature_micro_batch_size or run.micro_batch_size
    dtype = directions[0][0].dtype
    dots = torch.zeros(len(directions), len(positions), dtype=dtype, device=params[0].device)
    done = 0
    with sdpa_kernel([SDPBackend.MATH]):  # the fused attention kernels have no double backward
        for chunk in micro_batches(positions, size):
            weights = replay.weights[chunk].detach().clone().requires_grad_(True)  # [b]
            loss = weighted_step_loss(run, replay.model, chunk, weights, tokens, fn)
            grads = torch.autograd.grad(loss, params, create_graph=True, materialize_grads=True)
            for q, us in enumerate(directions):
                with full_precision(params[0].device):
                    phi = sum((g * u.to(g.dtype)).sum() for g, u in zip(grads, us))
                assert isinstance(phi, torch.Tensor)
                *hv, dw = torch.autograd.grad(
                    phi, [*params, weights], retain_graph=q + 1 < len(directions), materialize_grads=True
                )
                for acc, h in zip(into[q], hv):
                    acc.add_(h.to(dtype))
                dots[q, done : done + len(chunk)] = dw.to(dtype)
            done += len(chunk)
    return dots


def metagradients(
    replay: Replay,
    objective_grads: Sequence[Sequence[torch.Tensor]],
    weights: torch.Tensor | None = None,
    first_step: int = 0,
) -> torch.Tensor:
    """[Q, N] fp64 d f_q / d w_i for objectives f_q whose gradients at θ_T are given.

    Runs the forward replay first when weights are given or none has run; the model holds θ_T on
    return. All Q objectives share one reverse pass (one recomputation, one graph per micro-batch).
    `first_step` > 0 differentiates only steps first_step.. (the earlier ones held fixed: the
    weights an example had there are not attributed), and the reverse pass stops there.
    """
    if not objective_grads:
        raise AssayError("no query objectives to differentiate")
    if weights is not None or not replay.checkpoints:
        replay.forward(weights)
    dtype = adjoint_dtype(replay)
    adjoints = [Adjoint.start(g, dtype) for g in objective_grads]
    out = torch.zeros(len(adjoints), replay.run.num_examples, dtype=torch.float64)
    done = 0
    with Progress(len(replay.run.steps), f"metagradients ({len(adjoints)} queries)", unit="step") as bar:
        for start in sorted(replay.checkpoints, reverse=True):
            if start + replay.interval <= first_step:
                break
            records = replay.segment(start)
            while records:
                record = records.pop()  # frees each step's state as soon as it is used
                if start + len(records) >= first_step:
                    reverse_step(replay, start + len(records), record, adjoints, out)
                done += 1
                bar.set_done(done)
    replay.load(replay.final)
    return out


def reverse_step(
    replay: Replay, t: int, record: StepRecord, adjoints: list[Adjoint], out: torch.Tensor
) -> None:
    """Carry every query's adjoint from after step t to before it; add step t's example terms to out."""
    directions = [gradient_adjoint(replay, t, record, adj) for adj in adjoints]
    replay.load(record.state.params)
    dots = curvature_products(replay, t, directions, [adj.params for adj in adjoints])
    positions = torch.as_tensor(replay.run.steps[t], device=out.device)
    out.index_add_(1, positions, dots.to(device=out.device, dtype=torch.float64))


def objective_gradients(
    model: nn.Module,
    loss_fn: LossFn,
    groups: Sequence[np.ndarray],
    policy: PrecisionPolicy | None = None,
) -> list[Gradient]:
    """∇θ Σ_{j in group} ℓ_j(θ) at the model's current θ, per group of query positions (trainable θ)."""
    params = [p for _, p in model.named_parameters() if p.requires_grad]
    out = []
    for group in groups:
        autocast = policy.autocast() if policy is not None else torch.autocast("cpu", enabled=False)
        with autocast:
            losses = loss_fn(model, np.asarray(group, dtype=np.int64))
        with full_precision(losses.device):
            total = losses.sum()
        out.append([g.detach() for g in torch.autograd.grad(total, params, materialize_grads=True)])
    return out


def summed(grads: Sequence[Gradient]) -> Gradient:
    """The gradient of the sum of the objectives (the aggregate query: one cheap reverse pass)."""
    return [torch.stack(parts).sum(0) for parts in zip(*grads)]


def replay_scores(
    replay: Replay,
    query_loss_fn: LossFn,
    queries: Sequence[np.ndarray],
    aggregate: bool = False,
    query_batch_size: int = 8,
    policy: PrecisionPolicy | None = None,
) -> np.ndarray:
    """[Q, N] (or [1, N] when aggregate) scores −d f_q / d w_i, f_q a query group's summed loss.

    `assay score`'s convention: positive = proponent (up-weighting the example lowers the
    query's loss). Queries are differentiated `query_batch_size` at a time (each batch one
    reverse pass: memory grows by 3 parameter copies per query in a batch).
    """
    if query_batch_size < 1:
        raise AssayError("query_batch_size must be >= 1")
    replay.forward()
    grads = objective_gradients(replay.model, query_loss_fn, queries, policy)
    if aggregate:
        grads = [summed(grads)]
    parts = [
        -metagradients(replay, grads[i : i + query_batch_size])
        for i in range(0, len(grads), query_batch_size)
    ]
    return torch.cat(parts).numpy()


def lm_loss_fns(examples: object, pad_id: int, device: torch.device | str = "cpu") -> tuple[LossFn, LossFn]:
    """(loss_fn, curvature_loss_fn) for a causal LM over assay `Examples`, as `assay finetune` computes them.

    The first is `example_losses` (what training ran, chunked head included, for a bit-exact
    replay); the second the plain logits path, which has a second derivative.
    """

    def loss_fn(model: nn.Module, positions: np.ndarray) -> torch.Tensor:
        return example_losses(model, collate(examples, positions, pad_id, device))  # type: ignore[arg-type]

    def curvature_loss_fn(model: nn.Module, positions: np.ndarray) -> torch.Tensor:
        return plain_example_losses(model, collate(examples, positions, pad_id, device))  # type: ignore[arg-type]

    return loss_fn, curvature_loss_fn


def plain_example_losses(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """[B] summed next-token cross-entropy from the full logits (fp32, or fp64 for an fp64 model)."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    with full_precision(logits.device):
        shift = logits[:, :-1].to(torch.promote_types(logits.dtype, torch.float32))  # [B, T-1, V]
        loss = nn.functional.cross_entropy(
            shift.transpose(1, 2), batch["labels"][:, 1:], ignore_index=-100, reduction="none"
        )  # [B, T-1]
        return loss.sum(dim=1)
