"""The scoring kernel: stream index rows in chunks, GEMMs on cache-sized blocks, running top-k.

The (few) queries are transformed once into a matrix V [A, D] such that every mode's score is
`V @ t / norm(t)` for an index row t. For TrackStar, with W = R^{-1/2} (symmetric) and
u = unit(W q):  ⟨u, unit(W t)⟩ = ⟨W u, t⟩ / ‖W t‖ — so the whitening is folded into the
queries and each row needs only its norm ‖W t‖ besides the GEMM (from a per-index cache plus a
small per-module product; see `LowRank`).

Why it is fast: scoring a few queries is memory-bound, so every row should cross the memory bus
once. Rows are scored in chunks (~64 MiB of fp32) and within a chunk in blocks of ~2 MiB of fp32
that stay in the core's cache between the cast, the GEMM and the norms. An fp32 index's block is
either copied from the page cache into a buffer of the thread (`rows.FileBlocks`) or used where
the page cache holds it, whichever the first chunks of the pass showed faster on this machine
(`rows.FileReads`); resident memory stays at a few chunks whatever N is. fp16 rows are used where
the page cache holds them (a chunk's pages mapped in one call and unmapped when the chunk is done,
`rows.FileWindows`), cast block by block, or for inner, influence and cosine screened whole
by an fp16 GEMM with a proven error bound, only the rows that may reach the top k being scored
again exactly (`Screen`): a stored number is then read once, as fp16. Chunks are spread over
worker threads, one per core, each running single-threaded torch: a few large operations per
chunk instead of many small multi-threaded ones whose synchronisation would cost more than their
arithmetic.
"""

from __future__ import annotations

import contextlib
import functools
import math
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from assay.attribution.precondition import Whitening

# ArrayRows, TensorRows and the per-row caches are re-exported: callers import them with the kernel
from assay.attribution.rows import ArrayRows as ArrayRows
from assay.attribution.rows import FileBlocks, FileReads, RowSource, thread_buffer
from assay.attribution.rows import TensorRows as TensorRows
from assay.attribution.rows import base_sq_norms as base_sq_norms
from assay.attribution.rows import row_norms as row_norms
from assay.core.errors import AssayError
from assay.core.precision import STATS_DTYPE

Mode = Literal["trackstar", "cosine", "inner", "influence"]
Aggregate = Literal["none", "mean", "max"]
Chunk = torch.Tensor | FileBlocks  # rows [C, D] in memory, or read from the file block by block
MODES: tuple[str, ...] = ("trackstar", "cosine", "inner", "influence")
AGGREGATES: tuple[str, ...] = ("none", "mean", "max")
EPS = 1e-30
# fp32 rows scored at once: within a core's L2 on Intel (2 MiB); on AMD EPYC (1 MiB L2) 2 MiB
# still beat 1 MiB for every mode, the per-block GEMM calls' own cost halved (docs/BENCHMARKS.md)
BLOCK_BYTES = 2 << 20


@dataclass
class QueryPlan:
    """Queries folded into one matrix: score(t) = (V t) / norm(t), then max over rows if asked."""

    vectors: torch.Tensor  # [A, D] fp32
    row_norm: Literal["none", "raw", "whitened", "lowrank"]
    whitening: Whitening | None
    reduce_max: bool
    base_norms: torch.Tensor | None = None  # [N] fp64 ‖(R_train + δI)^{-1/2} t‖² ("lowrank")
    stacked: StackedModules | None = None  # "lowrank" with equal-width modules: one bmm per block
    screen: Screen | None = None  # fp16 rows: a half-precision GEMM picks the rows to score exactly
    row_norms: torch.Tensor | None = None  # [N] fp32 ‖t‖ of every row (norms.npy): cosine, Screen


@dataclass
class StackedModules:
    """The "lowrank" chunk work as one batched product over M modules of equal width d.

    Per module m, [V_m ; Lᵀ_m (A_m⁻¹U_m)ᵀ] [A+Q, d] multiplies the block's rows t_m [c, d], with
    K_m⁻¹ = L_m L_mᵀ (Cholesky): summing the first A rows over modules gives the scores V t, and
    the squares of the last Q rows sum to the Woodbury correction Σ_m s_mᵀ K_m⁻¹ s_m — the rows
    are read once for both, and the correction is one square-and-sum.
    """

    weights: torch.Tensor  # [M, A+Q, d] fp32


