"""Greedy facility location with CRAIG's weights (Mirzasoleiman, Bilmes & Leskovec, ICML 2020).

Choose S (|S| = k) to maximise F(S) = sum_i max_{j in S} s_ij: every row i is represented by its
most similar chosen row, and a good S leaves no row badly represented. F is monotone submodular,
so the greedy choice (add the row of largest gain F(S + j) - F(S)) is within 1 - 1/e of the best
S. CRAIG's weight of a chosen row j is the number of rows it represents (the rows whose most
similar chosen row is j); the weights sum to N, and training on S with those weights
approximates the full-data gradient (the error is bounded by sum_i min_{j in S} ||g_i - g_j||).

Similarity (FacilityOptions.metric):
- "cosine" (default): s_ij = (1 + cos_ij) / 2, in [0, 1]. The direction of a gradient is what
  attribution compares, while its norm mostly tracks length and loss (see similarity.py).
- "euclidean": CRAIG's own s_ij = d_max - ||x_i - x_j|| with d_max the largest pairwise distance.
The shift (+1, or d_max) only makes s non-negative, as F(empty) = 0 needs: greedy gains after the
first pick do not depend on it, and the first pick is the row of least total distance either way,
so greedy facility location is greedy k-medoids (cosine distance 1 - cos, or Euclidean distance).

Two methods:
- exact (N <= exact_max_rows): the dense N x N similarity and Minoux's lazy greedy: a row's gain
  can only shrink as S grows (submodularity), so stale gains in a max-heap are upper bounds and
  only the top of the heap is re-evaluated. The picks equal those of the plain greedy exactly.
- sparse: each row keeps its K + 1 nearest rows (itself first; exact or IVF search, see
  similarity.py) and every similarity below its (K+1)-th is raised to it: s'_ij = max(s_ij, f_i)
  with f_i the (K+1)-th nearest similarity of row i. F'(S) = sum_i f_i + sum_i max(0,
  max_{j in S, j in kNN(i)} s_ij - f_i) is again a facility location, evaluated on the graph alone
  (O(N K) memory), and F' = F whenever each row's best chosen row is among its K nearest. Where
  none is, F' credits the row with f_i, more than it has: the approximation is optimistic about
  rows no chosen row is near. The exact objective of the result is compared with the exact greedy
  in the tests. Each row's representative (hence the weights and the reported objective) is its
  most similar chosen row among its neighbours, or from an exact search over the chosen rows when
  none is there: exact with the exact neighbour search; with IVF a row's best chosen row can be
  one the search missed, so the weights are approximate and the objective a lower bound.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch

from assay.core.errors import AssayError
from assay.selection.similarity import (
    IvfOptions,
    Knn,
    Metric,
    Rows,
    Selection,
    closeness,
    exact_knn,
    ivf_knn,
    open_rows,
    sq_dists,
)


@dataclass(frozen=True)
class FacilityOptions:
    """Greedy facility location (CRAIG): parameters and defaults."""

    metric: Metric = "cosine"
    """cosine: s_ij = (1 + cos_ij) / 2; euclidean: CRAIG's s_ij = d_max - ||x_i - x_j||."""
    method: Literal["auto", "exact", "sparse"] = "auto"
    """exact: dense N x N similarities; sparse: a K-nearest-neighbour graph;
    auto: exact up to exact_max_rows rows."""
    exact_max_rows: int = 4096
    """Largest N the auto method solves exactly (the dense matrix is N^2 fp32: 64 MiB at 4,096)."""
    neighbours: int = 32
    """K, the neighbours each row keeps in the sparse graph (besides itself)."""
    knn: Literal["auto", "exact", "ivf"] = "auto"
    """How the sparse graph is searched: exact (O(N^2 D)), ivf (approximate),
    auto: exact up to exact_knn_max_rows rows."""
    exact_knn_max_rows: int = 10_000
    """Largest N the auto knn searches exactly."""
    ivf: IvfOptions = field(default_factory=IvfOptions)
    """The approximate search's lists and probes."""
    chunk_rows: int = 4096
    """Rows read (and cast to fp32) at a time."""


