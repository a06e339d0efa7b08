"""Coverage-seeking coreset selection on feature rows (projected per-example gradients).

Ranking examples by a score alone (similarity to the mean gradient, loss, TrackStar self-influence)
picks the most *typical* ones: a 10% selection fills up with the dominant cluster and leaves
small ones out. These strategies spread the selection over the whole pool instead:

- `facility_location` (name "facility"): greedy facility location / CRAIG, every row represented
  by a similar chosen row; weights = the rows each chosen row represents (facility.py).
- `k_center` ("kcenter"): farthest-first traversal (Gonzalez 1985): each pick is the row farthest
  from all picks so far, which keeps the largest distance of any row to its nearest pick within
  twice the best possible (a 2-approximation of k-center).
- `balanced` ("balanced"): k-means clusters, then the top-scoring rows of each cluster in
  proportion to its size (stratified selection; random within clusters without scores).
- `typiclust` ("typiclust"): TypiClust (Hacohen et al. 2022): as many k-means clusters as rows to
  keep, and from each the most *typical* row (the densest: highest mean closeness to its nearest
  neighbours). Typical within a cluster, and every cluster covered.
- `deduplicate`: SemDeDup-style removal of near-duplicates (cosine >= a threshold).

Every strategy has the same shape, `(X, k, scores=None, seed=0, options=None) -> Selection`, so a
command can look one up by name in STRATEGIES (options classes in OPTIONS). X is a numpy array,
np.memmap or torch tensor [N, D] in any float dtype; it is read in fp32 blocks (similarity.py),
never as a whole, and never as an N x N matrix (except facility's exact method for small N).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from assay.core.errors import AssayError
from assay.selection.facility import FacilityOptions, facility_location
from assay.selection.similarity import (
    IvfOptions,
    Knn,
    Metric,
    Rows,
    Selection,
    check_scores,
    exact_knn,
    ivf_knn,
    kmeans,
    nearest_centroids,
    open_rows,
    sq_dists,
)

__all__ = [
    "OPTIONS",
    "STRATEGIES",
    "BalancedOptions",
    "DedupOptions",
    "FacilityOptions",
    "KCenterOptions",
    "Selection",
    "allocate",
    "balanced",
    "deduplicate",
    "facility_location",
    "k_center",
    "select",
    "typicality",
    "typiclust",
]


# ---------------------------------------------------------------------------------------------
# k-center


@dataclass(frozen=True)
class KCenterOptions:
    """Greedy k-center (farthest-first traversal): parameters and defaults."""

    metric: Metric = "cosine"
    """cosine: distances between unit rows (sqrt(2 - 2 cos)); euclidean: between raw rows."""
    first: int | None = None
    """Position of the first centre; None: drawn with the seed."""
    batch: int = 512
    """Most centres chosen between two passes over all rows (the result does not depend on it)."""
    candidates: int = 2048
    """Farthest rows among which a batch of centres is chosen (the result does not depend on it)."""
    chunk_rows: int = 4096
    """Rows read (and cast to fp32) at a time."""


def _update(rows: Rows, new: np.ndarray, offset: int, best: np.ndarray, owner: np.ndarray) -> None:
    """Fold centres `new` (slots offset..) into each row's squared distance to its nearest centre."""
    centres = rows.gather(new)  # [b, D] in the metric's space
    c_sq = centres.norm(dim=1).square()  # [b]
    for start, x, scale in rows.raw_blocks():  # rows x * scale: no normalised copy of the block
        x_sq = (x.norm(dim=1) * scale).square()  # [B]
        d2 = x_sq[:, None] + c_sq[None, :] - 2 * (x @ centres.T) * scale[:, None]  # [B, b]
        d2, at = d2.clamp_min_(0).min(dim=1)  # [B]
        sl = slice(start, start + len(x))
        better = d2.numpy() < best[sl]  # strict: the earlier centre keeps its rows on ties
        best[sl] = np.where(better, d2.numpy(), best[sl])
        owner[sl] = np.where(better, at.numpy() + offset, owner[sl])
    best[new] = -1  # a centre is never picked again
    owner[new] = offset + np.arange(len(new))


