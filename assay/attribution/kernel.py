"""The scoring kernel: stream index rows in chunks, one GEMM per chunk, running top-k.

The (few) queries are transformed once into a matrix V [A, D] such that every mode's score is
`V @ t / norm(t)` for an index row t. For TrackStar, with W = R^{-1/2} (symmetric) and
u = unit(W q):  ⟨u, unit(W t)⟩ = ⟨W u, t⟩ / ‖W t‖ — so the whitening is folded into the
queries and each chunk needs only the row norms ‖W t‖ (one d×d matmul per module) besides the
GEMM. Chunks are read from the memory-mapped file with plain reads into a reused buffer (the
process's memory stays bounded whatever N is; the OS page cache does the rest), and the next
chunk is read on a second thread while the current one is scored.
"""

from __future__ import annotations

import mmap
from collections.abc import Callable
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


class RowSource(Protocol):
    """Rows of gradients, read as fp32 chunks."""

    num_rows: int
    dim: int

    def read(self, start: int, stop: int, slot: int = 0) -> torch.Tensor:  # [stop-start, D] fp32
        """Rows start..stop. The result may live in buffer `slot` until that slot is read again."""
        ...


class ArrayRows:
    """Rows of a numpy array or memmap (fp16/bf16-as-uint16 not supported; fp16/fp32 are).

    `scales` [N] (optional) multiplies each row after the cast: fp16 storage with per-row
    scaling keeps large gradients from overflowing. A memmap is read with file reads into
    one reused buffer, so resident memory stays at a chunk or two however large the file is.
    """

    def __init__(self, array: np.ndarray, scales: np.ndarray | None = None):
        if array.ndim != 2:
            raise AssayError(f"gradient rows must be a 2-d array, got shape {array.shape}")
        if array.dtype not in (np.float16, np.float32, np.float64):
            raise AssayError(f"unsupported gradient dtype {array.dtype}")
        self.array = array
        self.scales = scales
        self.num_rows, self.dim = (int(s) for s in array.shape)
        self._file = _backing_file(array)
        self._slots: dict[int, tuple[np.ndarray, torch.Tensor]] = {}

    def read(self, start: int, stop: int, slot: int = 0) -> torch.Tensor:
        n = stop - start
        raw, rows = self._buffers(slot, n)
        if self._file is None:
            raw[:n] = self.array[start:stop]
        else:
            path, offset = self._file
            with open(path, "rb", buffering=0) as f:
                f.seek(offset + start * self.dim * self.array.itemsize)
                if f.readinto(raw[:n].data.cast("B")) != raw[:n].nbytes:
                    raise AssayError(f"{path} is shorter than its header says: a damaged index")
        if raw.dtype == np.float32:
            out = torch.from_numpy(raw[:n])  # already fp32: no second copy
        else:
            out = rows[:n]
            out.copy_(torch.from_numpy(raw[:n]))  # the cast to fp32, into a reused buffer
        if self.scales is not None:
            out *= torch.from_numpy(np.asarray(self.scales[start:stop], dtype=np.float32))[:, None]
        return out

    def _buffers(self, slot: int, n: int) -> tuple[np.ndarray, torch.Tensor]:
        """(raw [n, D] store dtype, [n, D] fp32) buffers of this slot, grown when needed."""
        have = self._slots.get(slot)
        if have is None or have[0].shape[0] < n:
            cast = self.array.dtype != np.float32
            have = (np.empty((n, self.dim), self.array.dtype), torch.empty(n if cast else 0, self.dim))
            self._slots[slot] = have
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
    return QueryPlan(v.contiguous(), norm, keep, aggregate == "max", base)


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
    """[A, C] scores of the chunk rows [C, D] (fp32) that start at row `start`."""
    scores = plan.vectors @ rows.T
    if plan.row_norm == "raw":
        scores /= rows.norm(dim=1).clamp_min(EPS)
    elif plan.row_norm == "whitened":
        assert plan.whitening is not None
        scores /= plan.whitening.sq_norms(rows).sqrt().clamp_min(EPS)
    elif plan.row_norm == "lowrank":
        scores /= lowrank_sq_norms(plan, rows, start).sqrt().clamp_min(EPS)
    if plan.reduce_max:
        scores = scores.max(dim=0, keepdim=True).values
    return scores


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
) -> TopRows:
    """Score every row of `source` against the planned queries; keep the top/bottom k.

    `scores_out` (optional, e.g. a .npy memmap [A, N] float32) receives every score.
    `on_chunk(rows_done)` is called after each chunk (progress bars).
    """
    if source.dim != plan.vectors.shape[1]:
        raise AssayError(
            f"query gradients have {plan.vectors.shape[1]} dimensions but the index rows have "
            f"{source.dim}: they were not computed with the same modules and projection"
        )
    if top_k < 1:
        raise AssayError(f"--top_k must be >= 1, got {top_k}")
    columns = 1 if plan.reduce_max else plan.vectors.shape[0]
    running = RunningTop(columns, top_k)
    starts = list(range(0, source.num_rows, max(chunk_rows, 1)))
    with ThreadPoolExecutor(max_workers=1) as pool:
        pending = pool.submit(source.read, 0, min(chunk_rows, source.num_rows), 0) if starts else None
        for i, start in enumerate(starts):
            stop = min(start + chunk_rows, source.num_rows)
            assert pending is not None
            rows = pending.result().to(plan.vectors.device)
            if i + 1 < len(starts):  # read the next chunk while this one is scored
                nxt = starts[i + 1]
                pending = pool.submit(source.read, nxt, min(nxt + chunk_rows, source.num_rows), (i + 1) % 2)
            scores = chunk_scores(plan, rows, start)
            running.update(scores, start)
            if scores_out is not None:
                scores_out[:, start:stop] = scores.cpu().numpy()
            if on_chunk is not None:
                on_chunk(stop)
    return running.result()


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
