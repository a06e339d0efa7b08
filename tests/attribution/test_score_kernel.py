"""Chunked, streamed scoring equals a brute-force numpy fp64 computation, every mode and aggregate."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from assay.attribution import kernel
from assay.attribution import rows as rows_module
from assay.attribution.kernel import (
    AGGREGATES,
    MODES,
    ArrayRows,
    TensorRows,
    base_sq_norms,
    half_gemm_is_exact_enough,
    plan_queries,
    row_norms,
    score_rows,
    screen_bounds,
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
@pytest.mark.parametrize("mode", [*MODES, "trackstar-lowrank", "cosine-given-norms"])
def test_chunked_equals_brute_force(data, mode, aggregate):
    train, queries, whitening = data
    base = norms = None
    if mode == "trackstar-lowrank":  # ‖W t‖ from cached base norms + Woodbury, not W t itself
        mode, base = "trackstar", base_sq_norms(TensorRows(torch.from_numpy(train)), whitening, 300)
    if mode == "cosine-given-norms":  # the index's norms.npy instead of each row's norm again
        mode, norms = "cosine", np.linalg.norm(train, axis=1)
    ref = _reference(train, queries, whitening, mode, aggregate)
    plan = plan_queries(torch.from_numpy(queries), mode, aggregate, whitening, base, norms)
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
    assert source.file_blocks(0, 10) is None  # fp16 rows are cast from the mapping, never copied first
    for mode in MODES:
        plan = plan_queries(torch.from_numpy(queries), mode, "none", whitening)
        want = np.zeros((4, 1000), np.float32)
        score_rows(TensorRows(torch.from_numpy(exact)), plan, scores_out=want, chunk_rows=128)
        for workers in (1, 3):
            got = np.zeros((4, 1000), np.float32)
            score_rows(source, plan, scores_out=got, chunk_rows=128, workers=workers)
            np.testing.assert_array_equal(got, want)  # same blocks, same arithmetic: bit-identical
    assert ArrayRows(mm[10:20])._file is None  # a slice keeps its parent's offset: not a file region
    assert ArrayRows(exact).file_blocks(0, 10) is None  # rows in memory are used where they are


@pytest.mark.parametrize("way", ["blocks", "mapped", "chosen"])
@pytest.mark.parametrize("mode", [*MODES, "trackstar-cached"])
def test_fp32_file_rows_score_alike_either_way(data, mode, way, tmp_path, monkeypatch):
    """An fp32 index file scores bit-identically to the same rows in memory on any worker count,
    read by blocks into a thread buffer (a short block last in each chunk), through the mapping,
    or as `FileReads` chooses after trying both (every chunk of 100 rows: 10 chunks)."""
    train, queries, whitening = data
    np.save(tmp_path / "g.npy", train)
    source = ArrayRows(np.load(tmp_path / "g.npy", mmap_mode="r"))
    monkeypatch.setattr(kernel, "BLOCK_BYTES", 16 * 4 * train.shape[1])  # 16-row blocks
    # 10 chunks: one worker tries both ways (a trial of 3 chunks), three read every chunk by blocks
    if way != "chosen":
        monkeypatch.setattr(rows_module.FileReads, "way", lambda self, chunk: way)
    reads, mapped = [], []
    windows = rows_module.FileWindows
    real_read, real_rows = windows.read_into, windows.rows
    monkeypatch.setattr(windows, "read_into", lambda s, out, a: reads.append(a) or real_read(s, out, a))
    monkeypatch.setattr(windows, "rows", lambda s, a, b, slot: mapped.append(a) or real_rows(s, a, b, slot))
    base = None
    if mode.endswith("cached"):
        base = base_sq_norms(TensorRows(torch.from_numpy(train)), whitening, 300)
    plan = plan_queries(torch.from_numpy(queries), mode.split("-")[0], "none", whitening, base)
    want = np.zeros((4, 1000), np.float32)
    score_rows(TensorRows(torch.from_numpy(train)), plan, scores_out=want, chunk_rows=100)
    for workers in (1, 3):
        got = np.zeros((4, 1000), np.float32)
        score_rows(source, plan, scores_out=got, chunk_rows=100, workers=workers)  # 6 × 16 + 4 per chunk
        np.testing.assert_array_equal(got, want)
    assert bool(reads) == (way != "mapped") and bool(mapped) == (way != "blocks")
    if way == "blocks":
        assert sorted(set(reads))[:8] == [0, 16 * 32, 32 * 32, 48 * 32, 64 * 32, 80 * 32, 96 * 32, 100 * 32]


def test_file_reads_try_each_way_then_keep_the_faster(tmp_path):
    np.save(tmp_path / "g.npy", np.zeros((4, 3), np.float32))
    source = ArrayRows(np.load(tmp_path / "g.npy", mmap_mode="r"))
    cpu = torch.device("cpu")
    assert rows_module.FileReads.of(ArrayRows(np.zeros((4, 3), np.float32)), cpu, 100) is None  # in memory
    reads = rows_module.FileReads.of(source, cpu, chunks=100, workers=2)
    assert reads is not None
    # a warm-up group (untimed), then a group of one chunk per worker each way
    assert [reads.way(c) for c in range(6)] == ["blocks"] * 4 + ["mapped"] * 2
    assert reads.way(6) == "blocks"  # no times yet: the default
    for chunk, seconds in enumerate([0.1, 0.1, 2.0, 1.8, 1.5, 1.4, 0.1]):  # 0, 1: warm-up; 6: after
        reads.record(chunk, reads.way(chunk) if chunk < 6 else "blocks", seconds, rows=1000)
    assert reads.way(6) == reads.way(99) == "mapped"
    reads.record(3, "blocks", 0.0, rows=0)  # an empty chunk counts for nothing
    assert reads.timed["blocks"] == [(2.0, 1000), (1.8, 1000)]
    few = rows_module.FileReads(source, chunks=11, workers=2)  # under twice the trial's 6 chunks
    assert {few.way(c) for c in range(11)} == {"blocks"}


def test_a_mapped_chunk_is_unmapped_when_released(tmp_path, monkeypatch):
    """`release` drops a slot's window at once (inside the chunk's time), not at the slot's next
    read; the other slots keep theirs; the kernel releases every chunk it read mapped."""
    np.save(tmp_path / "g.npy", np.arange(4096 * 8, dtype=np.float32).reshape(4096, 8))
    source = ArrayRows(np.load(tmp_path / "g.npy", mmap_mode="r"))
    assert source.read_raw(0, 1024, slot=0)[5, 1].item() == 41.0
    assert source.read_raw(1024, 2048, slot=1)[0, 0].item() == 1024 * 8
    windows = source._map.windows  # type: ignore[union-attr]
    assert set(windows) == {0, 1}
    source.release(0)
    assert set(windows) == {1}
    source.release(0)  # nothing left to drop
    assert source.read_raw(0, 4, slot=0)[1, 0].item() == 8.0  # the slot maps again
    monkeypatch.setattr(rows_module.FileReads, "way", lambda self, chunk: "mapped")
    plan = plan_queries(torch.ones(1, 8), "inner", "none", None)
    score_rows(source, plan, chunk_rows=256, workers=2)
    assert windows == {}


def test_a_truncated_fp32_file_is_a_clear_error_when_scored(data, tmp_path):
    train, queries, _ = data
    path = tmp_path / "g.npy"
    np.save(path, train)
    source = ArrayRows(np.load(path, mmap_mode="r"))
    os.truncate(path, os.path.getsize(path) - 32 * 4 * 10)  # the last 10 rows gone
    plan = plan_queries(torch.from_numpy(queries), "inner", "none")
    with pytest.raises(AssayError, match="shorter than its header says"):
        score_rows(source, plan, chunk_rows=128)


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


# --- fp16 screening: a half-precision GEMM picks the rows, the picked rows are scored exactly ---
needs_half_gemm = pytest.mark.skipif(
    not half_gemm_is_exact_enough(), reason="no fp16 GEMM with fp32 accumulation on this CPU"
)


def _hard_fp16_rows(rng, n=3000, dim=512):
    """fp16 rows with norms over six orders of magnitude, zero rows, near-ties and subnormals."""
    rows = rng.normal(size=(n, dim)) * np.exp(rng.uniform(-7, 2, size=(n, 1)))
    rows[::97] = 0.0
    rows[1::211] = rows[2::211][: len(rows[1::211])] * (1 + 1e-4)  # near-ties
    rows[3::301, : dim // 2] = 3e-6  # fp16 subnormals
    return rows.astype(np.float16)


def _queries(rng, dim=512):
    q = rng.normal(size=(5, dim)) * np.array([[1.0], [1e-3], [1e4], [1.0], [1.0]])
    q[3, ::3] *= 1e-7  # entries that are subnormal in fp16 after scaling to max 1
    return torch.from_numpy(q.astype(np.float32))


@needs_half_gemm
@pytest.mark.parametrize("mode", ["inner", "cosine"])  # influence screens like inner (other V)
def test_screen_error_bound_holds(mode):
    """Every approximate score lies within its bound of the fp64 score (Screen's docstring)."""
    rng = np.random.default_rng(1)
    queries = _queries(rng)
    rows = _hard_fp16_rows(rng)
    # rows whose terms all add up the queries' fp16 rounding errors: the bound's worst case
    v = queries / queries.abs().amax(1, keepdim=True)
    rounding = torch.sign(v.half().double() - v.double()) * v.abs()
    rows[: len(rounding)] = (rounding / rounding.abs().amax(1, keepdim=True)).numpy().astype(np.float16)
    norms = row_norms(TensorRows(torch.from_numpy(rows)))
    plan = plan_queries(queries, mode, "none", row_norms=norms)
    approx, err = screen_bounds(plan, torch.from_numpy(rows), 0)
    t, v = rows.astype(np.float64), plan.vectors.double().numpy()
    exact = v @ t.T
    if mode == "cosine":
        exact /= np.maximum(np.linalg.norm(t, axis=1), 1e-30)
    miss = np.abs(approx.double().numpy() - exact) - err.double().numpy()
    assert (miss <= 0).all(), f"bound exceeded by {miss.max():.3g}"
    a = [0, 3, 4]  # the adversarial rows come within a small factor of their bound
    assert (np.abs(approx.numpy()[a, a] - exact[a, a]) > 0.04 * err.numpy()[a, a]).all()
    assert (err.numpy() > 0).mean() > 0.9  # a bound of zero everywhere would make this vacuous


@needs_half_gemm
@pytest.mark.parametrize("aggregate", AGGREGATES)
@pytest.mark.parametrize("mode", ["inner", "cosine"])
def test_screened_top_k_equals_exact(mode, aggregate, tmp_path, monkeypatch):
    """Screened and exact scoring give the same top and bottom rows, from a file and from memory,
    while scoring exactly only a small share of the rows."""
    rng = np.random.default_rng(2)
    rows = _hard_fp16_rows(rng)
    queries = _queries(rng)
    np.save(tmp_path / "g.npy", rows)
    norms = row_norms(TensorRows(torch.from_numpy(rows)))
    exact_plan = plan_queries(queries, mode, aggregate)
    plan = plan_queries(queries, mode, aggregate, row_norms=norms)
    assert plan.screen is not None and exact_plan.screen is None
    want = score_rows(
        TensorRows(torch.from_numpy(rows.astype(np.float32))), exact_plan, top_k=6, chunk_rows=700
    )
    picked = _count_screened(monkeypatch)
    for source in (TensorRows(torch.from_numpy(rows)), ArrayRows(np.load(tmp_path / "g.npy", mmap_mode="r"))):
        got = score_rows(source, plan, top_k=6, chunk_rows=700)
        np.testing.assert_array_equal(got.top_rows.numpy(), want.top_rows.numpy())
        np.testing.assert_array_equal(got.bottom_rows.numpy(), want.bottom_rows.numpy())
        np.testing.assert_allclose(got.top_values.numpy(), want.top_values.numpy(), rtol=1e-6)
    assert 0 < sum(picked) < 0.25 * 2 * len(rows)  # the point: most rows never leave the fp16 GEMM


def _count_screened(monkeypatch) -> list[int]:
    """Rows scored exactly by each screened chunk, recorded as score_rows runs."""
    import assay.attribution.kernel as kernel

    picked: list[int] = []
    real = kernel.screened_chunk

    def counting(*args):
        scores, positions = real(*args)
        picked.append(len(positions))
        return scores, positions

    monkeypatch.setattr(kernel, "screened_chunk", counting)
    return picked


@needs_half_gemm
def test_screen_falls_back_when_fp16_overflows():
    rng = np.random.default_rng(3)
    rows = np.clip(rng.normal(size=(500, 256)) * 2e4, -6e4, 6e4).astype(np.float16)  # sums beyond 65504
    queries = torch.from_numpy(rng.normal(size=(2, 256)).astype(np.float32))
    norms = row_norms(TensorRows(torch.from_numpy(rows)))
    plan = plan_queries(queries, "inner", "none", row_norms=norms)
    assert screen_bounds(plan, torch.from_numpy(rows), 0) is None
    want = score_rows(
        TensorRows(torch.from_numpy(rows.astype(np.float32))), plan_queries(queries, "inner", "none")
    )
    got = score_rows(TensorRows(torch.from_numpy(rows)), plan)
    np.testing.assert_array_equal(got.top_rows.numpy(), want.top_rows.numpy())


def test_no_screen_where_it_does_not_apply(data, monkeypatch):
    """Trackstar, fp32 rows, saved scores and CPUs without an exact-enough fp16 GEMM take the
    exact path."""
    train, queries, whitening = data
    q = torch.from_numpy(queries)
    norms = row_norms(TensorRows(torch.from_numpy(train)))
    assert plan_queries(q, "trackstar", "none", whitening, row_norms=norms).screen is None
    picked = _count_screened(monkeypatch)
    plan = plan_queries(q, "inner", "none", row_norms=norms)
    score_rows(TensorRows(torch.from_numpy(train)), plan)  # fp32 rows
    half = TensorRows(torch.from_numpy(train.astype(np.float16)))
    score_rows(half, plan, scores_out=np.zeros((4, len(train)), np.float32))
    if plan.screen is not None:
        assert not picked
        score_rows(half, plan)
        assert picked  # the same fp16 rows without saved scores are screened
    import assay.attribution.kernel as kernel

    monkeypatch.setattr(kernel, "half_gemm_is_exact_enough", lambda: False)
    assert plan_queries(q, "inner", "none", row_norms=norms).screen is None


def test_file_windows_per_slot(tmp_path):
    """Each slot's window holds its rows until that slot is read again; other slots' stay."""
    data = np.random.default_rng(6).normal(size=(5000, 24)).astype(np.float16)
    np.save(tmp_path / "g.npy", data)
    source = ArrayRows(np.load(tmp_path / "g.npy", mmap_mode="r"))
    first = source.read_raw(0, 1000, slot=0)
    second = source.read_raw(1000, 3000, slot=1)
    again = source.read_raw(3000, 5000, slot=0)  # slot 0's earlier window is unmapped
    np.testing.assert_array_equal(second.numpy(), data[1000:3000])
    np.testing.assert_array_equal(again.numpy(), data[3000:5000])
    np.testing.assert_array_equal(first.numpy(), data[:1000])  # still the file's rows, paged back in
    assert source.read_raw(10, 10).shape == (0, 24)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_stacked_blocks_and_a_short_last_block(data, dtype, monkeypatch):
    """Cached-norm TrackStar on many small blocks per chunk (a short one last, fp16 rows cast
    through the scratch buffer) equals the brute force on the same stored rows."""
    train, queries, whitening = data
    if whitening.slices != EVEN_SLICES:
        pytest.skip("the stacked path needs equal-width modules")
    monkeypatch.setattr(kernel, "BLOCK_BYTES", 16 * 4 * train.shape[1])  # 16-row blocks
    stored = train.astype(dtype)
    base = base_sq_norms(TensorRows(torch.from_numpy(stored)), whitening, 300)
    plan = plan_queries(torch.from_numpy(queries), "trackstar", "none", whitening, base)
    assert plan.stacked is not None
    out = np.zeros((len(queries), len(train)), dtype=np.float32)
    score_rows(TensorRows(torch.from_numpy(stored)), plan, scores_out=out, chunk_rows=97)  # 6 × 16 + 1
    ref = _reference(stored.astype(np.float32), queries, whitening, "trackstar", "none")
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-5 * np.abs(ref).max())
