"""The linear datamodeling score (LDS): does an attribution predict what retraining does?

Ilyas et al. 2022 ("Datamodels") and Park et al. 2023 ("TRAK"): draw M random subsets
S_1..S_M of the training set, each holding a fraction α of it, retrain on each and measure
every query's output (its loss, or a margin). An attribution method gives a score τ(q, i) per
query q and training example i; its *linear datamodel* predicts the output of the model
trained on S_m by summing the scores of the examples kept,

    prediction[m, q] = Σ_{i ∈ S_m} τ(q, i),

and the LDS of query q is the Spearman rank correlation, across the M subsets, between those
predictions and the measured outputs. Ranks make the score blind to the scale and offset of
the attribution, so only the relative weights of the training examples matter.

Sign convention (as in `assay score`): a positive τ(q, i) means example i *lowers* query q's
loss (a proponent). Keeping more proponents then predicts a lower loss, so the prediction is
correlated with the *negative* loss, or with the margin itself: `higher_is_better=False` for
losses (the outputs are negated before ranking), `True` for margins, log-probabilities or
accuracies. A correct method scores near +1; the same scores negated score near -1.

Everything here is numpy on the CPU in float64: M is tens to hundreds and the work is one
[M, N] x [N, Q] product.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any

import numpy as np

from assay.core.errors import AssayError

MIN_SUBSETS = 3
"""Fewest subsets an LDS is computed over: a rank correlation of two points is always ±1."""

_SUBSET_STREAM = 52_711
"""Salt in each subset's seed, so LDS subsets never share a random stream with other uses of `seed`."""


def as_array(value: Any, name: str = "the array") -> np.ndarray:
    """`value` as a numpy array of numbers; a torch tensor is detached and brought to the CPU first
    (one that requires grad, as scores computed under autograd do, cannot become numpy as it is)."""
    if hasattr(value, "detach"):  # a torch.Tensor, without importing torch into this numpy module
        value = value.detach().cpu()
        if value.is_floating_point():
            value = value.double()  # numpy has no bfloat16
    try:
        array = np.asarray(value)
    except ValueError:  # ragged nested lists
        raise AssayError(f"{name} must be a rectangular array of numbers (rows of one length)") from None
    if array.dtype.kind not in "biuf":
        raise AssayError(f"{name} must hold numbers, not {array.dtype} values")
    return array


def _integer(value: Any, name: str, minimum: int) -> int:
    """`value` as an int >= minimum, or one line (a float or bool count is a mistake, not a count)."""
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < minimum:
        what = "a non-negative integer" if minimum == 0 else f"an integer >= {minimum}"
        raise AssayError(f"{name} must be {what}, got {value!r}")
    return int(value)


def _fraction(value: Any, name: str) -> float:
    """`value` as a float strictly between 0 and 1, or one line."""
    if not isinstance(value, numbers.Real) or isinstance(value, bool) or not 0.0 < float(value) < 1.0:
        raise AssayError(f"{name} must be a number strictly between 0 and 1, got {value!r}")
    return float(value)


def subset_size(n: int, alpha: float) -> int:
    """round(α·n) with halves rounded up: the number of training examples every subset holds."""
    return int(math.floor(alpha * n + 0.5))


def sample_subsets(n: int, num_subsets: int, alpha: float, seed: int) -> np.ndarray:
    """M random subsets of n training examples, each of exactly `subset_size(n, alpha)` of them.

    Subset m is drawn from its own generator, seeded by (seed, m), so it is the same whatever
    `num_subsets` is: growing M from 32 to 64 keeps the first 32 subsets and their retrained
    models. Returns masks [M, N] (bool): masks[m, i] is True when example i is in subset m.
    """
    n = _integer(n, "n (LDS subsets need at least 2 training examples)", 2)
    alpha = _fraction(alpha, "the subset fraction alpha")
    num_subsets = _integer(num_subsets, "the number of subsets", 1)
    seed = _integer(seed, "the subset seed", 0)
    k = subset_size(n, alpha)
    if not 1 <= k <= n - 1:
        raise AssayError(
            f"alpha={alpha} keeps {k} of {n} examples; choose alpha so a subset holds between 1 and {n - 1}"
        )
    masks = np.zeros((num_subsets, n), dtype=bool)  # [M, N]
    for m in range(num_subsets):
        kept = np.random.default_rng([seed, _SUBSET_STREAM, m]).choice(n, size=k, replace=False)
        masks[m, kept] = True
    return masks