def _next_centres(rows: Rows, best: np.ndarray, want: int, candidates: int) -> np.ndarray:
    """Up to `want` next farthest-first centres, exactly, from the `candidates` farthest rows.

    `best` is exact for every row at entry. Within the candidates the distances are updated after
    each pick; rows outside keep stale values, upper bounds of their true ones. A pick stands while
    it beats the largest stale value outside (ties: the lowest position, as a plain argmax), so the
    sequence equals the one-centre-per-pass traversal; the first pick always stands.
    """
    n = len(best)
    m = min(n, candidates)
    order = np.lexsort((np.arange(n), -best))  # farthest first, lowest position on ties
    cand = np.sort(order[:m])  # ascending, so argmax's first-on-ties is the lowest position
    outside = (best[order[m]], -order[m]) if m < n else None
    x = rows.gather(cand)  # [M, D]
    d2 = sq_dists(x, x).numpy()  # [M, M]
    vals = best[cand].copy()
    picks: list[int] = []
    while len(picks) < want:
        j = int(np.argmax(vals))
        if vals[j] < 0 or (picks and outside is not None and (vals[j], -cand[j]) <= outside):
            break
        picks.append(int(cand[j]))
        np.minimum(vals, d2[j], out=vals)
        vals[j] = -1
    return np.asarray(picks, dtype=np.int64)


def k_center(
    X: Any, k: int, scores: Any = None, seed: int = 0, options: KCenterOptions | None = None
) -> Selection:
    """Greedy k-center over rows X [N, D]: k rows in farthest-first order.

    Streamed: O(N k D) multiply-adds in passes of up to `batch` centres each, with each row's
    distance to its nearest centre kept (O(N) memory). `scores` is not used. weights[j] = the
    rows whose nearest centre is the j-th pick (they sum to N). details: radius (the largest
    distance of any row to its nearest centre), passes, metric, first.
    """
    opts = options or KCenterOptions()
    rows = open_rows(X, k, opts.metric, opts.chunk_rows)
    if opts.batch < 1 or opts.candidates < 1:
        raise AssayError(f"batch and candidates must be at least 1, got {opts.batch}, {opts.candidates}")
    first = opts.first if opts.first is not None else int(np.random.default_rng(seed).integers(rows.n))
    if not 0 <= first < rows.n:
        raise AssayError(f"first centre {first} is not a row position (0..{rows.n - 1})")
    best = np.full(rows.n, np.inf, dtype=np.float32)  # [N] squared distance to the nearest centre
    owner = np.zeros(rows.n, dtype=np.int64)  # [N] slot of that centre
    picks = [np.asarray([first], dtype=np.int64)]
    _update(rows, picks[0], 0, best, owner)
    done = 1
    while done < k:
        new = _next_centres(rows, best, min(opts.batch, k - done), opts.candidates)
        _update(rows, new, done, best, owner)
        picks.append(new)
        done += len(new)
    radius = math.sqrt(float(best.max())) if k < rows.n else 0.0
    details = {"radius": radius, "passes": len(picks), "metric": rows.metric, "first": first}
    weights = np.bincount(owner, minlength=k).astype(np.int64)
    return Selection(np.concatenate(picks), weights, details)


# ---------------------------------------------------------------------------------------------
# cluster-balanced


@dataclass(frozen=True)
class BalancedOptions:
    """Cluster-balanced selection: parameters and defaults."""

    clusters: int = 0
    """Number of k-means clusters; 0: round(sqrt(k))."""
    metric: Metric = "cosine"
    """cosine: spherical k-means (clusters of directions); euclidean: plain k-means."""
    min_per_cluster: int = 1
    """Rows every cluster gets first (all of a smaller cluster's), so no cluster is left out;
    0: quotas strictly proportional to cluster size. Ignored when the clusters outnumber k."""
    sample_rows: int = 20_000
    """Rows the k-means is trained on (a seeded sample); all rows are then assigned."""
    iterations: int = 20
    """Lloyd iterations."""
    chunk_rows: int = 4096
    """Rows read (and cast to fp32) at a time."""


def allocate(sizes: np.ndarray, k: int, minimum: int = 0) -> np.ndarray:
    """Quotas per cluster summing to k (<= sum of sizes), none above its cluster's size.

    Each cluster first gets min(minimum, size) (skipped if that exceeds k); the rest, R, is
    shared in proportion to the rows left (size - that) by largest remainders: floor(R * left /
    total left) each, then one more to the largest remainders (lowest cluster on ties). Integer
    arithmetic throughout, so the quotas are exact.
    """
    sizes = np.asarray(sizes, dtype=np.int64)
    base = np.minimum(sizes, minimum)
    if base.sum() > k:
        base = np.zeros_like(sizes)
    left = sizes - base
    rest, total = k - int(base.sum()), int(left.sum())
    if rest == 0:
        return base
    share, remainder = np.divmod(rest * left, total)
    extra = rest - int(share.sum())
    top = np.lexsort((np.arange(len(sizes)), -remainder))[:extra]
    share[top] += 1
    return base + share