def lazy_greedy(
    n: int, k: int, gain: Callable[[int], float], add: Callable[[int], None]
) -> tuple[list[int], list[float], int]:
    """Minoux's lazy greedy over candidates 0..n-1: (picks, their gains, gain evaluations).

    `gain(j)` must be the current marginal gain of j, non-increasing as picks are added
    (submodularity), and `add(j)` must add j. Ties go to the lowest position, so the picks equal
    the plain greedy's (argmax over all gains every round, first on ties) exactly: a popped bound
    computed this round is the true gain and beats every other bound, which is at least its
    candidate's gain. A bound of 0 is exact forever (gains never drop below 0).
    """
    heap = [(-gain(j), j) for j in range(n)]
    heapq.heapify(heap)
    fresh_at = np.zeros(n, dtype=np.int64)  # the round each bound was computed in
    picks: list[int] = []
    gains: list[float] = []
    evaluations = n
    for t in range(k):
        while True:
            neg, j = heapq.heappop(heap)
            if fresh_at[j] == t or neg == 0:
                break
            fresh_at[j] = t
            evaluations += 1
            heapq.heappush(heap, (-gain(j), j))
        picks.append(j)
        gains.append(-neg)
        add(j)
    return picks, gains, evaluations


def similarity_matrix(rows: Rows) -> np.ndarray:
    """The exact method's dense similarities [N, N] fp32, symmetric bit for bit."""
    x = rows.read(0, rows.n)  # [N, D] fp32
    if rows.metric == "cosine":
        s = (1 + x @ x.T) / 2
    else:
        dist = sq_dists(x, x).sqrt_()
        dist.fill_diagonal_(0)
        s = dist.max() - dist
    return ((s + s.T) / 2).numpy()  # a GEMM need not be symmetric in its last bit


def _exact(rows: Rows, k: int) -> tuple[Any, ...]:
    """Lazy greedy on the dense similarities: picks, gains, evaluations, slots, objective, distances."""
    s = similarity_matrix(rows)
    cur = np.zeros(rows.n)  # [N] float64: each row's best similarity to a chosen row

    def gain(j: int) -> float:
        return float(np.maximum(s[j].astype(np.float64) - cur, 0).sum())

    def add(j: int) -> None:
        np.maximum(cur, s[j], out=cur)

    picks, gains, evaluations = lazy_greedy(rows.n, k, gain, add)
    sub = s[:, picks]  # [N, k]
    slot = sub.argmax(axis=1)  # first in greedy order on ties
    sim = sub[np.arange(rows.n), slot].astype(np.float64)
    # cosine: 1 - cos = 2 - 2 s; euclidean: d = d_max - s, and d_max sits on the diagonal
    dist = 2 - 2 * sim if rows.metric == "cosine" else float(s.max()) - sim
    return picks, gains, evaluations, slot, float(sim.sum()), dist, {}


def _similarity(close: np.ndarray, metric: Metric) -> np.ndarray:
    """Similarity up to a constant from `closeness` (cosine, or minus the squared distance)."""
    return (1 + close) / 2 if metric == "cosine" else -np.sqrt(np.maximum(-close, 0))


class _Graph:
    """The sparse facility location: incoming edges of each candidate j, weights s_ij - f_i > 0."""

    def __init__(self, knn: Knn, sim: np.ndarray):
        valid = knn.neighbours >= 0
        floor = np.where(valid, sim, np.inf).min(axis=1)  # [N] f_i
        w = sim.astype(np.float64) - floor[:, None]  # [N, K+1]
        keep = valid & (w > 0)
        i = np.nonzero(keep)[0]
        j = knn.neighbours[keep]
        order = np.argsort(j, kind="stable")
        self.i, self.w = i[order], w[keep][order]
        self.ptr = np.searchsorted(j[order], np.arange(len(sim) + 1))
        self.cur = np.zeros(len(sim))  # [N] each row's best weight s_ij - f_i over chosen j

    def gain(self, j: int) -> float:
        """F'(S + j) - F'(S)."""
        a, b = self.ptr[j], self.ptr[j + 1]
        return float(np.maximum(self.w[a:b] - self.cur[self.i[a:b]], 0).sum())

    def add(self, j: int) -> None:
        """Add j to S."""
        a, b = self.ptr[j], self.ptr[j + 1]
        idx = self.i[a:b]
        self.cur[idx] = np.maximum(self.cur[idx], self.w[a:b])