@dataclass
class Screen:
    """Scores of fp16 rows from one fp16 GEMM, each within a proven error bound.

    Scoring streams the index once and is memory-bound; fp16 rows cast to fp32 before the GEMM
    cost a second pass. Instead `V/s` (each query row scaled to max |entry| 1) is rounded to
    fp16 and multiplied with the rows by a half-precision GEMM (fp32 accumulation, fp16
    result). For entry (a, r) the approximation differs from the fp32 score by at most

        2·(2⁻¹¹ + D·2⁻²⁴)·‖v_a‖·‖t_r‖  +  2·s_a·2⁻²⁵·(√D·‖t_r‖ + 1)  +  2⁻¹⁰·|approx|

    (rounding V to fp16, normal and subnormal; fp32 accumulation; the fp16 result; each
    doubled). Per chunk, only rows whose bounds reach that chunk's k-th best are scored again
    exactly: every row of the true top (and bottom) k is among them, so the result is the exact
    path's. Needs each row's ‖t_r‖ (the plan's `row_norms`: the index's norms.npy).
    """

    half: torch.Tensor  # [A, D] fp16: V / s
    scale: torch.Tensor  # [A] fp32: s
    linear: torch.Tensor  # [A] fp32: the bound's coefficient of ‖t_r‖
    flat: torch.Tensor  # [A] fp32: the bound's constant for nonzero rows

    @staticmethod
    def of(vectors: torch.Tensor) -> Screen:
        dim = vectors.shape[1]
        scale = vectors.abs().amax(dim=1).clamp_min(EPS)
        rel = 2.0**-11 + dim * 2.0**-24
        linear = 2 * rel * torch.linalg.vector_norm(vectors, dim=1) + 2 * scale * 2.0**-25 * dim**0.5
        half = (vectors / scale[:, None]).half()
        return Screen(half, scale, linear, 2 * scale * 2.0**-25)


@functools.cache
def half_gemm_is_exact_enough() -> bool:
    """Whether this CPU's fp16 GEMM accumulates in fp32 and is fast (oneDNN with AVX512-FP16 or
    AMX-FP16): checked once against an fp64 product with cancellation; otherwise rows are cast."""
    try:
        if not (torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_fp16_supported()):
            return False
    except (AttributeError, RuntimeError):  # a private query other torch builds may lack
        return False
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(4, 4096, generator=gen).half()
    b = torch.randn(512, 4096, generator=gen).half()
    b[:, ::2] *= 64  # large terms that cancel: fp16 accumulation would show
    exact = a.double() @ b.double().T
    err = ((a @ b.T).double() - exact).abs() - 2.0**-11 * exact.abs()
    return bool((err <= 4096 * 2.0**-24 * (a.double().abs() @ b.double().abs().T)).all())


def unit_rows(x: torch.Tensor) -> torch.Tensor:
    """Rows scaled to unit L2 norm (zero rows stay zero)."""
    return x / x.norm(dim=1, keepdim=True).clamp_min(EPS)


