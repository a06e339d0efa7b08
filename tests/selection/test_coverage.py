"""Coverage-seeking selection (facility location / CRAIG, k-center, cluster-balanced, de-duplication).

Every algorithm is checked against an independent reference: a plain (non-lazy) greedy, brute-force
farthest-first traversal and nearest-centre assignment in float64, an exhaustive k-center optimum
on tiny inputs, brute-force nearest neighbours, and exact-fraction largest-remainder quotas. The
regression case at the end is the reason these strategies exist: from clusters of 900, 80 and 20
rows, the top 10% by similarity to the mean is all from the big cluster, while each coverage
strategy picks from all three.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import replace
from fractions import Fraction

import numpy as np
import pytest
import torch

from assay.core.errors import AssayError
from assay.selection.coverage import (
    BalancedOptions,
    DedupOptions,
    FacilityOptions,
    KCenterOptions,
    TypiclustOptions,
    allocate,
    balanced,
    deduplicate,
    facility_location,
    k_center,
    select,
    typicality,
    typiclust,
)
from assay.selection.facility import similarity_matrix
from assay.selection.similarity import IvfOptions, Rows, _homes, exact_knn, ivf_knn


def clustered(sizes: list[int], dim: int = 32, spread: float = 0.6, seed: int = 0) -> np.ndarray:
    """Rows [sum(sizes), dim] fp32 around one random centre per cluster, cluster by cluster."""
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((len(sizes), dim))
    rows = [centres[c] + spread * rng.standard_normal((n, dim)) for c, n in enumerate(sizes)]
    return np.concatenate(rows).astype(np.float32)


def labels_of(sizes: list[int]) -> np.ndarray:
    return np.repeat(np.arange(len(sizes)), sizes)


def unit64(x: np.ndarray) -> np.ndarray:
    y = x.astype(np.float64)
    return y / np.linalg.norm(y, axis=1, keepdims=True)


def exact_objective(x: np.ndarray, picks: np.ndarray) -> float:
    """F(S) = sum_i max_{j in S} (1 + cos_ij) / 2, in float64 from scratch."""
    u = unit64(x)
    return float(((1 + u @ u[picks].T) / 2).max(axis=1).sum())


# ---------------------------------------------------------------------------------------------
# facility location


def naive_greedy(s: np.ndarray, k: int) -> tuple[list[int], list[float]]:
    """Plain greedy: every gain recomputed every round, the first maximum taken."""
    s64 = s.astype(np.float64)
    cur = np.zeros(len(s))
    picks: list[int] = []
    gains: list[float] = []
    for _ in range(k):
        g = np.maximum(s64 - cur[None, :], 0).sum(axis=1)  # row j = gain of j (s is symmetric)
        g[picks] = -np.inf
        j = int(np.argmax(g))
        picks.append(j)
        gains.append(float(g[j]))
        cur = np.maximum(cur, s64[j])
    return picks, gains


@pytest.mark.parametrize("metric", ["cosine", "euclidean"])
def test_lazy_greedy_equals_plain_greedy_bit_for_bit(metric):
    x = clustered([150, 100, 50], dim=16)
    sel = facility_location(x, 40, options=FacilityOptions(metric=metric, method="exact"))
    picks, gains = naive_greedy(similarity_matrix(Rows(x, metric)), 40)
    assert sel.positions.tolist() == picks
    assert sel.details["gains"].tolist() == gains  # equal floats, not approximately
    assert sel.details["evaluations"] < 300 * 40 / 4  # laziness saved most gain evaluations


@pytest.mark.parametrize("metric", ["cosine", "euclidean"])
def test_similarity_matrix_and_craig_weights_against_float64(metric):
    x = clustered([60, 40], dim=8, seed=1)
    s = similarity_matrix(Rows(x, metric))
    y = unit64(x) if metric == "cosine" else x.astype(np.float64)
    d = np.sqrt(((y[:, None] - y[None]) ** 2).sum(-1))
    ref = (1 + y @ y.T) / 2 if metric == "cosine" else d.max() - d
    np.testing.assert_allclose(s, ref, atol=2e-5)
    sel = facility_location(x, 12, options=FacilityOptions(metric=metric))
    nearest = ref[:, sel.positions].argmax(axis=1)  # each row's most similar chosen row
    assert sel.weights.tolist() == np.bincount(nearest, minlength=12).tolist()
    assert sel.weights.sum() == len(x)
    assert sel.details["objective"] == pytest.approx(ref[:, sel.positions].max(axis=1).sum(), rel=1e-6)
    dist = 2 - 2 * ref if metric == "cosine" else d.max() - ref  # 1 - cos, or the distance
    expected = dist[np.arange(len(x)), sel.positions[nearest]].mean()
    assert sel.details["mean_distance"] == pytest.approx(expected, rel=1e-5)


def test_sparse_graph_with_every_neighbour_is_the_exact_greedy():
    """With K + 1 = N the clamp at the (K+1)-th similarity changes nothing: same picks."""
    x = clustered([80, 50, 30], dim=12, seed=2)
    exact = facility_location(x, 25, options=FacilityOptions(method="exact"))
    opts = FacilityOptions(method="sparse", knn="exact", neighbours=len(x) - 1, chunk_rows=37)
    sparse = facility_location(x, 25, options=opts)
    assert sparse.positions.tolist() == exact.positions.tolist()
    assert sparse.weights.tolist() == exact.weights.tolist()
    assert sparse.details["rows_outside_graph"] == 0


@pytest.mark.parametrize("knn", ["exact", "ivf"])
def test_sparse_greedy_objective_close_to_exact_greedy(knn):
    sizes = [300, 200, 120, 80, 60, 40]
    x = clustered(sizes, dim=24, spread=0.9, seed=3)
    k = 50
    exact = facility_location(x, k, options=FacilityOptions(method="exact"))
    ivf = IvfOptions(lists=24, probe=4)
    opts = FacilityOptions(method="sparse", knn=knn, neighbours=16, ivf=ivf)
    sparse = facility_location(x, k, options=opts)
    f_exact, f_sparse = exact_objective(x, exact.positions), exact_objective(x, sparse.positions)
    rand = np.random.default_rng(0).choice(len(x), k, replace=False)
    f_rand = exact_objective(x, rand)
    assert f_exact == pytest.approx(exact.details["objective"], rel=1e-6)
    assert f_sparse >= 0.95 * f_exact
    # the constant part of F makes any selection score high: compare the gains over random too
    assert f_sparse - f_rand >= 0.9 * (f_exact - f_rand) > 0
    # weights: every row counted once, at its most similar chosen row (exact search here)
    if knn == "exact":
        nearest = (unit64(x) @ unit64(x)[sparse.positions].T).argmax(axis=1)
        assert sparse.weights.tolist() == np.bincount(nearest, minlength=k).tolist()
    assert sparse.weights.sum() == len(x)
    if knn == "exact":
        assert sparse.details["objective"] == pytest.approx(f_sparse, rel=1e-5)
    else:  # a row's closest chosen row can be one the approximate search missed: a lower bound
        assert 0.99 * f_sparse <= sparse.details["objective"] <= f_sparse * (1 + 1e-6)
        again = facility_location(x, k, options=replace(opts, chunk_rows=50))  # seeded, chunk-free
        assert again.positions.tolist() == sparse.positions.tolist()


# ---------------------------------------------------------------------------------------------
# nearest neighbours


@pytest.mark.parametrize("metric", ["cosine", "euclidean"])
def test_exact_knn_matches_brute_force(metric):
    x = clustered([40, 30], dim=6, seed=4)
    knn = exact_knn(Rows(x, metric, chunk_rows=16), 5)
    y = unit64(x) if metric == "cosine" else x.astype(np.float64)
    close = y @ y.T if metric == "cosine" else -((y[:, None] - y[None]) ** 2).sum(-1)
    np.fill_diagonal(close, np.inf)
    ref = np.argsort(-close, axis=1, kind="stable")[:, :5]
    assert (knn.neighbours[:, 0] == np.arange(len(x))).all()
    assert knn.neighbours.tolist() == ref.tolist()
    np.fill_diagonal(close, 1.0 if metric == "cosine" else 0.0)
    np.testing.assert_allclose(knn.closeness, np.take_along_axis(close, ref, 1), atol=1e-4)


def test_ivf_knn_recall_and_exhaustive_probe():
    x = clustered([200, 150, 100, 50], dim=16, seed=5)
    rows = Rows(x, "cosine", chunk_rows=64)
    exact = exact_knn(rows, 9)
    full = ivf_knn(rows, 9, IvfOptions(lists=10, probe=10), seed=0)  # every list: exact
    assert [set(r) for r in full.neighbours] == [set(r) for r in exact.neighbours]
    approx = ivf_knn(rows, 9, IvfOptions(lists=20, probe=3), seed=0)
    recall = np.mean([len(set(a) & set(b)) / 9 for a, b in zip(approx.neighbours, exact.neighbours)])
    assert 0.8 <= recall < 1.0  # approximate, and still finds most neighbours
    assert (approx.neighbours[:, 0] == np.arange(len(x))).all()


def test_ivf_lists_respect_their_capacity():
    rng = np.random.default_rng(12)
    prefer0 = [np.concatenate([[0], 1 + rng.permutation(5)[:2]]) for _ in range(150)]  # most rows
    probes = np.stack(prefer0 + [rng.permutation(6)[:3] for _ in range(50)])  # [N, P] distinct lists
    scores = np.sort(rng.random((200, 3)), axis=1)[:, ::-1]  # closest first
    home = _homes(probes, scores.copy(), capacity=50)
    assert all(h in p for h, p in zip(home, probes))  # every row searches its own list
    assert np.bincount(home, minlength=6).max() <= 50
    first = np.flatnonzero(probes[:, 0] == 0)  # list 0 takes its 50 closest askers
    assert set(np.flatnonzero(home == 0)) == set(first[np.argsort(-scores[first, 0], kind="stable")[:50]])
    # rows refused by every list they probe go to their nearest
    assert _homes(np.zeros((20, 1), dtype=np.int64), np.ones((20, 1)), capacity=5).tolist() == [0] * 20


# ---------------------------------------------------------------------------------------------
# k-center


def brute_kcenter(x: np.ndarray, k: int, first: int, metric: str) -> tuple[list[int], np.ndarray]:
    """Farthest-first traversal in float64, one full pass per centre, and each row's nearest centre."""
    y = unit64(x) if metric == "cosine" else x.astype(np.float64)
    d2 = ((y[:, None] - y[None]) ** 2).sum(-1)
    picks = [first]
    for _ in range(k - 1):
        mind = d2[:, picks].min(axis=1)
        mind[picks] = -1
        picks.append(int(np.argmax(mind)))
    return picks, d2[:, picks].argmin(axis=1)


