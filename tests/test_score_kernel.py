"""Chunked, streamed scoring equals a brute-force numpy fp64 computation, every mode and aggregate."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from assay.attribution.kernel import (
    AGGREGATES,
    MODES,
    ArrayRows,
    TensorRows,
    base_sq_norms,
    plan_queries,
    score_rows,
)
from assay.attribution.precondition import build_whitening, second_moment_sums
from assay.core.errors import AssayError

SLICES = {"m0": slice(0, 8), "m1": slice(8, 24), "m2": slice(24, 32)}
EVEN_SLICES = {f"m{i}": slice(8 * i, 8 * i + 8) for i in range(4)}  # the batched (bmm) path


@pytest.fixture(scope="module", params=["uneven", "even"])
def data(request):
    rng = np.random.default_rng(0)
    train = (rng.normal(size=(1000, 32)) @ rng.normal(size=(32, 32))).astype(np.float32)
    train[17] = 0.0  # an all-zero gradient must score 0, not NaN
    queries = (rng.normal(size=(4, 32)) @ rng.normal(size=(32, 32))).astype(np.float32)
    train[500] = queries[2] * 1.001  # a near-copy of a query: the low-rank norms nearly cancel here
    slices = EVEN_SLICES if request.param == "even" else SLICES
    sums = second_moment_sums(torch.from_numpy(train), slices)
    whitening = build_whitening(sums, len(train), torch.from_numpy(queries), slices, None, 0.1)
    return train, queries, whitening


def _unit(x):
    n = np.linalg.norm(x, axis=1, keepdims=True)
    return x / np.where(n > 0, n, 1.0)


def _reference(train, queries, whitening, mode, aggregate):
    """Brute force in fp64: transform both sides explicitly, full matrix, then aggregate."""
    t, q = train.astype(np.float64), queries.astype(np.float64)

    def white(x):
        out = x.copy()
        for name, sl in whitening.slices.items():
            out[:, sl] = x[:, sl] @ whitening.matrices[name].double().numpy()
        return out

    if mode == "trackstar":
        scores = _unit(white(q)) @ _unit(white(t)).T
    elif mode == "influence":
        scores = white(q) @ white(t).T
    elif mode == "cosine":
        scores = _unit(q) @ _unit(t).T
    else:
        scores = q @ t.T
    if aggregate == "mean":
        return scores.mean(0, keepdims=True)
    if aggregate == "max":
        return scores.max(0, keepdims=True)
    return scores


@pytest.mark.parametrize("aggregate", AGGREGATES)
@pytest.mark.parametrize("mode", [*MODES, "trackstar-lowrank"])
def test_chunked_equals_brute_force(data, mode, aggregate):
    train, queries, whitening = data
    base = None
    if mode == "trackstar-lowrank":  # ‖W t‖ from cached base norms + Woodbury, not W t itself
        mode, base = "trackstar", base_sq_norms(TensorRows(torch.from_numpy(train)), whitening, 300)
    ref = _reference(train, queries, whitening, mode, aggregate)
    plan = plan_queries(torch.from_numpy(queries), mode, aggregate, whitening, base)
    assert plan.row_norm == ("lowrank" if base is not None else plan.row_norm)
    even = whitening.slices == EVEN_SLICES
    assert (plan.stacked is not None) == (base is not None and even)  # both lowrank paths are checked
    out = np.zeros(ref.shape, dtype=np.float32)
    top = score_rows(TensorRows(torch.from_numpy(train)), plan, top_k=7, scores_out=out, chunk_rows=97)
    scale = np.abs(ref).max()
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-5 * scale)
    assert out[:, 17].tolist() == [0.0] * len(out)
    order = np.argsort(-ref, axis=1, kind="stable")
    np.testing.assert_array_equal(top.top_rows.numpy(), order[:, :7])
    np.testing.assert_array_equal(top.bottom_rows.numpy(), order[:, ::-1][:, :7])
    np.testing.assert_allclose(top.top_values.numpy(), np.take_along_axis(ref, order[:, :7], 1), rtol=1e-4)


@pytest.mark.parametrize("chunk_rows", [1, 64, 1000, 5000])
def test_result_does_not_depend_on_chunking(data, chunk_rows):
    train, queries, whitening = data
    plan = plan_queries(torch.from_numpy(queries), "trackstar", "none", whitening)
    base = np.zeros((4, 1000), np.float32)
    score_rows(TensorRows(torch.from_numpy(train)), plan, scores_out=base, chunk_rows=333)
    out = np.zeros((4, 1000), np.float32)
    top = score_rows(
        TensorRows(torch.from_numpy(train)), plan, top_k=3, scores_out=out, chunk_rows=chunk_rows
    )
    np.testing.assert_allclose(out, base, rtol=1e-5, atol=1e-7)
    assert top.top_rows.shape == (4, 3)


def test_memmap_file_rows_fp16(data, tmp_path):
    """Rows read from a .npy fp16 file score like the same values in memory, on any worker count."""
    train, queries, whitening = data
    stored = train.astype(np.float16)
    np.save(tmp_path / "g.npy", stored)
    mm = np.load(tmp_path / "g.npy", mmap_mode="r")
    source = ArrayRows(mm)
    assert source._file is not None  # read through the file, not the mapping
    exact = stored.astype(np.float32)
    np.testing.assert_array_equal(source.read(100, 230).numpy(), exact[100:230])
    assert source.read_raw(100, 230).dtype == torch.float16  # cast later, a cache-sized block at a time
    for mode in MODES:
        plan = plan_queries(torch.from_numpy(queries), mode, "none", whitening)
        want = np.zeros((4, 1000), np.float32)
        score_rows(TensorRows(torch.from_numpy(exact)), plan, scores_out=want, chunk_rows=128)
        for workers in (1, 3):
            got = np.zeros((4, 1000), np.float32)
            score_rows(source, plan, scores_out=got, chunk_rows=128, workers=workers)
            np.testing.assert_array_equal(got, want)  # same blocks, same arithmetic: bit-identical
    assert ArrayRows(mm[10:20])._file is None  # a slice keeps its parent's offset: not a file region


def test_errors_are_clear(data):
    train, queries, whitening = data
    source = TensorRows(torch.from_numpy(train))
    with pytest.raises(AssayError, match="empty"):
        plan_queries(torch.zeros(0, 32), "inner", "none")
    with pytest.raises(AssayError, match="preconditioner"):
        plan_queries(torch.from_numpy(queries), "trackstar", "none", None)
    plan = plan_queries(torch.from_numpy(queries[:, :16]), "inner", "none")
    with pytest.raises(AssayError, match="same modules and projection"):
        score_rows(source, plan)
    with pytest.raises(AssayError, match="--mode"):
        plan_queries(torch.from_numpy(queries), "bogus", "none")


def test_truncated_index_file_is_a_clear_error(tmp_path):
    path = tmp_path / "g.npy"
    np.save(path, np.ones((300, 8), np.float32))
    source = ArrayRows(np.load(path, mmap_mode="r"))
    os.truncate(path, os.path.getsize(path) - 8 * 4 * 10)  # the last 10 rows gone
    assert source.read(0, 100).shape == (100, 8)
    with pytest.raises(AssayError, match="shorter than its header says"):
        source.read(250, 300)