def balanced(
    X: Any, k: int, scores: Any = None, seed: int = 0, options: BalancedOptions | None = None
) -> Selection:
    """Cluster rows X [N, D] by seeded k-means, then take each cluster's top-scoring rows by quota.

    Quotas follow cluster sizes (`allocate`), so exactly k rows are chosen. Without scores the
    rows of a cluster are ranked at random (seeded): stratified random sampling. Positions come
    cluster by cluster, best first within each. details: labels [N], sizes, quotas, clusters.
    """
    opts = options or BalancedOptions()
    rows = open_rows(X, k, opts.metric, opts.chunk_rows)
    if opts.clusters < 0 or opts.min_per_cluster < 0:
        raise AssayError("clusters and min_per_cluster must not be negative")
    if scores is not None:
        rank = check_scores(scores, rows.n)
    else:
        rank = np.random.default_rng([seed, 1]).random(rows.n)
    centroids = kmeans(
        rows, opts.clusters or max(1, round(math.sqrt(k))), seed, opts.sample_rows, opts.iterations
    )
    labels = nearest_centroids(rows, centroids, 1)[0][:, 0]
    sizes = np.bincount(labels, minlength=len(centroids))
    quotas = allocate(sizes, k, opts.min_per_cluster)
    order = np.lexsort((np.arange(rows.n), -rank, labels))  # by cluster, best first, lowest on ties
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    picks = np.concatenate([order[s : s + q] for s, q in zip(starts, quotas)])
    details = {"labels": labels, "sizes": sizes, "quotas": quotas, "clusters": len(centroids)}
    return Selection(picks.astype(np.int64), None, details)


# ---------------------------------------------------------------------------------------------
# TypiClust


@dataclass(frozen=True)
class TypiclustOptions:
    """TypiClust: parameters and defaults."""

    neighbours: int = 20
    """Nearest neighbours a row's typicality is the mean closeness to (TypiClust's K)."""
    max_clusters: int = 500
    """Most k-means clusters (their cost grows with rows x clusters); keeping more rows than this
    takes each cluster's most typical rows in proportion to its size, as `balanced` does."""
    knn: Literal["auto", "exact", "ivf"] = "auto"
    """How neighbours are found: exact, ivf (approximate), or auto: exact up to exact_knn_max_rows."""
    exact_knn_max_rows: int = 10_000
    """Largest N the auto knn searches exactly."""
    ivf: IvfOptions = field(default_factory=IvfOptions)
    """The approximate search's lists and probes."""
    sample_rows: int = 20_000
    """Rows the k-means is trained on (a seeded sample); all rows are then assigned."""
    iterations: int = 20
    """Lloyd iterations."""
    chunk_rows: int = 4096
    """Rows read (and cast to fp32) at a time."""


def typicality(rows: Rows, opts: TypiclustOptions, seed: int) -> np.ndarray:
    """[N] each row's mean closeness (cosine) to its `neighbours` nearest other rows."""
    knn = _neighbours(rows, opts, seed)
    close = np.where(knn.neighbours[:, 1:] >= 0, knn.closeness[:, 1:], np.nan)  # the row itself dropped
    if close.shape[1] == 0:
        return np.zeros(rows.n)
    return np.nan_to_num(np.nanmean(close, axis=1), nan=-1.0)


def typiclust(
    X: Any, k: int, scores: Any = None, seed: int = 0, options: TypiclustOptions | None = None
) -> Selection:
    """min(k, max_clusters) k-means clusters of the rows, each giving its most typical rows.

    `scores` replace typicality as the ranking within clusters when given. details: as `balanced`
    plus typicality [N]."""
    opts = options or TypiclustOptions()
    if opts.neighbours < 1 or opts.max_clusters < 1:
        raise AssayError("neighbours and max_clusters must be >= 1")
    rows = open_rows(X, k, "cosine", opts.chunk_rows)
    typical = typicality(rows, opts, seed) if scores is None else check_scores(scores, rows.n)
    clusters = BalancedOptions(
        clusters=min(k, opts.max_clusters), sample_rows=opts.sample_rows, iterations=opts.iterations,
        chunk_rows=opts.chunk_rows,
    )  # fmt: skip
    chosen = balanced(X, k, typical, seed, clusters)
    return Selection(chosen.positions, None, chosen.details | {"typicality": typical})