@pytest.mark.parametrize("metric", ["cosine", "euclidean"])
@pytest.mark.parametrize(("batch", "candidates", "chunk"), [(1, 1, 4096), (7, 16, 33), (512, 2048, 100)])
def test_kcenter_equals_brute_force_farthest_first(metric, batch, candidates, chunk):
    x = clustered([150, 100, 60, 30, 10], dim=10, seed=6)
    opts = KCenterOptions(metric=metric, batch=batch, candidates=candidates, chunk_rows=chunk)
    sel = k_center(x, 60, seed=3, options=opts)
    ref, nearest = brute_kcenter(x, 60, sel.details["first"], metric)
    assert sel.positions.tolist() == ref
    assert sel.weights.tolist() == np.bincount(nearest, minlength=60).tolist()
    assert sel.details["first"] == int(np.random.default_rng(3).integers(len(x)))


@pytest.mark.parametrize("metric", ["cosine", "euclidean"])
def test_kcenter_radius_within_twice_the_optimum(metric):
    for seed in range(5):
        x = np.random.default_rng(seed).standard_normal((10, 3)).astype(np.float32)
        y = unit64(x) if metric == "cosine" else x.astype(np.float64)
        d = np.sqrt(((y[:, None] - y[None]) ** 2).sum(-1))
        for k in (2, 3):
            opt = min(d[:, list(s)].min(axis=1).max() for s in itertools.combinations(range(10), k))
            sel = k_center(x, k, seed=seed, options=KCenterOptions(metric=metric))
            radius = d[:, sel.positions].min(axis=1).max()
            assert sel.details["radius"] == pytest.approx(radius, abs=1e-5)
            assert opt - 1e-9 <= radius <= 2 * opt + 1e-6


