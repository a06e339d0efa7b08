"""The scoring kernel: stream index rows in chunks, GEMMs on cache-sized blocks, running top-k.

The (few) queries are transformed once into a matrix V [A, D] such that every mode's score is
`V @ t / norm(t)` for an index row t. For TrackStar, with W = R^{-1/2} (symmetric) and
u = unit(W q):  ⟨u, unit(W t)⟩ = ⟨W u, t⟩ / ‖W t‖ — so the whitening is folded into the
queries and each row needs only its norm ‖W t‖ besides the GEMM (from a per-index cache plus a
small per-module product; see `LowRank`).

Why it is fast: scoring a few queries is memory-bound, so every row should cross the memory bus
once. A chunk (~32 MiB) is read from the file with plain reads (resident memory stays bounded
whatever N is; the OS page cache does the rest), then cast to fp32 and scored in blocks of
~1 MiB that stay in the core's cache between the cast, the GEMM and the norms. Chunks are
spread over worker threads, one per core, each running single-threaded torch: a few large
operations per chunk instead of many small multi-threaded ones whose synchronisation would
cost more than their arithmetic.
"""

from __future__ import annotations

import contextlib
import mmap
import threading
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Literal, Protocol

import numpy as np
import torch

from assay.attribution.precondition import Whitening
from assay.core.errors import AssayError
from assay.core.precision import STATS_DTYPE

Mode = Literal["trackstar", "cosine", "inner", "influence"]
Aggregate = Literal["none", "mean", "max"]
MODES: tuple[str, ...] = ("trackstar", "cosine", "inner", "influence")
AGGREGATES: tuple[str, ...] = ("none", "mean", "max")
EPS = 1e-30
BLOCK_BYTES = 1 << 20  # fp32 rows scored at once: stays in a core's L2 cache
# A stacked plan reads each block once (one bmm), so it has no cache to stay in; its dozen small
# ops per block cost more than the block's arithmetic at 1 MiB: measured ~20% faster at 4 MiB.
STACKED_BLOCK_BYTES = 4 << 20


class RowSource(Protocol):
    """Rows of gradients, read in chunks."""

    num_rows: int
    dim: int

    def read_raw(self, start: int, stop: int, slot: int = 0) -> torch.Tensor:
        """Rows start..stop [stop-start, D] in their stored float dtype.

        The result may live in buffer `slot` until that slot is read again.
        """
        ...

    def read(self, start: int, stop: int, slot: int = 0) -> torch.Tensor:
        """Rows start..stop as fp32 (same buffer rule)."""
        ...


class ArrayRows:
    """Rows of a numpy array or memmap (fp16, fp32 or fp64).

    A memmap is read with file reads into reused buffers, so resident memory stays at a few
    chunks however large the file is.
    """

    def __init__(self, array: np.ndarray):
        if array.ndim != 2:
            raise AssayError(f"gradient rows must be a 2-d array, got shape {array.shape}")
        if array.dtype not in (np.float16, np.float32, np.float64):
            raise AssayError(f"unsupported gradient dtype {array.dtype}")
        self.array = array
        self.num_rows, self.dim = (int(s) for s in array.shape)
        self._file = _backing_file(array)
        self._slots: dict[int, np.ndarray] = {}

    def read_raw(self, start: int, stop: int, slot: int = 0) -> torch.Tensor:
        n = stop - start
        raw = self._buffer(slot, n)[:n]
        if self._file is None:
            raw[:] = self.array[start:stop]
        else:
            path, offset = self._file
            with open(path, "rb", buffering=0) as f:
                f.seek(offset + start * self.dim * self.array.itemsize)
                if f.readinto(raw.data.cast("B")) != raw.nbytes:
                    raise AssayError(f"{path} is shorter than its header says: a damaged index")
        return torch.from_numpy(raw)

    def read(self, start: int, stop: int, slot: int = 0) -> torch.Tensor:
        return self.read_raw(start, stop, slot).to(STATS_DTYPE)

    def _buffer(self, slot: int, n: int) -> np.ndarray:
        """The [n, D] stored-dtype buffer of this slot, grown when needed."""
        have = self._slots.get(slot)
        if have is None or have.shape[0] < n:
            have = self._slots[slot] = np.empty((n, self.dim), self.array.dtype)
        return have