def average_ranks(values: np.ndarray) -> np.ndarray:
    """Ranks 1..M of each column of `values` [M, Q]; tied values share the average of their ranks."""
    values = np.asarray(values, dtype=np.float64)
    m, q = values.shape
    order = np.argsort(values, axis=0, kind="stable")  # [M, Q]
    ordered = np.take_along_axis(values, order, axis=0)  # [M, Q], each column ascending
    starts = np.ones((m, q), dtype=bool)
    starts[1:] = ordered[1:] != ordered[:-1]  # True where a new run of equal values begins
    # Number the runs of ties across all columns at once (column-major, so every column's first
    # row starts a new run), then give each run the mean of the positions it covers.
    run = (np.cumsum(starts.T.ravel()) - 1).reshape(q, m).T  # [M, Q]
    position = np.broadcast_to(np.arange(1, m + 1, dtype=np.float64)[:, None], (m, q))
    totals = np.bincount(run.ravel(), weights=position.ravel())
    counts = np.bincount(run.ravel())
    ranks = np.empty((m, q), dtype=np.float64)
    np.put_along_axis(ranks, order, (totals / counts)[run], axis=0)
    return ranks


def spearman(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Spearman rank correlation of each column of a [M, Q] with the same column of b [M, Q] -> [Q].

    The Pearson correlation of average ranks, so ties are handled as scipy.stats.spearmanr does.
    A column where either side is constant has no correlation: NaN there.
    """
    ra = average_ranks(a)
    rb = average_ranks(b)
    ra -= ra.mean(axis=0)
    rb -= rb.mean(axis=0)
    cross = (ra * rb).sum(axis=0)  # [Q]
    norm = np.sqrt((ra * ra).sum(axis=0) * (rb * rb).sum(axis=0))  # [Q]; ranks are exact, so 0 means constant
    rho = np.full(norm.shape, np.nan)
    varies = norm > 0
    rho[varies] = np.clip(cross[varies] / norm[varies], -1.0, 1.0)
    return rho


def bootstrap_mean_ci(
    values: np.ndarray, num_resamples: int = 1000, confidence: float = 0.95, seed: int = 0
) -> tuple[float, float]:
    """Percentile bootstrap interval for the mean of `values` [K] (resampling with replacement).

    Returns (low, high); (NaN, NaN) when `values` is empty. Resamples are drawn in blocks so
    thousands of queries never need a [resamples, K] index array at once.
    """
    values = np.asarray(values, dtype=np.float64)
    _check_bootstrap(num_resamples, confidence, seed)
    if values.size == 0:
        return math.nan, math.nan
    rng = np.random.default_rng(seed)
    means = np.empty(num_resamples, dtype=np.float64)
    block = max(1, 2**22 // values.size)  # resamples per block: ~4M indices
    for start in range(0, num_resamples, block):
        stop = min(start + block, num_resamples)
        picks = rng.integers(0, values.size, size=(stop - start, values.size))
        means[start:stop] = values[picks].mean(axis=1)
    tail = (1.0 - confidence) / 2.0
    low, high = np.quantile(means, [tail, 1.0 - tail])
    return float(low), float(high)


def _check_bootstrap(num_resamples: int, confidence: float, seed: int = 0) -> None:
    _integer(num_resamples, "the bootstrap's num_resamples", 1)
    _fraction(confidence, "the bootstrap's confidence")
    _integer(seed, "the bootstrap's seed", 0)


@dataclass(frozen=True)
class LDSResult:
    """The LDS of one attribution method against one set of retrained models."""

    per_query: np.ndarray
    """[Q] Spearman correlation of each query; NaN where undefined (constant prediction or output)."""
    mean: float
    """Mean LDS over the queries where it is defined (NaN when it is defined for none)."""
    ci_low: float
    """Lower end of the bootstrap confidence interval of `mean`, resampling queries."""
    ci_high: float
    """Upper end of the bootstrap confidence interval of `mean`."""
    num_defined: int
    """Queries whose LDS is defined: the ones the mean and interval are over."""
    num_undefined: int
    """Queries left out because their predictions or outputs did not vary across subsets."""
    num_subsets: int
    """M, the number of retrained subsets each correlation is over."""
    confidence: float
    """Coverage of the interval, e.g. 0.95."""
    num_resamples: int
    """Bootstrap resamples behind the interval."""
    higher_is_better: bool
    """False when the outputs were losses (negated before ranking), True for margins and the like."""

    def to_dict(self) -> dict:
        """Plain JSON-ready numbers (NaN written as None)."""

        def num(x: float) -> float | None:
            return None if math.isnan(x) else float(x)

        return {
            "mean": num(self.mean),
            "ci_low": num(self.ci_low),
            "ci_high": num(self.ci_high),
            "num_defined": self.num_defined,
            "num_undefined": self.num_undefined,
            "num_subsets": self.num_subsets,
            "confidence": self.confidence,
            "num_resamples": self.num_resamples,
            "higher_is_better": self.higher_is_better,
            "per_query": [num(float(x)) for x in self.per_query],
        }


def _check_inputs(scores: np.ndarray, masks: np.ndarray, outputs: np.ndarray) -> None:
    """One clear line for each way the three arrays can disagree."""
    for name, array, dims in (
        ("scores", scores, "[queries, training examples]"),
        ("masks", masks, "[subsets, training examples]"),
        ("outputs", outputs, "[subsets, queries]"),
    ):
        if array.ndim != 2:
            raise AssayError(f"{name} must be a 2-D array {dims}, got shape {tuple(array.shape)}")
    (q, n), (m, n_masks), (m_out, q_out) = scores.shape, masks.shape, outputs.shape
    if n != n_masks:
        raise AssayError(
            f"scores cover {n} training examples but masks cover {n_masks}: "
            "score the same training pool the subsets were drawn from"
        )
    if m != m_out:
        raise AssayError(f"masks hold {m} subsets but outputs hold {m_out}: one row of outputs per subset")
    if q != q_out:
        raise AssayError(f"scores cover {q} queries but outputs cover {q_out}: score the same query set")
    if m < MIN_SUBSETS:
        raise AssayError(f"LDS needs at least {MIN_SUBSETS} retrained subsets, got {m}")
    _check_finite(scores, "scores", "query {} and training example {}")
    _check_finite(outputs, "outputs", "subset {} and query {}: a retrained model diverged?")
    if masks.dtype != np.bool_ and not np.isin(masks, (0, 1)).all():
        raise AssayError("masks must be boolean (or 0/1): True where a training example is in the subset")


def _check_finite(array: np.ndarray, name: str, where: str) -> None:
    bad = ~np.isfinite(array)
    if bad.any():
        first = np.argwhere(bad)[0]
        raise AssayError(f"{name} hold {int(bad.sum())} NaN/inf values, the first at " + where.format(*first))


def linear_datamodel_score(
    scores: np.ndarray,
    masks: np.ndarray,
    outputs: np.ndarray,
    *,
    higher_is_better: bool = False,
    num_resamples: int = 1000,
    confidence: float = 0.95,
    seed: int = 0,
) -> LDSResult:
    """LDS of attribution `scores` [Q, N] against models retrained on subsets `masks` [M, N].

    `outputs` [M, Q] is what was measured on query q with the model trained on subset m: a loss
    (`higher_is_better=False`, the default) or a margin / log-probability (`True`). Scores follow
    assay's convention, positive = the training example lowers the query's loss. Per query, the
    LDS is the Spearman correlation over subsets between Σ_{i∈S_m} scores[q, i] and the outputs
    (negated for losses). Queries where it is undefined are NaN and left out of the mean; the
    interval is a seeded percentile bootstrap over the defined queries.
    """
    scores = as_array(scores, "scores")
    masks = as_array(masks, "masks")
    outputs = as_array(outputs, "outputs")
    _check_inputs(scores, masks, outputs)
    _check_bootstrap(num_resamples, confidence, seed)
    if len(np.unique(masks.astype(bool), axis=0)) < 2:
        raise AssayError("all subsets in masks are the same: draw them with sample_subsets")
    # [M, N] @ [N, Q] -> [M, Q]: the datamodel's prediction for every subset and query.
    predictions = masks.astype(np.float64) @ scores.astype(np.float64).T
    target = outputs.astype(np.float64)
    target = target if higher_is_better else -target
    per_query = spearman(predictions, target)  # [Q]
    # Equal-sized subsets and a constant score row predict the same value for every subset;
    # the product's rounding could still make those sums differ by an ulp and rank noise.
    if len(np.unique(masks.sum(axis=1))) == 1:
        per_query[np.ptp(scores, axis=1) == 0] = np.nan
    defined = per_query[~np.isnan(per_query)]
    low, high = bootstrap_mean_ci(defined, num_resamples, confidence, seed)
    return LDSResult(
        per_query=per_query,
        mean=float(defined.mean()) if defined.size else math.nan,
        ci_low=low,
        ci_high=high,
        num_defined=int(defined.size),
        num_undefined=int(per_query.size - defined.size),
        num_subsets=int(masks.shape[0]),
        confidence=confidence,
        num_resamples=num_resamples,
        higher_is_better=higher_is_better,
    )
