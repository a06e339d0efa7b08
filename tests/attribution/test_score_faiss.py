"""Optional FAISS search (`--search faiss`): exhaustive probing reproduces the exact top-k."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from assay.attribution.kernel import ArrayRows, plan_queries, score_rows
from assay.attribution.precondition import build_whitening, second_moment_sums

faiss = pytest.importorskip("faiss")

from assay.attribution.ann import load_or_build_ann, search_ann  # noqa: E402

SLICES = {f"m{i}": slice(16 * i, 16 * (i + 1)) for i in range(4)}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    rng = np.random.default_rng(0)
    train = (rng.normal(size=(3000, 64)) @ rng.normal(size=(64, 64))).astype(np.float16)
    path = tmp_path_factory.mktemp("faiss") / "gradients.npy"
    np.save(path, train)
    queries = torch.from_numpy(
        train[[5, 50, 500]].astype(np.float32) + 0.1 * rng.normal(size=(3, 64)).astype(np.float32)
    )
    sums = second_moment_sums(torch.from_numpy(train.astype(np.float32)), SLICES)
    whitening = build_whitening(sums, len(train), queries, SLICES, 0.0, 0.1)
    return ArrayRows(np.load(path, mmap_mode="r")), queries, whitening, path.parent


@pytest.mark.parametrize("aggregate", ["none", "mean", "max"])
@pytest.mark.parametrize("mode", ["trackstar", "cosine"])
def test_exhaustive_probe_equals_exact(data, mode, aggregate):
    source, queries, whitening, folder = data
    white = whitening if mode == "trackstar" else None
    ann = load_or_build_ann(source, mode, white, folder / f"{mode}.faiss", 16, 500)
    got = search_ann(ann, source, queries, mode, white, aggregate, 10, probe=16)
    exact = score_rows(source, plan_queries(queries, mode, aggregate, white), top_k=10)
    np.testing.assert_array_equal(got.top_rows.numpy(), exact.top_rows.numpy())
    np.testing.assert_allclose(got.top_values.numpy(), exact.top_values.numpy(), rtol=1e-4, atol=1e-5)
    if aggregate != "max":  # bottom-k by max is approximate by design
        np.testing.assert_array_equal(got.bottom_rows.numpy(), exact.bottom_rows.numpy())
    assert [5, 50, 500][: len(got.top_rows)] == got.top_rows[:, 0].tolist() or aggregate != "none"
    reopened = load_or_build_ann(source, mode, white, folder / f"{mode}.faiss", 16, 500)
    assert reopened.ntotal == 3000  # cached: read back, not rebuilt