# ---------------------------------------------------------------------------------------------
# cluster-balanced


def reference_quotas(sizes: list[int], k: int) -> list[int]:
    """Hamilton's largest-remainder apportionment with exact fractions (lowest index on ties)."""
    ideal = [Fraction(k * s, sum(sizes)) for s in sizes]
    q = [int(f) for f in ideal]
    by_remainder = sorted(range(len(sizes)), key=lambda c: (-(ideal[c] - q[c]), c))
    for c in by_remainder[: k - sum(q)]:
        q[c] += 1
    return q


def test_allocate_is_largest_remainder_apportionment():
    rng = np.random.default_rng(7)
    for _ in range(200):
        sizes = rng.integers(0, 50, rng.integers(1, 9)).tolist()
        if sum(sizes) == 0:
            continue
        k = int(rng.integers(1, sum(sizes) + 1))
        assert allocate(np.array(sizes), k).tolist() == reference_quotas(sizes, k)
        q = allocate(np.array(sizes), k, minimum=1)
        assert q.sum() == k and (q <= np.array(sizes)).all()
        if sum(min(s, 1) for s in sizes) <= k:
            assert (q >= np.minimum(sizes, 1)).all()
    assert allocate(np.array([900, 80, 20]), 100).tolist() == [90, 8, 2]
    assert allocate(np.array([990, 7, 3]), 10, minimum=1).tolist() == [8, 1, 1]