def _backing_file(array: np.ndarray) -> tuple[str, int] | None:
    """(path, byte offset) when `array` is a whole memmap straight over a file, else None.

    A slice of a memmap keeps its parent's `offset`, so only an array whose base is the
    mmap object itself (as `np.load(..., mmap_mode="r")` returns) is read through the file.
    """
    if not isinstance(array, np.memmap) or not isinstance(array.base, mmap.mmap):
        return None
    if not array.flags.c_contiguous or array.filename is None:
        return None
    return str(array.filename), int(array.offset)


class TensorRows:
    """Rows of an in-memory torch tensor (the Python API's case)."""

    def __init__(self, tensor: torch.Tensor):
        if tensor.ndim != 2:
            raise AssayError(f"gradient rows must be [N, D], got shape {tuple(tensor.shape)}")
        self.tensor = tensor
        self.num_rows, self.dim = (int(s) for s in tensor.shape)

    def read_raw(self, start: int, stop: int, slot: int = 0) -> torch.Tensor:
        return self.tensor[start:stop]

    def read(self, start: int, stop: int, slot: int = 0) -> torch.Tensor:
        return self.tensor[start:stop].to(STATS_DTYPE)


@dataclass
class QueryPlan:
    """Queries folded into one matrix: score(t) = (V t) / norm(t), then max over rows if asked."""

    vectors: torch.Tensor  # [A, D] fp32
    row_norm: Literal["none", "raw", "whitened", "lowrank"]
    whitening: Whitening | None
    reduce_max: bool
    base_norms: torch.Tensor | None = None  # [N] fp64 ‖(R_train + δI)^{-1/2} t‖² ("lowrank")
    stacked: StackedModules | None = None  # "lowrank" with equal-width modules: one bmm per block


@dataclass
class StackedModules:
    """The "lowrank" chunk work as one batched product over M modules of equal width d.

    Per module m, [V_m ; Lᵀ_m (A_m⁻¹U_m)ᵀ] [A+Q, d] multiplies the block's rows t_m [c, d], with
    K_m⁻¹ = L_m L_mᵀ (Cholesky): summing the first A rows over modules gives the scores V t, and
    the squares of the last Q rows sum to the Woodbury correction Σ_m s_mᵀ K_m⁻¹ s_m — the rows
    are read once for both, and the correction is one square-and-sum.
    """

    weights: torch.Tensor  # [M, A+Q, d] fp32


def unit_rows(x: torch.Tensor) -> torch.Tensor:
    """Rows scaled to unit L2 norm (zero rows stay zero)."""
    return x / x.norm(dim=1, keepdim=True).clamp_min(EPS)


