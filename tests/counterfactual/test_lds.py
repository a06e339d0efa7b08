"""LDS against independent references: brute-force Spearman, and retraining ridge / logistic regression.

The known-answer tests retrain convex models exactly (closed form for ridge, Newton's method for
L2 logistic regression) on random half-subsets and score exact influence functions against
them: influence must reach LDS >= 0.9, the same scores shuffled across training examples must
score about 0, and the same scores negated must score minus the original.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import pytest

from assay.core.errors import AssayError
from assay.counterfactual.lds import (
    average_ranks,
    bootstrap_mean_ci,
    linear_datamodel_score,
    sample_subsets,
    spearman,
    subset_size,
)

try:  # scipy is not an assay dependency; use it as a second reference when it is there
    from scipy.stats import spearmanr
except ImportError:  # pragma: no cover - depends on the environment
    spearmanr = None


# ---------------------------------------------------------------------------------------------
# Spearman


def _brute_ranks(x: list[float]) -> list[float]:
    """Rank of each value = 1 + (# smaller) + (# equal others) / 2, by counting: O(n^2)."""
    return [1 + sum(y < v for y in x) + (sum(y == v for y in x) - 1) / 2 for v in x]


def _brute_spearman(a: list[float], b: list[float]) -> float:
    """Pearson correlation of brute-force average ranks, written out term by term."""
    ra, rb = _brute_ranks(a), _brute_ranks(b)
    n = len(a)
    ma, mb = sum(ra) / n, sum(rb) / n
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    va = sum((x - ma) ** 2 for x in ra)
    vb = sum((y - mb) ** 2 for y in rb)
    return cov / math.sqrt(va * vb) if va > 0 and vb > 0 else math.nan


def test_spearman_documented_example():
    # scipy.stats.spearmanr's documented example: 0.8207826816681233 (one tie in y).
    rho = spearman(np.array([[1, 2, 3, 4, 5]]).T, np.array([[5, 6, 7, 8, 7]]).T)
    assert rho[0] == pytest.approx(0.8207826816681233, abs=1e-12)


def test_spearman_without_ties_matches_the_rank_difference_formula():
    rng = np.random.default_rng(0)
    a, b = rng.normal(size=(40, 7)), rng.normal(size=(40, 7))
    b[:, 0] = a[:, 0] ** 3  # monotone: exactly 1
    b[:, 1] = -np.exp(a[:, 1])  # antitone: exactly -1
    d = average_ranks(a) - average_ranks(b)
    n = len(a)
    expected = 1 - 6 * (d**2).sum(axis=0) / (n * (n**2 - 1))  # valid only without ties
    np.testing.assert_allclose(spearman(a, b), expected, atol=1e-12)
    assert spearman(a, b)[0] == 1.0 and spearman(a, b)[1] == -1.0


@pytest.mark.parametrize("levels", [2, 3, 5, 50])
def test_spearman_with_ties_matches_brute_force(levels):
    rng = np.random.default_rng(levels)
    a = rng.integers(0, levels, size=(25, 6)).astype(float)  # few levels: many ties
    b = rng.integers(0, levels, size=(25, 6)).astype(float) + 0.3 * a
    got = spearman(a, b)
    for q in range(a.shape[1]):
        assert got[q] == pytest.approx(_brute_spearman(list(a[:, q]), list(b[:, q])), abs=1e-12)
        if spearmanr is not None:
            assert got[q] == pytest.approx(spearmanr(a[:, q], b[:, q]).statistic, abs=1e-12)


def test_average_ranks_match_brute_force():
    x = np.array([[3.0, 1.0, 4.0, 1.0, 5.0, 9.0, 2.0, 6.0, 5.0, 3.0, 5.0]]).T
    assert average_ranks(x)[:, 0].tolist() == _brute_ranks(list(x[:, 0]))


def test_spearman_constant_column_is_nan_and_others_unaffected():
    rng = np.random.default_rng(1)
    a, b = rng.normal(size=(10, 3)), rng.normal(size=(10, 3))
    a[:, 1] = 2.5
    b[:, 2] = -1.0
    rho = spearman(a, b)
    assert np.isnan(rho[1]) and np.isnan(rho[2])
    assert rho[0] == pytest.approx(_brute_spearman(list(a[:, 0]), list(b[:, 0])), abs=1e-12)


# ---------------------------------------------------------------------------------------------
# Subsets


def test_subsets_have_exact_sizes_and_are_reproducible():
    for n, alpha in [(101, 0.5), (10, 0.25), (7, 0.5), (1000, 0.1)]:
        masks = sample_subsets(n, 20, alpha, seed=3)
        assert masks.shape == (20, n) and masks.dtype == np.bool_
        assert (masks.sum(axis=1) == subset_size(n, alpha)).all()
        np.testing.assert_array_equal(masks, sample_subsets(n, 20, alpha, seed=3))
    assert subset_size(7, 0.5) == 4 and subset_size(10, 0.25) == 3  # halves round up
    assert not np.array_equal(sample_subsets(50, 5, 0.5, 0), sample_subsets(50, 5, 0.5, 1))


def test_subset_m_does_not_depend_on_how_many_are_drawn():
    few, many = sample_subsets(60, 4, 0.5, seed=7), sample_subsets(60, 32, 0.5, seed=7)
    np.testing.assert_array_equal(few, many[:4])
    assert len(np.unique(many, axis=0)) == 32  # and the subsets differ from one another


def test_every_example_is_kept_about_alpha_of_the_time():
    masks = sample_subsets(40, 4000, 0.3, seed=0)
    rate = masks.mean(axis=0)  # per example: Binomial(4000, 0.3) / 4000, sd ~ 0.0072
    assert np.abs(rate - 0.3).max() < 0.035  # > 4.5 sd over 40 examples


@pytest.mark.parametrize(
    "n,m,alpha,seed,match",
    [
        (100, 10, 0.0, 0, "alpha"),
        (100, 10, 1.0, 0, "alpha"),
        (3, 10, 0.1, 0, "keeps 0 of 3"),
        (1, 5, 0.5, 0, "at least 2 training examples"),
        (9, 5, 0.5, -1, "non-negative"),
    ],
)
def test_subset_arguments_are_checked(n, m, alpha, seed, match):
    with pytest.raises(AssayError, match=match):
        sample_subsets(n, m, alpha, seed)


# ---------------------------------------------------------------------------------------------
# LDS on exactly linear outputs, the bootstrap, and input checks


def test_lds_is_one_when_outputs_are_a_monotone_function_of_the_prediction():
    rng = np.random.default_rng(0)
    scores = rng.normal(size=(4, 30))
    masks = sample_subsets(30, 40, 0.5, seed=0)
    linear = masks @ scores.T  # [M, Q]
    losses = 2.0 - np.exp(0.3 * linear)  # proponents kept -> lower loss
    assert linear_datamodel_score(scores, masks, losses).per_query.tolist() == [1.0] * 4
    assert linear_datamodel_score(scores, masks, linear, higher_is_better=True).mean == 1.0
    assert linear_datamodel_score(scores, masks, losses, higher_is_better=True).mean == -1.0


def test_constant_scores_leave_the_query_out_of_the_mean():
    rng = np.random.default_rng(1)
    scores = rng.normal(size=(3, 30))
    scores[1] = 0.1  # identical scores: every equal-sized subset predicts the same
    masks = sample_subsets(30, 20, 0.5, seed=0)
    outputs = -(masks @ scores.T) + 0.01 * rng.normal(size=(20, 3))
    result = linear_datamodel_score(scores, masks, outputs)
    assert np.isnan(result.per_query[1]) and result.num_undefined == 1 and result.num_defined == 2
    assert result.mean == pytest.approx(np.mean(result.per_query[[0, 2]]))
    assert result.to_dict()["per_query"][1] is None


def test_bootstrap_interval_matches_the_normal_approximation():
    values = np.random.default_rng(2).normal(0.5, 0.2, size=400)
    low, high = bootstrap_mean_ci(values, num_resamples=2000, confidence=0.95, seed=0)
    half = 1.959964 * values.std(ddof=1) / math.sqrt(values.size)
    assert low == pytest.approx(values.mean() - half, abs=0.15 * half)
    assert high == pytest.approx(values.mean() + half, abs=0.15 * half)
    assert (low, high) == bootstrap_mean_ci(values, num_resamples=2000, confidence=0.95, seed=0)
    assert bootstrap_mean_ci(np.full(9, 0.3)) == pytest.approx((0.3, 0.3))


def _valid():
    rng = np.random.default_rng(0)
    return rng.normal(size=(3, 20)), sample_subsets(20, 8, 0.5, 0), rng.normal(size=(8, 3))


@pytest.mark.parametrize(
    "change,match",
    [
        (lambda s, m, o: (s[:, :19], m, o), "scores cover 19 training examples but masks cover 20"),
        (lambda s, m, o: (s, m[:7], o), "masks hold 7 subsets but outputs hold 8"),
        (lambda s, m, o: (s[:2], m, o), "scores cover 2 queries but outputs cover 3"),
        (lambda s, m, o: (s[0], m, o), "scores must be a 2-D array"),
        (lambda s, m, o: (s, m[:2], o[:2]), "at least 3 retrained subsets"),
        (
            lambda s, m, o: (np.where(np.arange(20) == 4, np.nan, s), m, o),
            "first at query 0 and training example 4",
        ),
        (lambda s, m, o: (s, m, np.where(np.arange(3) == 2, np.inf, o)), "subset 0 and query 2"),
        (lambda s, m, o: (s, m * 2, o), "masks must be boolean"),
        (lambda s, m, o: (s, np.repeat(m[:1], 8, axis=0), o), "all subsets in masks are the same"),
    ],
)
def test_bad_inputs_raise_one_line(change, match):
    with pytest.raises(AssayError, match=match) as info:
        linear_datamodel_score(*change(*_valid()))
    assert "\n" not in str(info.value)


# ---------------------------------------------------------------------------------------------
# Known answers: exact influence on retrained ridge and logistic regression

N_TRAIN, N_QUERY, DIM, LAMBDA, M = 160, 6, 6, 1.0, 80


def _features(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.normal(size=(n, DIM)) * np.linspace(0.5, 2.0, DIM)  # anisotropic: H^-1 matters


def _ridge_problem(seed: int):
    """y = x·w + noise; queries sit 3 noise-sd off the line so their residual keeps its sign
    across subsets (a query with residual ~0 has a loss quadratic, not linear, in θ)."""
    rng = np.random.default_rng(seed)
    x, xq, w = _features(rng, N_TRAIN), _features(rng, N_QUERY), rng.normal(size=DIM)
    y = x @ w + rng.normal(size=N_TRAIN)
    yq = xq @ w + 3.0 * rng.choice([-1.0, 1.0], size=N_QUERY)

    def fit(xs, ys):  # argmin ½Σ(xθ-y)² + ½λ|θ|², closed form
        return np.linalg.solve(xs.T @ xs + LAMBDA * np.eye(DIM), xs.T @ ys)

    def grads(theta, xs, ys):  # [n, DIM] per-example ∇ of ½(xθ-y)²
        return xs * (xs @ theta - ys)[:, None]

    def hessian(theta, xs):
        return xs.T @ xs + LAMBDA * np.eye(DIM)

    def losses(theta):
        return 0.5 * (xq @ theta - yq) ** 2

    return x, y, xq, yq, fit, grads, hessian, losses


def _sigmoid(z: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * z))


def _logistic_problem(seed: int):
    """Labels drawn from a logistic model (not separable); L2 logistic regression fit by Newton."""
    rng = np.random.default_rng(seed)
    x, xq, w = _features(rng, N_TRAIN), _features(rng, N_QUERY), rng.normal(size=DIM)
    y = (rng.random(N_TRAIN) < _sigmoid(x @ w)).astype(float)
    yq = (rng.random(N_QUERY) < _sigmoid(xq @ w)).astype(float)

    def hessian(theta, xs):
        p = _sigmoid(xs @ theta)
        return (xs * (p * (1 - p))[:, None]).T @ xs + LAMBDA * np.eye(DIM)

    def grads(theta, xs, ys):  # [n, DIM] per-example ∇ of the cross-entropy
        return xs * (_sigmoid(xs @ theta) - ys)[:, None]

    def fit(xs, ys):
        theta = np.zeros(DIM)
        for _ in range(40):  # Newton on a strongly convex objective: converged to fp64 well before
            theta -= np.linalg.solve(hessian(theta, xs), grads(theta, xs, ys).sum(0) + LAMBDA * theta)
        assert np.abs(grads(theta, xs, ys).sum(0) + LAMBDA * theta).max() < 1e-10
        return theta

    def losses(theta):
        z = xq @ theta
        return np.logaddexp(0.0, z) - yq * z

    return x, y, xq, yq, fit, grads, hessian, losses


PROBLEMS: dict[str, Callable] = {"ridge": _ridge_problem, "logistic": _logistic_problem}


def _retrain_and_attribute(problem: str, seed: int):
    """Ground truth by retraining on M half-subsets, and exact influence at the full-data optimum.

    Removing example i moves θ by ≈ H⁻¹∇ℓ_i, so the query loss rises by ≈ ∇L_qᵀH⁻¹∇ℓ_i: that is
    how much keeping i lowers it, i.e. the proponent score (minus Koh & Liang's I_up,loss).
    """
    x, y, xq, yq, fit, grads, hessian, losses = PROBLEMS[problem](seed)
    theta = fit(x, y)
    influence = grads(theta, xq, yq) @ np.linalg.solve(hessian(theta, x), grads(theta, x, y).T)  # [Q, N]
    masks = sample_subsets(N_TRAIN, M, 0.5, seed=seed)
    outputs = np.stack([losses(fit(x[mask], y[mask])) for mask in masks])  # [M, Q]
    inner = grads(theta, xq, yq) @ grads(theta, x, y).T  # plain gradient inner product
    return influence, inner, masks, outputs, (x, y, xq, yq, fit)


@pytest.mark.parametrize("problem", ["ridge", "logistic"])
@pytest.mark.parametrize("seed", [0, 1])
def test_exact_influence_predicts_retraining(problem, seed):
    influence, inner, masks, outputs, _ = _retrain_and_attribute(problem, seed)
    result = linear_datamodel_score(influence, masks, outputs)
    assert result.mean >= 0.9, result.per_query
    assert result.per_query.min() >= 0.85
    assert result.ci_low <= result.mean <= result.ci_high
    # The sign convention: the same scores negated must score minus the LDS.
    negated = linear_datamodel_score(-influence, masks, outputs)
    np.testing.assert_allclose(negated.per_query, -result.per_query, atol=1e-12)
    # Shuffled across training examples the scores carry no information: about 0.
    rng = np.random.default_rng(100 + seed)
    shuffled = [
        linear_datamodel_score(influence[:, rng.permutation(N_TRAIN)], masks, outputs).mean for _ in range(4)
    ]
    assert abs(np.mean(shuffled)) <= 0.15, shuffled
    # The Hessian matters with anisotropic features: the raw inner product does worse.
    assert linear_datamodel_score(inner, masks, outputs).mean < result.mean


def test_loss_and_margin_give_the_same_lds_for_logistic_regression():
    # Cross-entropy = softplus(-margin) with margin = (2y-1)·xθ: strictly decreasing, so ranking
    # -loss or +margin must agree exactly; a sign slip in `higher_is_better` would flip it.
    influence, _, masks, losses, (x, y, xq, yq, fit) = _retrain_and_attribute("logistic", 0)
    margins = np.stack([(2 * yq - 1) * (xq @ fit(x[mask], y[mask])) for mask in masks])
    by_loss = linear_datamodel_score(influence, masks, losses)
    by_margin = linear_datamodel_score(influence, masks, margins, higher_is_better=True)
    np.testing.assert_allclose(by_margin.per_query, by_loss.per_query, atol=1e-12)


@pytest.mark.parametrize(
    "option,match",
    [({"num_resamples": 0}, "num_resamples must be an integer >= 1"), ({"confidence": 1.0}, "confidence")],
)
def test_bootstrap_options_are_checked(option, match):
    with pytest.raises(AssayError, match=match):
        linear_datamodel_score(*_valid(), **option)