def plan_queries(
    queries: torch.Tensor,
    mode: str,
    aggregate: str,
    whitening: Whitening | None = None,
    base_norms: np.ndarray | None = None,
    row_norms: np.ndarray | None = None,
) -> QueryPlan:
    """Transform query gradients [Q, D] once for `mode`, then aggregate them.

    With `base_norms` (trackstar; see `base_sq_norms`) each row's ‖W t‖ comes from the
    Woodbury form instead of a d×d matmul per module: the chunk costs a GEMM with Q more
    columns instead of D·d multiply-adds per row. With `row_norms` ([N] ‖t‖, see `row_norms`)
    inner, influence and cosine plans screen fp16 rows (see `Screen`), and cosine divides by
    them instead of computing each row's norm again.
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
    norms = None if row_norms is None else torch.from_numpy(np.asarray(row_norms, dtype=np.float32))
    screen = None
    on_cpu = v.device.type == "cpu"  # the capability check and the bound are the CPU GEMM's
    if norms is not None and norm in ("none", "raw") and on_cpu and half_gemm_is_exact_enough():
        screen = Screen.of(v)
    return QueryPlan(v.contiguous(), norm, keep, aggregate == "max", base, stacked, screen, norms)


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


def chunk_scores(plan: QueryPlan, rows: Chunk, start: int = 0) -> torch.Tensor:
    """[A, C] scores of the chunk rows [C, D] (any float dtype) that start at row `start`.

    Rows are cast to fp32 and scored a cache-sized block at a time (see the module docstring).
    """
    if plan.stacked is not None:
        out = stacked_scores(plan, rows, start)
    else:
        out = torch.empty(plan.vectors.shape[0], rows.shape[0])  # [A, C]
        step = max(16, BLOCK_BYTES // (4 * rows.shape[1]))
        for s, block in _fp32_blocks(rows, step):
            out[:, s : s + step] = block_scores(plan, block, start + s)
    if plan.reduce_max:
        return out.max(dim=0, keepdim=True).values
    return out


def screened_chunk(
    plan: QueryPlan, rows: torch.Tensor, start: int, top_k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(exact scores [A, m], row positions [m]) of the fp16 chunk rows [C, D] that may be among
    the chunk's top or bottom `top_k` (see `Screen`); every row if the fp16 GEMM overflows."""
    bounds = screen_bounds(plan, rows, start)
    if bounds is None:
        return chunk_scores(plan, rows, start), torch.arange(start, start + rows.shape[0])
    approx, err = bounds
    upper, lower = approx + err, approx - err
    if plan.reduce_max:
        upper, lower = upper.amax(0, keepdim=True), lower.amax(0, keepdim=True)
    k = min(top_k, rows.shape[0])
    top_cut = lower.topk(k, dim=1).values[:, -1:]  # k rows score at least this
    bottom_cut = upper.topk(k, dim=1, largest=False).values[:, -1:]
    picked = ((upper >= top_cut) | (lower <= bottom_cut)).any(0).nonzero().squeeze(1)
    candidates = _scratch(len(picked), rows.shape[1], rows.device).copy_(rows[picked])
    exact = block_scores(plan, candidates, start, picked + start)
    if plan.reduce_max:
        exact = exact.amax(0, keepdim=True)
    return exact, picked + start