def plan_queries(
    queries: torch.Tensor,
    mode: str,
    aggregate: str,
    whitening: Whitening | None = None,
    base_norms: np.ndarray | None = None,
) -> QueryPlan:
    """Transform query gradients [Q, D] once for `mode`, then aggregate them.

    With `base_norms` (trackstar; see `base_sq_norms`) each row's ‖W t‖ comes from the
    Woodbury form instead of a d×d matmul per module: the chunk costs a GEMM with Q more
    columns instead of D·d multiply-adds per row.
    """
    if queries.ndim != 2 or queries.shape[0] == 0:
        raise AssayError("no queries to score: the query set is empty")
    if mode not in MODES:
        raise AssayError(f"unknown --mode {mode!r}; choose one of {', '.join(MODES)}")
    if aggregate not in AGGREGATES:
        raise AssayError(f"unknown --aggregate {aggregate!r}; choose one of {', '.join(AGGREGATES)}")
    q = queries.to(STATS_DTYPE)
    norm: Literal["none", "raw", "whitened", "lowrank"] = "none"
    if mode in ("trackstar", "influence"):
        if whitening is None:
            raise AssayError(f"--mode {mode} needs preconditioner statistics")
        w = whitening.to(q.device)
        v = w.apply(unit_rows(w.apply(q)), 1) if mode == "trackstar" else w.apply(q, times=2)
        norm = "whitened" if mode == "trackstar" else "none"
    elif mode == "cosine":
        v, norm = unit_rows(q), "raw"
    else:
        v = q
    if aggregate == "mean":
        v = v.mean(dim=0, keepdim=True)  # every mode's score is linear in V: mean of the scores
    base = None
    if norm == "whitened" and base_norms is not None:
        assert whitening is not None and whitening.lowrank is not None
        norm, base = "lowrank", torch.from_numpy(np.asarray(base_norms, dtype=np.float64))
    keep = whitening if norm in ("whitened", "lowrank") else None
    stacked = stack_modules(v, whitening) if norm == "lowrank" else None
    return QueryPlan(v.contiguous(), norm, keep, aggregate == "max", base, stacked)


def stack_modules(vectors: torch.Tensor, whitening: Whitening | None) -> StackedModules | None:
    """The batched form of the "lowrank" work, when the modules tile the columns at one width."""
    assert whitening is not None and whitening.lowrank is not None
    lr, slices = whitening.lowrank, list(whitening.slices.values())
    widths = {sl.stop - sl.start for sl in slices}
    tiled = all(a.stop == b.start for a, b in zip(slices, slices[1:])) and slices[0].start == 0
    if not lr.factors or len(widths) != 1 or not tiled or slices[-1].stop != vectors.shape[1]:
        return None  # λ = 0 (no correction) or uneven modules: the per-module path
    blocks = []
    for name, sl in whitening.slices.items():
        chol = torch.linalg.cholesky(lr.kinv[name])  # [Q, Q] fp64, K⁻¹ = L Lᵀ
        folded = (chol.T @ lr.factors[name].double().T).to(STATS_DTYPE)  # [Q, d]: s ↦ Lᵀ s
        blocks.append(torch.cat([vectors[:, sl], folded]))
    return StackedModules(torch.stack(blocks).contiguous())


def lowrank_sq_norms(plan: QueryPlan, rows: torch.Tensor, start: int) -> torch.Tensor:
    """[C] ‖W t‖² = base(t)/(1−λ) − Σ_m s_mᵀK_m⁻¹s_m (fp64), s_m = t_m A_m⁻¹U_m (see LowRank)."""
    assert plan.whitening is not None and plan.whitening.lowrank is not None and plan.base_norms is not None
    lr = plan.whitening.lowrank
    sq = plan.base_norms[start : start + rows.shape[0]] * lr.base_scale
    for name, factor in lr.factors.items():
        s_m = (rows[:, plan.whitening.slices[name]] @ factor).double()  # [C, Q]
        sq = sq - ((s_m @ lr.kinv[name]) * s_m).sum(dim=1)
    return sq.clamp_min(0).float()


