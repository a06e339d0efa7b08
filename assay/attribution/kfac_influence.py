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

import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from assay.attribution.batches import check_batches, to_device
from assay.attribution.collector import DEFAULT_MODULES, GradientCollector, Objective, linear_modules
from assay.attribution.kfac import (
    DAMPING,
    KINDS,
    Kind,
    KronFactors,
    factor_modules,
    load_factors,
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
    kind: Kind | None = "ekfac",
    query_fn: Objective | None = None,
    modules: str | tuple[str, ...] | None = None,
    damping: float = DAMPING,
    precision: str = "fp32",
    factors: KronFactors | str | Path | None = None,
) -> torch.Tensor:
    """[Q, N] fp64 influence ⟨∇L_q, (H + δI)⁻¹ ∇ℓ_i⟩ summed over the linear modules' weights.

    `loss_fn(model, batch) -> [B]` per-example training losses (their labels choose the Fisher,
    see `kfac_fit`); `query_fn` what a query's gradient is taken of (default: `loss_fn`), as
    kronfluence's measurement. Positive = proponent (a step on example i lowers the query's
    loss). δ = `damping` × each module's mean eigenvalue (a finite number >= 0). `modules`: glob
    patterns over the linear layers (default: all but the head; biases are not attributed, see
    `kfac.py`). Pass `factors` already fitted (or the path of a file `save_factors` wrote) to skip
    the fit, e.g. EK-FAC factors scored as "kfac" (`kind=None`: the factors' own kind); they
    decide the modules, so `modules`, if given too, must select the same ones.
    """
    check_batches(train_batches, "train_batches")
    check_batches(query_batches, "query_batches")
    if not 0 <= damping < math.inf:  # NaN would score all NaN, inf all 0
        raise AssayError(f"damping must be a finite number >= 0, got {damping}")
    train_batches = list(train_batches)  # read up to three times: the two fits and the scores
    if factors is None:
        if kind is None:
            raise AssayError("kind=None means the given factors' own kind; to fit them choose kfac or ekfac")
        factors = fit_kfac(model, train_batches, loss_fn, kind, modules or DEFAULT_MODULES, precision)
    else:
        factors = _given_factors(model, factors, modules)
    kind = _factor_kind(factors, kind)
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


def _given_factors(model: nn.Module, factors: Any, modules: Any) -> KronFactors:
    """The factors (read from a path), refused in one line when they are not factors or when
    `modules` selects other modules than they were fitted on."""
    if isinstance(factors, str | Path):
        factors = load_factors(factors)
    if not isinstance(factors, KronFactors):
        raise AssayError(
            "factors must be the KronFactors of fit_kfac or the path of saved ones, "
            f"not a {type(factors).__name__}"
        )
    if modules is not None and set(linear_modules(model, modules)) != set(factors.modules):
        raise AssayError(
            f"modules={modules!r} selects other modules than the {len(factors.modules)} the factors were "
            "fitted on; leave modules out when passing factors (they decide), or fit factors on those"
        )
    return factors


def _factor_kind(factors: KronFactors, kind: Any) -> Kind:
    """`kind` (None: the factors' own), refused when it is unknown or the factors lack it."""
    kind = factors.kind if kind is None else kind
    if kind not in KINDS:
        raise AssayError(f"unknown K-FAC kind {kind!r}; choose kfac or ekfac")
    if kind == "ekfac" and any(mf.corrected is None for mf in factors.modules.values()):
        raise AssayError(
            "these factors have no EK-FAC eigenvalue correction (fitted with kind='kfac'): "
            "score them with kind='kfac', or fit with kind='ekfac'"
        )
    return kind  # type: ignore[no-any-return]
