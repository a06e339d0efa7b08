"""K-FAC / EK-FAC influence scores for any torch model in one call, without an index.

    scores = kfac_influence(model, train_batches, query_batches, loss_fn, kind="ekfac")  # [Q, N]

The same steps as `assay build --preconditioner ekfac --projection_dim 0` then `assay score`,
for a model that is not a causal LM (a classifier, a regressor): factors fitted on the training
batches (`fit_kfac`), each query's gradient preconditioned, (H + δ)⁻¹ ∇L_q (`precondition_queries`),
and its inner product taken with every training example's raw gradient, one batch at a time (the
training gradients are never held all at once). Gradients are unprojected, so the scores are
exact for the factors: for large models, build an index instead (it projects).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from assay.attribution.batches import check_batches, to_device
from assay.attribution.collector import DEFAULT_MODULES, GradientCollector, Objective
from assay.attribution.kfac import (
    BLOCK_SIZE,
    DAMPING,
    Kind,
    KronFactors,
    factor_modules,
    precondition_queries,
    resolve_policy,
)
from assay.attribution.kfac_fit import fit_kfac
from assay.attribution.projection import Projector
from assay.core.errors import AssayError
from assay.core.precision import LINALG_DTYPE

Batches = Iterable[dict[str, torch.Tensor]]


def kfac_influence(
    model: nn.Module,
    train_batches: Batches,
    query_batches: Batches,
    loss_fn: Objective,
    kind: Kind = "ekfac",
    query_fn: Objective | None = None,
    modules: tuple[str, ...] = DEFAULT_MODULES,
    damping: float = DAMPING,
    precision: str = "fp32",
    factors: KronFactors | None = None,
) -> torch.Tensor:
    """[Q, N] fp64 influence ⟨∇L_q, (H + δI)⁻¹ ∇ℓ_i⟩ summed over the linear modules' weights.

    `loss_fn(model, batch) -> [B]` per-example training losses (their labels choose the Fisher,
    see `kfac_fit`); `query_fn` what a query's gradient is taken of (default: `loss_fn`), as
    kronfluence's measurement. Positive = proponent (a step on example i lowers the query's
    loss). δ = `damping` × each module's mean eigenvalue. `modules`: glob patterns over the
    linear layers (biases are not attributed; see `kfac.py`). Pass `factors` already fitted to
    skip the fit (e.g. EK-FAC factors scored as "kfac").
    """
    check_batches(train_batches, "train_batches")
    check_batches(query_batches, "query_batches")
    train_batches = list(train_batches)  # read up to three times: the two fits and the scores
    if factors is None:
        factors = fit_kfac(model, train_batches, loss_fn, kind, modules, precision, BLOCK_SIZE)
    policy = resolve_policy(model, precision)
    queries = precondition_queries(
        model, factors, query_batches, query_fn or loss_fn, Projector(0), policy, kind, damping
    )
    left = queries.rows.to(policy.device, LINALG_DTYPE)  # [Q, D]
    collector = GradientCollector(model, factor_modules(model, factors), Projector(0), policy)
    parts = []
    with collector:
        for batch in train_batches:
            raw, _ = collector.gradients(to_device(batch, policy.device), loss_fn)
            parts.append((left @ raw.to(LINALG_DTYPE).T).cpu())  # [Q, B]
    if not parts:
        raise AssayError("no training batches to score")
    return torch.cat(parts, dim=1)