def chunk_scores(plan: QueryPlan, rows: torch.Tensor, start: int = 0) -> torch.Tensor:
    """[A, C] scores of the chunk rows [C, D] (any float dtype) that start at row `start`.

    Rows are cast to fp32 and scored a cache-sized block at a time (see the module docstring).
    """
    out = torch.empty(plan.vectors.shape[0], rows.shape[0])  # [A, C]
    step = max(16, (STACKED_BLOCK_BYTES if plan.stacked is not None else BLOCK_BYTES) // (4 * rows.shape[1]))
    scratch = _scratch(step, rows.shape[1], rows.device) if rows.dtype != STATS_DTYPE else None
    for s in range(0, rows.shape[0], step):
        block = rows[s : s + step]
        if scratch is not None:  # cast into a reused buffer: no allocation (and page faults) per block
            block = scratch[: block.shape[0]].copy_(block)
        out[:, s : s + step] = block_scores(plan, block, start + s)
    if plan.reduce_max:
        return out.max(dim=0, keepdim=True).values
    return out


_thread_scratch = threading.local()


def _scratch(rows: int, dim: int, device: torch.device) -> torch.Tensor:
    """This thread's reusable [rows, dim] fp32 block buffer."""
    buf = getattr(_thread_scratch, "buf", None)
    if buf is None or buf.shape[0] < rows or buf.shape[1] != dim or buf.device != device:
        buf = _thread_scratch.buf = torch.empty(rows, dim, dtype=STATS_DTYPE, device=device)
    return buf


def block_scores(plan: QueryPlan, rows: torch.Tensor, start: int) -> torch.Tensor:
    """[A, c] scores of fp32 rows [c, D] starting at row `start`."""
    if plan.stacked is not None:
        return stacked_scores(plan, rows, start)
    scores = plan.vectors @ rows.T  # [A, c]: this orientation measured faster than rows @ V.T here
    if plan.row_norm == "raw":
        scores /= torch.linalg.vector_norm(rows, dim=1).clamp_min(EPS)
    elif plan.row_norm == "whitened":
        assert plan.whitening is not None
        scores /= plan.whitening.sq_norms(rows).sqrt().clamp_min(EPS)
    elif plan.row_norm == "lowrank":
        scores /= lowrank_sq_norms(plan, rows, start).sqrt().clamp_min(EPS)
    return scores


def stacked_scores(plan: QueryPlan, rows: torch.Tensor, start: int) -> torch.Tensor:
    """`block_scores` for "lowrank" plans with a StackedModules: one bmm for scores and norms."""
    assert plan.stacked is not None and plan.base_norms is not None and plan.whitening is not None
    assert plan.whitening.lowrank is not None
    weights = plan.stacked.weights  # [M, A+Q, d]
    modules, num_scores, width = weights.shape[0], plan.vectors.shape[0], weights.shape[2]
    both = torch.bmm(weights, rows.view(-1, modules, width).permute(1, 2, 0))  # [M, A+Q, c]
    scores = both[:, :num_scores].sum(dim=0)  # [A, c]
    correction = both[:, num_scores:].double().square().sum(dim=(0, 1))  # Σ_m ‖L_mᵀ s_m‖²
    base = plan.base_norms[start : start + rows.shape[0]] * plan.whitening.lowrank.base_scale
    sq = base - correction  # fp64: for a row close to a query the two nearly cancel
    return scores / sq.clamp_min(0).sqrt().float().clamp_min(EPS)


@dataclass
class TopRows:
    """Best (proponents) and worst (opponents) rows per score column, by row position."""

    top_values: torch.Tensor  # [A, k] descending
    top_rows: torch.Tensor  # [A, k] int64
    bottom_values: torch.Tensor  # [A, k] ascending
    bottom_rows: torch.Tensor  # [A, k] int64


class RunningTop:
    """Merge per-chunk top-k into a running top-k (and bottom-k) per score column."""

    def __init__(self, columns: int, k: int):
        self.k = k
        empty = torch.empty(columns, 0)
        self.top = (empty, empty.long())
        self.bottom = (empty, empty.long())

    def update(self, scores: torch.Tensor, start: int) -> None:
        """`scores` [A, C] of rows start..start+C."""
        self.top = self._merge(self.top, scores, start, largest=True)
        self.bottom = self._merge(self.bottom, scores, start, largest=False)

    def _merge(self, best, scores, start, largest):
        k = min(self.k, scores.shape[1])
        vals, idx = scores.topk(k, dim=1, largest=largest, sorted=False)
        vals = torch.cat([best[0], vals], dim=1)
        rows = torch.cat([best[1], idx + start], dim=1)
        keep = vals.topk(min(self.k, vals.shape[1]), dim=1, largest=largest, sorted=True).indices
        return vals.gather(1, keep), rows.gather(1, keep)

    def result(self) -> TopRows:
        return TopRows(self.top[0], self.top[1], self.bottom[0], self.bottom[1])


def score_rows(
    source: RowSource,
    plan: QueryPlan,
    top_k: int = 10,
    scores_out: np.ndarray | None = None,
    chunk_rows: int = 8192,
    on_chunk: Callable[[int], None] | None = None,
    workers: int = 0,
) -> TopRows:
    """Score every row of `source` against the planned queries; keep the top/bottom k.

    `scores_out` (optional, e.g. a .npy memmap [A, N] float32) receives every score.
    `on_chunk(rows_done)` is called after each chunk (progress bars). Chunks are read and scored
    on `workers` threads (0: torch's thread count) and merged in row order, so the result does
    not depend on the number of workers.
    """
    if source.dim != plan.vectors.shape[1]:
        raise AssayError(
            f"query gradients have {plan.vectors.shape[1]} dimensions but the index rows have "
            f"{source.dim}: they were not computed with the same modules and projection"
        )
    if top_k < 1:
        raise AssayError(f"--top_k must be >= 1, got {top_k}")
    running = RunningTop(1 if plan.reduce_max else plan.vectors.shape[0], top_k)
    workers = workers or torch.get_num_threads()
    depth = workers + 1  # chunks in flight: every worker busy while the oldest is merged
    device = plan.vectors.device

    def score(start: int, stop: int, slot: int) -> torch.Tensor:
        return chunk_scores(plan, source.read_raw(start, stop, slot).to(device), start)

    spans = [(a, min(a + chunk_rows, source.num_rows)) for a in range(0, source.num_rows, max(chunk_rows, 1))]
    with single_threaded_torch(workers) as pool:
        pending = deque(pool.submit(score, *span, i % depth) for i, span in enumerate(spans[:depth]))
        for i, (start, stop) in enumerate(spans):
            scores = pending.popleft().result()
            if i + depth < len(spans):  # its slot's previous chunk has been scored
                pending.append(pool.submit(score, *spans[i + depth], (i + depth) % depth))
            running.update(scores, start)
            if scores_out is not None:
                scores_out[:, start:stop] = scores.cpu().numpy()
            if on_chunk is not None:
                on_chunk(stop)
    return running.result()


@contextlib.contextmanager
def single_threaded_torch(workers: int) -> Iterator[ThreadPoolExecutor]:
    """A pool of `workers` threads whose torch ops run single-threaded; threads restored after."""
    before = torch.get_num_threads()
    try:
        with ThreadPoolExecutor(workers, initializer=torch.set_num_threads, initargs=(1,)) as pool:
            yield pool
    finally:
        torch.set_num_threads(before)


def base_sq_norms(source: RowSource, whitening: Whitening, chunk_rows: int = 1024) -> np.ndarray:
    """[N] ‖(R_train + δI)^{-1/2} t‖² of every row in fp64: the query-independent part of ‖W t‖².

    fp64 because ‖W t‖² is this minus the query part, and for rows close to a query the two
    nearly cancel.
    """
    assert whitening.lowrank is not None
    mats = {n: m.double() for n, m in whitening.lowrank.base.items()}
    out = np.zeros(source.num_rows, dtype=np.float64)
    for start in range(0, source.num_rows, chunk_rows):
        stop = min(start + chunk_rows, source.num_rows)
        rows = source.read(start, stop).double()
        total = torch.zeros(stop - start, dtype=torch.float64)
        for name, m in mats.items():
            total += ((rows[:, whitening.slices[name]] @ m) ** 2).sum(1)
        out[start:stop] = total.numpy()
    return out