def test_balanced_takes_top_scores_per_cluster_in_proportion():
    sizes = [300, 120, 60, 20]
    x = clustered(sizes, dim=16, seed=8)
    scores = np.random.default_rng(1).standard_normal(len(x))
    opts = BalancedOptions(clusters=4, min_per_cluster=0, chunk_rows=50)
    sel = balanced(x, 50, scores=scores, seed=2, options=opts)
    labels = sel.details["labels"]
    assert len(set(sel.positions.tolist())) == 50
    counts = np.bincount(labels[sel.positions], minlength=4)
    assert counts.tolist() == reference_quotas(np.bincount(labels, minlength=4).tolist(), 50)
    assert sorted(np.bincount(labels).tolist()) == sorted(sizes)  # k-means found the true clusters
    for c in range(4):  # within each cluster: exactly its best scores
        members = np.flatnonzero(labels == c)
        best = members[np.argsort(-scores[members], kind="stable")[: counts[c]]]
        assert set(sel.positions[labels[sel.positions] == c].tolist()) == set(best.tolist())
    again = balanced(x, 50, scores=scores, seed=2, options=BalancedOptions(clusters=4, min_per_cluster=0))
    assert again.positions.tolist() == sel.positions.tolist()  # seeded, chunking does not matter
    rand = [balanced(x, 50, seed=s, options=opts).positions.tolist() for s in (5, 5, 6)]
    assert rand[0] == rand[1] != rand[2]


