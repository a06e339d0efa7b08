"""Attribution from Python for any torch model: collect projected gradients, then score them.

    grads = collect_gradients(model, train_batches, loss_fn, projection_dim=16)
    queries = collect_gradients(model, query_batches, loss_fn, projection_dim=16)
    result = score(queries, grads, ScoreOptions(mode="trackstar"))   # result.scores [Q, N], result.top

`loss_fn(model, batch) -> [B]` returns one scalar per example (e.g. an unreduced cross-entropy
of a classifier); batches are dicts of tensors (other values, e.g. texts, reach loss_fn as they
are). The same seeded projection is used for both calls when `projection_dim` and `seed` agree,
so the two sets of rows are comparable.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from assay.attribution.batches import check_batches, model_device, to_device
from assay.attribution.collector import GradientCollector, Objective, linear_modules
from assay.attribution.kernel import TopRows, plan_queries, score_rows
from assay.attribution.options import ScoreOptions, gradient_rows, score_options
from assay.attribution.precondition import Whitening, build_whitening, second_moment_sums
from assay.attribution.projection import Projector
from assay.attribution.rows import TensorRows
from assay.core.errors import AssayError
from assay.core.precision import PrecisionPolicy


@dataclass
class Gradients:
    """Per-example projected gradients [N, D] fp32 and the columns of each module."""

    rows: torch.Tensor  # [N, D] fp32
    modules: dict[str, slice]
    projection_dim: int
    seed: int


@dataclass
class Scores:
    """All scores [A, N] (A = queries, or 1 when aggregated) and the top/bottom rows."""

    scores: torch.Tensor  # [A, N] fp32
    top: TopRows
    whitening: Whitening | None


def collect_gradients(
    model: nn.Module,
    batches: Iterable[dict[str, Any]],
    loss_fn: Objective,
    modules: str | tuple[str, ...] = ("*",),
    projection_dim: int = 16,
    seed: int = 0,
    precision: str = "fp32",
) -> Gradients:
    """Projected per-example gradients of `loss_fn` w.r.t. the linear layers matching `modules`
    (glob patterns; one str is one pattern). `projection_dim` 0 keeps the raw gradients.

    Rows come out in the order of the batches' examples. The model's parameters are left as
    they were (requires_grad is restored); no `.grad` is formed.
    """
    projection_dim = _whole(projection_dim, "projection_dim", minimum=0)
    seed = _whole(seed, "seed")  # the projection hashes the seed's text: 0.0 would be another one
    check_batches(batches)
    device = model_device(model)
    policy = PrecisionPolicy.resolve(precision, device)
    chosen = linear_modules(model, modules)
    collector = GradientCollector(model, chosen, Projector(projection_dim, seed), policy)
    parts = []
    with collector:
        for batch in batches:
            grads, _ = collector.gradients(to_device(batch, device), loss_fn)
            parts.append(grads.cpu())
    if not parts:
        raise AssayError("no batches to collect gradients from")
    slices = {s.name: slice(s.start, s.stop) for s in collector.slots}
    return Gradients(torch.cat(parts), slices, projection_dim, seed)


def _whole(value: Any, name: str, minimum: int | None = None) -> int:
    """`value` as an int, or one line for a float, a bool or one below `minimum`."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise AssayError(f"{name} must be an int, not {value!r}")
    if minimum is not None and value < minimum:
        raise AssayError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def score(queries: Gradients, train: Gradients, options: ScoreOptions | None = None) -> Scores:
    """Score every train row against the queries (the modes are `assay score`'s; docs/attribution.md).

    trackstar and influence use R_train estimated from all train rows (mixed with the queries'
    statistics in trackstar mode). `options.search` and the caching options do not apply here.
    Rows holding NaN or inf, or not as wide as the modules' columns, are refused before any work.
    """
    o = score_options(options)
    for given, name in ((queries, "queries"), (train, "train")):
        if not isinstance(given, Gradients):
            raise AssayError(
                f"{name} must be the Gradients of collect_gradients, not a {type(given).__name__}"
            )
    if queries.modules != train.modules or (queries.projection_dim, queries.seed) != (
        train.projection_dim,
        train.seed,
    ):
        raise AssayError("queries and train gradients were collected with different modules or projection")
    dim = max((sl.stop for sl in train.modules.values()), default=0)  # the modules' columns
    train_rows, query_rows = gradient_rows(train.rows, dim, "train"), gradient_rows(queries.rows, dim)
    whitening = None
    if o.mode in ("trackstar", "influence"):
        sums = second_moment_sums(train_rows, train.modules)
        mix = (0.0 if o.mode == "influence" else None) if o.mix is None else o.mix
        whitening = build_whitening(
            sums, train_rows.shape[0], query_rows, train.modules, mix, o.damping, o.mix_fraction
        )
    plan = plan_queries(query_rows, o.mode, o.aggregate, whitening)
    columns = 1 if o.aggregate != "none" else query_rows.shape[0]
    out = torch.zeros(columns, train_rows.shape[0])
    top = score_rows(TensorRows(train_rows), plan, o.top_k, scores_out=out.numpy())
    return Scores(out, top, whitening)