# ---------------------------------------------------------------------------------------------
# de-duplication


@dataclass(frozen=True)
class DedupOptions:
    """SemDeDup-style near-duplicate removal: parameters and defaults."""

    threshold: float = 0.95
    """Rows at cosine >= threshold to a kept row are duplicates of it."""
    neighbours: int = 16
    """Neighbours searched per row: a row with more near-duplicates than this may keep a few more."""
    knn: Literal["auto", "exact", "ivf"] = "auto"
    """exact, ivf (approximate), or auto: exact up to exact_knn_max_rows."""
    exact_knn_max_rows: int = 10_000
    """Largest N the auto knn searches exactly."""
    ivf: IvfOptions = field(default_factory=IvfOptions)
    """The approximate search's lists and probes."""
    chunk_rows: int = 4096
    """Rows read (and cast to fp32) at a time."""


def deduplicate(X: Any, scores: Any = None, seed: int = 0, options: DedupOptions | None = None) -> Selection:
    """Keep one row of each group of near-duplicates (cosine >= threshold), best score first.

    Rows are visited by score (highest first; without scores in position order) and a row is
    kept unless one of its neighbours at cosine >= threshold was kept before it. Returns the kept
    positions in visiting order; weights[j] = 1 + the rows dropped as duplicates of the j-th kept
    row (they sum to N). details: dropped, threshold.
    """
    opts = options or DedupOptions()
    rows = open_rows(X, 1, "cosine", opts.chunk_rows)
    knn = _neighbours(rows, opts, seed)
    rank = check_scores(scores, rows.n) if scores is not None else np.zeros(rows.n)
    visit = np.lexsort((np.arange(rows.n), -rank))
    near = (knn.closeness >= opts.threshold) & (knn.neighbours >= 0)  # [N, K+1]
    near[:, 0] = False  # the row itself
    kept = np.zeros(rows.n, dtype=bool)
    rep = np.arange(rows.n)
    for i in visit:
        dup = knn.neighbours[i][near[i]]
        dup = dup[kept[dup]]
        if dup.size:
            rep[i] = dup[0]  # the closest kept row
        else:
            kept[i] = True
    picks = visit[kept[visit]]
    slot = np.full(rows.n, -1, dtype=np.int64)
    slot[picks] = np.arange(len(picks))
    weights = np.bincount(slot[rep], minlength=len(picks)).astype(np.int64)
    return Selection(
        picks.astype(np.int64), weights, {"dropped": rows.n - len(picks), "threshold": opts.threshold}
    )


def _neighbours(rows: Rows, opts: DedupOptions | TypiclustOptions, seed: int) -> Knn:
    """Each row's `opts.neighbours` nearest rows (and itself first): exact, or an IVF search."""
    width = min(opts.neighbours + 1, rows.n)
    exact = opts.knn == "exact" or (opts.knn == "auto" and rows.n <= opts.exact_knn_max_rows)
    return exact_knn(rows, width) if exact else ivf_knn(rows, width, opts.ivf, seed)


# ---------------------------------------------------------------------------------------------
# registry

Strategy = Callable[..., Selection]
STRATEGIES: dict[str, Strategy] = {
    "facility": facility_location, "kcenter": k_center, "balanced": balanced, "typiclust": typiclust,
}  # fmt: skip
"""Name -> strategy, each called as strategy(X, k, scores=None, seed=0, options=None)."""
OPTIONS: dict[str, type] = {
    "facility": FacilityOptions,
    "kcenter": KCenterOptions,
    "balanced": BalancedOptions,
    "typiclust": TypiclustOptions,
}
"""Name -> the strategy's options dataclass."""


def select(name: str, X: Any, k: int, scores: Any = None, seed: int = 0, options: Any = None) -> Selection:
    """Run the strategy called `name` (see STRATEGIES) on rows X [N, D]."""
    if name not in STRATEGIES:
        raise AssayError(f"unknown selection strategy {name!r}; choose one of {', '.join(STRATEGIES)}")
    if options is not None and not isinstance(options, OPTIONS[name]):
        raise AssayError(f"strategy {name!r} takes {OPTIONS[name].__name__}, not {type(options).__name__}")
    return STRATEGIES[name](X, k, scores=scores, seed=seed, options=options)