# ---------------------------------------------------------------------------------------------
# TypiClust


def test_typicality_is_the_mean_cosine_to_the_nearest_neighbours():
    x = np.random.default_rng(3).standard_normal((80, 8)).astype(np.float32)
    got = typicality(Rows(x, "cosine", 16), TypiclustOptions(neighbours=5), seed=0)
    u = unit64(x)
    sims = u @ u.T
    np.fill_diagonal(sims, -np.inf)  # the row itself is not its own neighbour
    want = np.sort(sims, axis=1)[:, -5:].mean(axis=1)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    approx = typicality(Rows(x, "cosine", 16), TypiclustOptions(neighbours=5, knn="ivf"), seed=0)
    assert np.corrcoef(approx, want)[0, 1] > 0.9  # the approximate search finds most neighbours


def test_typiclust_takes_the_densest_row_of_each_cluster():
    sizes = [40, 30, 20, 10]
    x = clustered(sizes, dim=16, seed=4)
    sel = typiclust(x, 4, seed=1, options=TypiclustOptions(neighbours=5, chunk_rows=32))
    labels, typical = sel.details["labels"], sel.details["typicality"]
    assert sorted(np.bincount(labels).tolist()) == sorted(sizes)  # k-means (k = 4) found the clusters
    assert sorted(labels[sel.positions].tolist()) == [0, 1, 2, 3]  # one from each
    for pos in sel.positions:
        members = np.flatnonzero(labels == labels[pos])
        assert typical[pos] == typical[members].max()  # and it is that cluster's densest
    assert typiclust(x, 4, seed=1, options=TypiclustOptions(neighbours=5)).positions.tolist() == (
        sel.positions.tolist()
    )  # seeded; chunking does not matter
    more = typiclust(x, 12, seed=1, options=TypiclustOptions(neighbours=5, max_clusters=4))
    assert len(set(more.positions.tolist())) == 12 and more.details["clusters"] == 4  # capped: by size


# ---------------------------------------------------------------------------------------------
# de-duplication


def test_deduplicate_matches_brute_force():
    rng = np.random.default_rng(9)
    base = rng.standard_normal((60, 16)).astype(np.float32)
    copies = base[rng.integers(0, 60, 40)] + 0.01 * rng.standard_normal((40, 16)).astype(np.float32)
    x = np.concatenate([base, copies])
    scores = rng.standard_normal(100)
    sel = deduplicate(x, scores=scores, options=DedupOptions(threshold=0.95, neighbours=99))
    u = unit64(x)
    kept: list[int] = []
    for i in np.argsort(-scores, kind="stable"):  # keep unless a kept row is a near-duplicate
        if not kept or (u[kept] @ u[i]).max() < 0.95:
            kept.append(int(i))
    assert sel.positions.tolist() == kept
    assert len(kept) == 60 and sel.weights.sum() == 100


# ---------------------------------------------------------------------------------------------
# inputs, dtypes, registry


def test_input_checks_raise_assay_error():
    x = clustered([20], dim=4)
    with pytest.raises(AssayError, match="k=21 of 20"):
        facility_location(x, 21)
    with pytest.raises(AssayError, match="k=0"):
        k_center(x, 0)
    with pytest.raises(AssayError, match="no features"):
        balanced(np.zeros((0, 4), np.float32), 1)
    bad = x.copy()
    bad[17, 2] = np.inf
    for fn in (facility_location, k_center, balanced):
        with pytest.raises(AssayError, match="row 17 "):
            fn(bad, 5)
    with pytest.raises(AssayError, match="one value per row"):
        balanced(x, 5, scores=np.zeros(19))
    with pytest.raises(AssayError, match="score of row 3"):
        balanced(x, 5, scores=np.where(np.arange(20) == 3, np.nan, 0.0))
    with pytest.raises(AssayError, match="unknown selection strategy"):
        select("typical", x, 5)
    with pytest.raises(AssayError, match="takes KCenterOptions"):
        select("kcenter", x, 5, options=FacilityOptions())