def nearest_chosen(rows: Rows, queries: np.ndarray, chosen: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For rows at `queries`: the slot in `chosen` of the closest chosen row and its closeness (streamed)."""
    slot = np.zeros(len(queries), dtype=np.int64)
    best = np.full(len(queries), -np.inf, dtype=np.float32)
    step = rows.chunk_rows
    for qs in range(0, len(queries), step):
        q = rows.gather(queries[qs : qs + step])
        bc, bs = torch.full((len(q),), -np.inf), torch.zeros(len(q), dtype=torch.int64)
        for ts in range(0, len(chosen), step):
            c, at = closeness(q, rows.gather(chosen[ts : ts + step]), rows.metric).max(dim=1)
            better = c > bc  # strict: the earlier slot wins ties
            bc, bs = torch.where(better, c, bc), torch.where(better, at + ts, bs)
        slot[qs : qs + len(q)], best[qs : qs + len(q)] = bs.numpy(), bc.numpy()
    return slot, best


def _assign(rows: Rows, knn: Knn, picks: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
    """Each row's representative (slot in picks) and closeness: through the graph, else exactly."""
    slot_of = np.full(rows.n, -1, dtype=np.int64)
    slot_of[picks] = np.arange(len(picks))
    nb = np.where(knn.neighbours >= 0, slot_of[np.maximum(knn.neighbours, 0)], -1)  # [N, K+1]
    masked = np.where(nb >= 0, knn.closeness, -np.inf)
    col = masked.argmax(axis=1)
    r = np.arange(rows.n)
    slot, close = nb[r, col], masked[r, col].astype(np.float32)
    lost = np.flatnonzero(slot < 0)  # no chosen row among the neighbours
    if len(lost):
        slot[lost], close[lost] = nearest_chosen(rows, lost, picks)
    return slot, close, len(lost)


def _sparse(rows: Rows, k: int, opts: FacilityOptions, seed: int) -> tuple[Any, ...]:
    """Lazy greedy on the K-nearest-neighbour graph: picks, gains, evaluations, slots, objective, distances,
    facts (the objective is F(S) under cosine, None under euclidean: d_max is not computed)."""
    use_exact = opts.knn == "exact" or (opts.knn == "auto" and rows.n <= opts.exact_knn_max_rows)
    width = min(opts.neighbours + 1, rows.n)
    knn = exact_knn(rows, width) if use_exact else ivf_knn(rows, width, opts.ivf, seed)
    graph = _Graph(knn, _similarity(knn.closeness, rows.metric))
    picks, gains, evaluations = lazy_greedy(rows.n, k, graph.gain, graph.add)
    slot, close, lost = _assign(rows, knn, np.asarray(picks))
    close64 = close.astype(np.float64)
    objective = float(((1 + close64) / 2).sum()) if rows.metric == "cosine" else None
    dist = 1 - close64 if rows.metric == "cosine" else np.sqrt(np.maximum(-close64, 0))
    facts = {"knn": "exact" if use_exact else "ivf", "neighbours": width - 1, "rows_outside_graph": lost}
    return picks, gains, evaluations, slot, objective, dist, facts


def facility_location(
    X: Any, k: int, scores: Any = None, seed: int = 0, options: FacilityOptions | None = None
) -> Selection:
    """Greedy facility location (CRAIG) over rows X [N, D]: k rows in greedy order, with CRAIG's weights.

    `scores` is not used (coverage only); `seed` drives the approximate search's k-means.
    details: method, metric, objective F(S) (cosine, or euclidean exact), mean_distance (mean
    1 - cos, or Euclidean distance, of each row to its representative), gains (per pick, of the
    objective the greedy maximised), evaluations (gain computations), and for the sparse method
    knn, neighbours and rows_outside_graph (rows assigned by the exact search).
    """
    opts = options or FacilityOptions()
    if opts.neighbours < 1:
        raise AssayError(f"neighbours must be at least 1, got {opts.neighbours}")
    rows = open_rows(X, k, opts.metric, opts.chunk_rows)
    method = opts.method
    if method == "auto":
        method = "exact" if rows.n <= opts.exact_max_rows else "sparse"
    solve = _exact(rows, k) if method == "exact" else _sparse(rows, k, opts, seed)
    picks, gains, evaluations, slot, objective, dist, facts = solve
    details = {
        "method": method,
        "metric": rows.metric,
        "objective": objective,
        "mean_distance": float(np.mean(dist)),
        "gains": np.asarray(gains),
        "evaluations": evaluations,
        **facts,
    }
    weights = np.bincount(slot, minlength=k).astype(np.int64)
    return Selection(np.asarray(picks, dtype=np.int64), weights, details)
