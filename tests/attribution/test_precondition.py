"""The preconditioner's math (mixing, automatic λ, damping, R^{-1/2}) against numpy fp64."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from assay.attribution.precondition import auto_mix, build_whitening, second_moment_sums
from assay.core.errors import AssayError

SIZES = {"a": 6, "b": 10, "c": 4}


def _slices() -> dict[str, slice]:
    out, start = {}, 0
    for name, d in SIZES.items():
        out[name] = slice(start, start + d)
        start += d
    return out


def _data(seed: int = 0, n: int = 300, q: int = 5):
    rng = np.random.default_rng(seed)
    dim = sum(SIZES.values())
    mixing = rng.normal(size=(dim, dim))  # correlated, anisotropic gradients
    train = rng.normal(size=(n, dim)) @ mixing
    queries = rng.normal(size=(q, dim)) @ mixing + 3.0 * rng.normal(size=dim)  # a shared "template"
    return train, queries


def _reference(train, queries, mix, damping):
    """Independent fp64 numpy: R = mix·Rq + (1-mix)·(Rt + δI), δ = damping·mean eig(Rt), R^{-1/2}."""
    out = {}
    for name, sl in _slices().items():
        rt = train[:, sl].T @ train[:, sl] / len(train)
        rq = queries[:, sl].T @ queries[:, sl] / len(queries)
        delta = damping * np.linalg.eigvalsh(rt).mean()
        r = mix * rq + (1 - mix) * (rt + delta * np.eye(len(rt)))
        vals, vecs = np.linalg.eigh(r)
        out[name] = (vecs / np.sqrt(vals)) @ vecs.T, r, delta
    return out


def _reference_mix(train, queries, fraction):
    def spectrum(x):
        vals = [np.linalg.eigvalsh(x[:, sl].T @ x[:, sl] / len(x)) for sl in _slices().values()]
        return np.sort(np.clip(np.concatenate(vals), 0, None))[::-1]

    sq, st = spectrum(queries), spectrum(train)
    rank = int((sq > sq[0] * 1e-10).sum())
    k = max(int(round(fraction * rank)), 1) - 1
    return st[k] / (sq[k] + st[k])


@pytest.mark.parametrize("mix,damping", [(0.0, 0.1), (0.3, 0.1), (0.9, 0.01), (0.5, 1.0)])
def test_whitening_matches_numpy_fp64(mix, damping):
    train, queries = _data()
    sums = second_moment_sums(torch.from_numpy(train).float(), _slices())
    w = build_whitening(sums, len(train), torch.from_numpy(queries).float(), _slices(), mix, damping)
    ref = _reference(train.astype(np.float32).astype(np.float64), queries.astype(np.float32), mix, damping)
    for name, (w_ref, r, delta) in ref.items():
        got = w.matrices[name].double().numpy()
        np.testing.assert_allclose(got, w_ref, rtol=2e-4, atol=1e-6 * np.abs(w_ref).max())
        assert w.damping[name] == pytest.approx(delta, rel=1e-6)
        # W R W = I: what "R^{-1/2}" means
        ident = got @ r @ got
        np.testing.assert_allclose(ident, np.eye(len(r)), atol=2e-4)


def test_whitening_applies_to_both_sides_blockwise():
    train, queries = _data(1)
    t = torch.from_numpy(train).float()
    w = build_whitening(second_moment_sums(t, _slices()), len(train), None, _slices(), None, 1e-9)
    assert w.mix == 0.0  # no queries: R = R_train
    white = w.apply(t).double()
    for sl in _slices().values():  # whitened train second moment is the identity per module
        cov = (white[:, sl].T @ white[:, sl] / len(train)).numpy()
        np.testing.assert_allclose(cov, np.eye(cov.shape[0]), atol=1e-3)
    np.testing.assert_allclose(w.sq_norms(t).numpy(), (white**2).sum(1).numpy(), rtol=1e-4)
    np.testing.assert_allclose(w.apply(t, times=2).numpy(), w.apply(w.apply(t)).numpy(), rtol=1e-5)


@pytest.mark.parametrize("fraction,num_queries", [(0.01, 8), (0.2, 8), (0.9, 8), (0.3, 60)])
def test_auto_mix_matches_reference(fraction, num_queries):
    train, queries = _data(2, q=num_queries)
    t, q = torch.from_numpy(train), torch.from_numpy(queries)
    rt = {n: s / len(train) for n, s in second_moment_sums(t, _slices()).items()}
    rq = {n: s / len(queries) for n, s in second_moment_sums(q, _slices()).items()}
    got = auto_mix(rq, rt, fraction)
    assert got == pytest.approx(_reference_mix(train, queries, fraction), rel=1e-9)
    assert 0.0 < got < 1.0


def test_auto_mix_is_half_when_queries_are_the_training_set():
    train, _ = _data(3)
    t = torch.from_numpy(train)
    r = {n: s / len(train) for n, s in second_moment_sums(t, _slices()).items()}
    assert auto_mix(r, r) == pytest.approx(0.5)
    w = build_whitening(second_moment_sums(t, _slices()), len(train), t, _slices(), None, 0.1)
    # R = ½R + ½(R + δI): the damping belongs to the training estimate, weighted by its share
    w0 = build_whitening(second_moment_sums(t, _slices()), len(train), None, _slices(), 0.0, 0.05)
    for name in SIZES:
        torch.testing.assert_close(w.matrices[name], w0.matrices[name], rtol=1e-4, atol=1e-6)


def test_bad_inputs_give_clear_errors():
    train, queries = _data()
    sums = second_moment_sums(torch.from_numpy(train), _slices())
    q = torch.from_numpy(queries)
    with pytest.raises(AssayError, match="--mix"):
        build_whitening(sums, len(train), q, _slices(), 1.5)
    with pytest.raises(AssayError, match="--damping"):
        build_whitening(sums, len(train), q, _slices(), 0.5, -1.0)
    with pytest.raises(AssayError, match="count 0"):
        build_whitening(sums, 0, q, _slices())
    with pytest.raises(AssayError, match="module 'c'"):
        build_whitening({k: v for k, v in sums.items() if k != "c"}, len(train), q, _slices())
    with pytest.raises(AssayError, match="all zero"):
        build_whitening(sums, len(train), torch.zeros_like(q), _slices(), None)


@pytest.mark.parametrize("mix", [0.0, 0.2, 0.7])
def test_low_rank_norms_equal_direct_whitening(mix):
    """Woodbury: ‖W t‖² = base(t)/(1−λ) − sᵀK⁻¹s, even for a train row that duplicates a query."""
    train, queries = _data(4, q=3)
    train[7] = queries[1] * 1.0001  # the case where the subtraction cancels most
    t = torch.from_numpy(train).float()
    w = build_whitening(
        second_moment_sums(t, _slices()), len(train), torch.from_numpy(queries).float(), _slices(), mix
    )
    lr = w.lowrank
    assert lr is not None
    direct = w.sq_norms(t.double().float()).double()
    base = w.sq_norms(t, lr.base).double() * lr.base_scale
    for name, sl in _slices().items():
        if mix > 0:
            s = (t[:, sl] @ lr.factors[name]).double()
            base -= ((s @ lr.kinv[name]) * s).sum(1)
    np.testing.assert_allclose(base.numpy(), direct.numpy(), rtol=2e-4)