def test_fp16_memmap_tensor_and_registry_agree(tmp_path):
    x16 = clustered([100, 40, 10], dim=24, seed=10).astype(np.float16)
    mm = np.lib.format.open_memmap(tmp_path / "rows.npy", mode="w+", dtype=np.float16, shape=x16.shape)
    mm[:] = x16
    mm.flush()
    ro = np.load(tmp_path / "rows.npy", mmap_mode="r")
    exact32 = x16.astype(np.float32)  # fp16 values are exact in fp32: every form reads the same numbers
    for name in ("facility", "kcenter", "balanced"):
        ref = select(name, exact32, 15, seed=1)
        for form in (ro, torch.from_numpy(x16.copy())):
            got = select(name, form, 15, seed=1)
            assert got.positions.tolist() == ref.positions.tolist()
    direct = k_center(exact32, 15, seed=1)
    assert select("kcenter", exact32, 15, seed=1).positions.tolist() == direct.positions.tolist()


# ---------------------------------------------------------------------------------------------
# the regression case: coverage must beat typicality


def test_coverage_beats_typicality_on_unequal_clusters():
    sizes = [900, 80, 20]
    x = clustered(sizes, dim=32, spread=0.5, seed=11)
    truth = labels_of(sizes)
    k = 100
    u = unit64(x)
    typical = np.argsort(-(u @ u.mean(axis=0)), kind="stable")[:k]  # top-k by similarity to the mean
    assert np.bincount(truth[typical], minlength=3)[0] >= 98
    sparse = FacilityOptions(method="sparse", knn="ivf")
    picked = {
        "facility": facility_location(x, k),
        "facility-ivf": facility_location(x, k, options=sparse),
        "kcenter": k_center(x, k),
        "balanced": balanced(x, k),
    }
    for name, sel in picked.items():
        pos = sel.positions
        if sel.weights is not None:  # each cluster's rows are represented by picks from it
            assert np.bincount(truth[pos], weights=sel.weights, minlength=3).tolist() == sizes, name
        per_cluster = np.bincount(truth[pos], minlength=3)
        assert (per_cluster >= 1).all(), (name, per_cluster)
        # and every row is nearer a pick than under the typicality ranking (k-center's radius)
        worst = (1 - u @ u[pos].T).min(axis=1).max()
        assert worst < (1 - u @ u[typical].T).min(axis=1).max() / 2, name


def test_collection_shares_list_each_table_row_once(tmp_path):
    """The selections made only for the bf16/fp32 overlap (e.g. gradcos_bf16 beside gradcos) get
    an overlap figure but no line of their own in the collection table."""
    from types import SimpleNamespace

    from assay.selection.tables import selection_facts

    pool = tmp_path / "pool.jsonl"
    pool.write_text("".join(json.dumps({"text": "x", "collection": c}) + "\n" for c in "aabbbb"))
    picks = {"random": [0, 2], "gradcos": [0, 1], "gradcos_bf16": [0, 1], "gradcos_fp32": [0, 3]}
    for name, ids in picks.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "selection.jsonl").write_text("".join(json.dumps({"id": i}) + "\n" for i in ids))
    lay = SimpleNamespace(selection=lambda row, seed: tmp_path / row, data=SimpleNamespace(dataset=str(pool)))
    facts = selection_facts(
        SimpleNamespace(seeds=[0]), lay, ["random", "gradcos"], agreement=("gradcos_bf16", "gradcos_fp32")
    )
    assert list(facts["collection_share"]) == ["random", "gradcos", "pool"]
    assert facts["collection_share"]["gradcos"] == {"a": 1.0, "b": 0.0}
    assert facts["overlap_bf16_fp32"] == {"gradcos": 0.5}