def screen_bounds(
    plan: QueryPlan, rows: torch.Tensor, start: int
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(approximate scores [A, C], their error bounds [A, C]) of fp16 rows from one fp16 GEMM,
    or None when it overflowed fp16's range (see `Screen`)."""
    sc = plan.screen
    assert sc is not None and plan.row_norms is not None
    approx = (sc.half @ rows.T).float()  # [A, C]
    if not bool(torch.isfinite(approx).all()):
        return None
    approx *= sc.scale[:, None]
    norms = plan.row_norms[start : start + rows.shape[0]]
    err = sc.linear[:, None] * norms + sc.flat[:, None] * (norms > 0) + 2.0**-10 * approx.abs()
    if plan.row_norm == "raw":  # cosine
        inv = 1 / norms.clamp_min(EPS)
        approx *= inv
        err *= inv
    return approx, err


def _fp32_blocks(rows: Chunk, step: int) -> Iterator[tuple[int, torch.Tensor]]:
    """(start, block) over rows [C, D], `step` rows at a time, as fp32: other dtypes are cast
    into a reused buffer (no allocation, and no page faults, per block)."""
    if isinstance(rows, FileBlocks):
        yield from rows.blocks(step)
        return
    scratch = _scratch(step, rows.shape[1], rows.device) if rows.dtype != STATS_DTYPE else None
    for s in range(0, rows.shape[0], step):
        block = rows[s : s + step]
        yield s, block if scratch is None else scratch[: block.shape[0]].copy_(block)


def _scratch(rows: int, dim: int, device: torch.device) -> torch.Tensor:
    """This thread's reusable [rows, dim] fp32 block buffer (casts of fp16 rows)."""
    return thread_buffer("scratch", rows, dim, device=device)


def block_scores(
    plan: QueryPlan, rows: torch.Tensor, start: int, positions: torch.Tensor | None = None
) -> torch.Tensor:
    """[A, c] scores of fp32 rows [c, D] starting at row `start`, or (inner, influence, cosine)
    at the row positions `positions` [c]."""
    if plan.stacked is not None:
        return stacked_scores(plan, rows, start)
    scores = plan.vectors @ rows.T  # [A, c]: this orientation measured faster than rows @ V.T here
    if plan.row_norm == "raw":
        at = slice(start, start + rows.shape[0]) if positions is None else positions
        given = None if plan.row_norms is None else plan.row_norms[at]
        scores /= (torch.linalg.vector_norm(rows, dim=1) if given is None else given).clamp_min(EPS)
    elif plan.row_norm == "whitened":
        assert plan.whitening is not None
        scores /= plan.whitening.sq_norms(rows).sqrt().clamp_min(EPS)
    elif plan.row_norm == "lowrank":
        scores /= lowrank_sq_norms(plan, rows, start).sqrt().clamp_min(EPS)
    return scores


def stacked_scores(plan: QueryPlan, rows: Chunk, start: int) -> torch.Tensor:
    """[A, C] scores of rows [C, D] (any float dtype) for "lowrank" plans with a StackedModules.

    Per block of rows one bmm gives every module's scores and Woodbury terms; the sums over
    modules, the correction and the division run once for the whole chunk: per block, those
    dozen small ops cost more than the block's arithmetic.
    """
    assert plan.stacked is not None and plan.base_norms is not None and plan.whitening is not None
    assert plan.whitening.lowrank is not None
    weights = plan.stacked.weights  # [M, A+Q, d]
    modules, width = weights.shape[0], weights.shape[2]
    num_rows, num_scores = rows.shape[0], plan.vectors.shape[0]
    step = max(16, min(num_rows, BLOCK_BYTES // (4 * rows.shape[1])))
    both = thread_buffer("stacked", -(-num_rows // step), modules, weights.shape[1], step, device=rows.device)
    for b, (_, block) in enumerate(_fp32_blocks(rows, step)):
        per_module = block.view(-1, modules, width).permute(1, 2, 0)  # [M, d, c]
        if block.shape[0] == step:
            torch.bmm(weights, per_module, out=both[b])
        else:  # the last, shorter block
            both[b, :, :, : block.shape[0]] = torch.bmm(weights, per_module)
    scores = both[:, :, :num_scores].sum(dim=1).permute(1, 0, 2).reshape(num_scores, -1)[:, :num_rows]
    terms = both[:, :, num_scores:]  # fp64 for the sum of squares, in a reused buffer
    terms = thread_buffer("terms", *terms.shape, device=rows.device, dtype=torch.float64).copy_(terms)
    correction = terms.square_().sum(dim=(1, 2)).reshape(-1)[:num_rows]
    base = plan.base_norms[start : start + num_rows] * plan.whitening.lowrank.base_scale
    sq = base - correction  # fp64: for a row close to a query the two nearly cancel
    return scores / sq.clamp_min(0).sqrt().float().clamp_min(EPS)


@dataclass
class TopRows:
    """Best (proponents) and worst (opponents) rows per score column, by row position.

    A row whose score is not finite (a damaged row: inf or NaN in it) is ranked last on both
    sides, with value -inf among the proponents and +inf among the opponents; `non_finite_rows`
    counts them and `first_non_finite` is the first one's position (-1: none)."""

    top_values: torch.Tensor  # [A, k] descending
    top_rows: torch.Tensor  # [A, k] int64
    bottom_values: torch.Tensor  # [A, k] ascending
    bottom_rows: torch.Tensor  # [A, k] int64
    non_finite_rows: int = 0
    first_non_finite: int = -1


class RunningTop:
    """Merge per-chunk top-k into a running top-k (and bottom-k) per score column."""

    def __init__(self, columns: int, k: int):
        self.k = k
        empty = torch.empty(columns, 0)
        self.top = (empty, empty.long())
        self.bottom = (empty, empty.long())
        self.non_finite_rows, self.first_non_finite = 0, -1

    def update(self, scores: torch.Tensor, start: int, positions: torch.Tensor | None = None) -> None:
        """`scores` [A, C] of rows start..start+C, or of the rows at `positions` [C]. Non-finite
        scores rank last (NaN would otherwise sort as the best)."""
        finite = torch.isfinite(scores)
        high = low = scores
        if not bool(finite.all()):
            bad = (~finite).any(0).nonzero().squeeze(1)  # [b] chunk columns of damaged rows
            rows = bad + start if positions is None else positions[bad]
            if self.first_non_finite < 0:
                self.first_non_finite = int(rows.min())
            self.non_finite_rows += len(rows)
            high = scores.masked_fill(~finite, -math.inf)
            low = scores.masked_fill(~finite, math.inf)
        self.top = self._merge(self.top, high, start, positions, largest=True)
        self.bottom = self._merge(self.bottom, low, start, positions, largest=False)

    def _merge(self, best, scores, start, positions, largest):
        k = min(self.k, scores.shape[1])
        vals, idx = scores.topk(k, dim=1, largest=largest, sorted=False)
        vals = torch.cat([best[0], vals], dim=1)
        rows = torch.cat([best[1], idx + start if positions is None else positions[idx]], dim=1)
        keep = vals.topk(min(self.k, vals.shape[1]), dim=1, largest=largest, sorted=True).indices
        return vals.gather(1, keep), rows.gather(1, keep)

    def state(self) -> dict[str, np.ndarray]:
        """What `restore` needs to continue the merge (to checkpoint a long scoring pass)."""
        return {
            "top_values": self.top[0].numpy(), "top_rows": self.top[1].numpy(),
            "bottom_values": self.bottom[0].numpy(), "bottom_rows": self.bottom[1].numpy(),
            "non_finite": np.array([self.non_finite_rows, self.first_non_finite], dtype=np.int64),
        }  # fmt: skip

    @classmethod
    def restore(cls, state: dict[str, np.ndarray], k: int) -> RunningTop:
        """A RunningTop that continues from `state` (see `state`)."""
        top = cls(int(state["top_values"].shape[0]), k)
        top.top = (torch.from_numpy(state["top_values"]), torch.from_numpy(state["top_rows"]))
        top.bottom = (torch.from_numpy(state["bottom_values"]), torch.from_numpy(state["bottom_rows"]))
        top.non_finite_rows, top.first_non_finite = (int(v) for v in state["non_finite"])
        return top

    def result(self) -> TopRows:
        return TopRows(
            self.top[0],
            self.top[1],
            self.bottom[0],
            self.bottom[1],
            self.non_finite_rows,
            self.first_non_finite,
        )


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

    `scores_out` (optional, e.g. a .npy memmap [A, N] float32) receives every score; without
    it, a plan with a `Screen` scores fp16 rows exactly only where they may reach the top k.
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

    screen = plan.screen is not None and scores_out is None
    spans = [(a, min(a + chunk_rows, source.num_rows)) for a in range(0, source.num_rows, max(chunk_rows, 1))]
    reads = FileReads.of(source, device, len(spans), workers)

    def score(chunk: int, start: int, stop: int, slot: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        if reads is not None:  # an fp32 file: timed while `reads` chooses how to read it
            began = time.perf_counter()
            way, read = reads.rows(chunk, start, stop, slot)
            scores = chunk_scores(plan, read, start)
            source.release(slot)  # inside the chunk's time: the trial compares whole costs
            reads.record(chunk, way, time.perf_counter() - began, stop - start)
            return scores, None
        rows = source.read_raw(start, stop, slot).to(device)
        scored: tuple[torch.Tensor, torch.Tensor | None]
        if screen and rows.dtype == torch.float16:
            scored = screened_chunk(plan, rows, start, top_k)
        else:
            scored = chunk_scores(plan, rows, start), None
        source.release(slot)  # a mapped chunk's pages go as soon as it is scored
        return scored

    with single_threaded_torch(workers) as pool:
        pending = deque(pool.submit(score, i, *span, i % depth) for i, span in enumerate(spans[:depth]))
        for i, (start, stop) in enumerate(spans):
            scores, positions = pending.popleft().result()
            if i + depth < len(spans):  # its slot's previous chunk has been scored
                j = i + depth
                pending.append(pool.submit(score, j, *spans[j], j % depth))
            running.update(scores, start, positions)
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
