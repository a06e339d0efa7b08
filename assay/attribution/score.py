"""Scoring query gradients against a gradient index (TrackStar and the other modes).

The queries' gradients are computed with exactly the index's settings (model, adapter, modules,
projection, normalizer, precision: `query_gradients`); the index is then streamed in chunks and
scored against them (`score_index`; the arithmetic is kernel.py's, see docs/attribution.md).
Per-row numbers the fast paths need are cached per index build in the assay cache.
"""

from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from assay.attribution.ann import load_or_build_ann, search_ann
from assay.attribution.build import GradientSetup, collect
from assay.attribution.collector import Objective
from assay.attribution.index import GradientIndex, check_tokenizer, index_fingerprint, segments
from assay.attribution.kernel import TopRows, half_gemm_is_exact_enough, plan_queries, score_rows
from assay.attribution.kfac import precondition_rows, projected_curvature
from assay.attribution.options import ScoreOptions, check_scores_out, gradient_rows, score_options
from assay.attribution.precondition import Whitening, build_whitening, second_moment_sums
from assay.attribution.projection import Projector
from assay.attribution.rows import ArrayRows, base_sq_norms, row_norms
from assay.core.config import DataConfig
from assay.core.console import note, warn
from assay.core.distributed import Distributed
from assay.core.errors import AssayError
from assay.core.paths import cache_dir
from assay.core.progress import Progress
from assay.core.runs import DONE_FILE
from assay.lm.data import ID_COLUMN, Examples, load_table, texts_of


def check_compatible(index: GradientIndex, setup: GradientSetup) -> None:
    """Refuse a model, tokenizer, projection or module set other than the index's (one line)."""
    meta = index.meta
    if (setup.fingerprint or index_fingerprint(setup.model, meta)) != meta["model"]["fingerprint"]:
        raise AssayError(
            f"the model differs from the one {index.path} was built with ({meta['model']['name']})"
        )
    check_tokenizer(meta, setup.tokenizer, index.path)
    if (setup.projector.dim, setup.projector.seed) != (meta["projection_dim"], meta["projection_seed"]):
        raise AssayError(
            f"projection p={setup.projector.dim} seed={setup.projector.seed} differs from the index's "
            f"(p={meta['projection_dim']}, seed={meta['projection_seed']})"
        )
    if list(setup.modules) != list(index.modules):
        raise AssayError(
            f"the gradient modules differ from the {len(index.modules)} the index was built with"
        )


def whitening_for(
    index: GradientIndex, queries: torch.Tensor, mode: str, mix: float | None, damping: float, fraction: float
) -> Whitening | None:
    """TrackStar's R^(-1/2) from the index's saved statistics (or a pass over its rows) and the queries."""
    if mode not in ("trackstar", "influence"):
        return None
    factors = index.kfac_factors() if mode == "influence" else None
    if factors is not None:  # the index's K-FAC/EK-FAC curvature, projected exactly onto its rows
        projector = Projector(int(index.meta["projection_dim"]), int(index.meta["projection_seed"]))
        curvature = projected_curvature(factors, projector)
        return build_whitening(curvature, 1, None, index.modules, 0.0, damping, fraction)
    try:
        sums, count = index.preconditioner_stats()
    except AssayError:
        note(f"{index.path} has no saved preconditioner statistics: computing them from all its rows")
        sums, count = stream_moment_sums(index, 8192), len(index)
    if mode == "influence" and mix is None:
        mix = 0.0  # influence functions use the training Hessian
    return build_whitening(sums, count, queries, index.modules, mix, damping, fraction)


def stream_moment_sums(index: GradientIndex, chunk_rows: int) -> dict[str, torch.Tensor]:
    """Per-module Σ g gᵀ (fp64) over every index row, streamed in chunks."""
    source = ArrayRows(index.gradients)
    sums: dict[str, torch.Tensor] = {}
    for start in range(0, source.num_rows, chunk_rows):
        part = second_moment_sums(source.read(start, min(start + chunk_rows, source.num_rows)), index.modules)
        sums = {n: sums.get(n, 0) + s for n, s in part.items()}  # type: ignore[misc]
    return sums


CHUNK_MIB = 64


def auto_chunk_rows(dim: int, mib: int = CHUNK_MIB) -> int:
    """Rows per chunk, `mib` MiB of fp32: few mappings, thread hand-offs and top-k merges.

    Each chunk costs a fixed amount besides its rows; against 32 MiB chunks, 64 MiB ones scored
    the screened fp16 modes and the fp32 inner product 1.15–1.5× faster for 50–100 MiB more
    resident memory (`bench/bench_score.py --chunk_mib 32 64`, docs/BENCHMARKS.md). The
    arithmetic still runs on cache-sized blocks within the chunk (kernel.BLOCK_BYTES).
    """
    return max(64, (mib << 20) // (4 * dim))


def index_cache_path(index: GradientIndex, kind: str, key: str, suffix: str) -> Path:
    """A file in the assay cache tied to this index build (folder, finish time, model) and `key`."""
    done = index.path / DONE_FILE
    stamp = done.read_text() if done.exists() else ""
    model = index.meta["model"]["fingerprint"]
    ident = "|".join(str(p) for p in (index.path.resolve(), model, len(index), stamp, key))
    return cache_dir() / kind / (hashlib.sha256(ident.encode()).hexdigest()[:24] + suffix)


def cached_base_norms(index: GradientIndex, whitening: Whitening, chunk_rows: int) -> np.ndarray:
    """[N] ‖(R_train + δI)^{-1/2} t‖² per row, computed once per index and damping and cached.

    The key covers the index folder, its finish time (a rebuilt index gets a new one), the
    model, the statistics and the damping. Without a writable cache it is computed each time.
    """
    assert whitening.lowrank is not None
    source = ArrayRows(index.gradients)
    return _cached_per_row(
        index, "score-norms", whitening.lowrank.key, "each index row's whitened norm",
        lambda: base_sq_norms(source, whitening, chunk_rows),
    )  # fmt: skip


def index_row_norms(index: GradientIndex, mode: str, cache: bool, chunk_rows: int) -> np.ndarray | None:
    """[N] ‖t‖ per row where a mode uses them: cosine divides by them, and inner, influence and
    cosine screen an fp16 index's rows with them (kernel.Screen). From the index's norms.npy;
    for an index built before it, computed once and cached when screening needs them."""
    screens = index.gradients.dtype == np.float16 and half_gemm_is_exact_enough()
    if mode not in ("inner", "influence", "cosine") or (mode != "cosine" and not screens):
        return None
    if index.row_norms is not None:
        return index.row_norms
    if not (cache and screens):
        return None  # cosine computes each row's norm as it goes
    source = ArrayRows(index.gradients)
    return _cached_per_row(
        index, "row-norms", "l2", "each index row's norm", lambda: row_norms(source, chunk_rows)
    )


def _cached_per_row(
    index: GradientIndex, kind: str, key: str, what: str, compute: Callable[[], np.ndarray]
) -> np.ndarray:
    """An [N] array about the index's rows, from the assay cache or computed and cached."""
    path = index_cache_path(index, kind, key, ".npy")
    if path.exists():
        cached = np.load(path, allow_pickle=False)
        if cached.shape == (len(index),):
            return cached
    note(f"computing {what} once (cached for later runs)")
    values = compute()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp.npy")
        np.save(tmp, values)
        os.replace(tmp, path)
    except OSError as e:
        note(f"could not cache {what} ({e}); it will be recomputed next time")
    return values


def faiss_top(
    index: GradientIndex, queries: torch.Tensor, cfg: ScoreOptions
) -> tuple[TopRows, Whitening | None]:
    """Approximate top/bottom rows through a cached FAISS index (see ann.py: trackstar uses λ = 0)."""
    whitening = whitening_for(index, queries, cfg.mode, 0.0, cfg.damping, cfg.mix_fraction)
    key = f"{cfg.mode}|{whitening.lowrank.key if whitening and whitening.lowrank else ''}|{cfg.faiss_lists}"
    path = index_cache_path(index, "faiss", key, ".faiss")
    source = ArrayRows(index.gradients)
    chunk = cfg.chunk_rows or auto_chunk_rows(index.dim)
    ann = load_or_build_ann(source, cfg.mode, whitening, path, cfg.faiss_lists, chunk)
    top = search_ann(ann, source, queries, cfg.mode, whitening, cfg.aggregate, cfg.top_k, cfg.faiss_probe)
    return top, whitening


def score_index(
    index: GradientIndex,
    queries: torch.Tensor | np.ndarray,
    options: ScoreOptions | None = None,
    scores_out: np.ndarray | None = None,
) -> tuple[TopRows, Whitening | None]:
    """Score query gradients [Q, D] (computed like the index's rows) against every index row.

    `queries` is a float tensor or numpy array [Q, D], or one query [D] (scored as [1, D]); a
    NaN or inf in it is refused, as are a wrong shape and a `scores_out` that does not fit, before
    any work. `scores_out`, a writable float32 array [A, N] (A = Q, or 1 when aggregated),
    receives every score (exact search only).
    trackstar with few queries (Q ≤ d_m/4) and `cache_norms` takes each row's ‖W t‖ from the
    Woodbury form and a per-index cache, so the pass over the index is a plain streamed GEMM.
    inner, influence and cosine on an fp16 index (without `scores_out`) screen the rows with a
    half-precision GEMM and score exactly only those that may reach the top k (kernel.Screen).
    """
    o = score_options(options)
    queries = gradient_rows(queries, index.dim)
    check_scores_out(scores_out, queries.shape[0] if o.aggregate == "none" else 1, len(index))
    if o.search == "faiss":
        if scores_out is not None:
            raise AssayError("--search faiss gives top-k only; drop --save_scores or use --search exact")
        return faiss_top(index, queries, o)
    chunk_rows = o.chunk_rows or auto_chunk_rows(index.dim)
    mode = o.mode
    if mode == "influence" and index.meta["projection_dim"] == 0 and index.kfac_factors() is not None:
        queries, mode = raw_curvature_queries(index, queries, o.damping), "inner"  # exact: no projection
    whitening = whitening_for(index, queries, mode, o.mix, o.damping, o.mix_fraction)
    base = None
    smallest = min(sl.stop - sl.start for sl in index.modules.values())
    if mode == "trackstar" and o.cache_norms and whitening is not None and whitening.lowrank is not None:
        if 4 * queries.shape[0] <= smallest:
            base = cached_base_norms(index, whitening, chunk_rows)
    norms = index_row_norms(index, mode, o.cache_norms, chunk_rows)
    plan = plan_queries(queries, mode, o.aggregate, whitening, base, norms)
    with Progress(len(index), "score", unit="row") as bar:
        top = score_rows(ArrayRows(index.gradients), plan, o.top_k, scores_out, chunk_rows, bar.set_done)
    warn_non_finite(top, index.ids, str(index.path), "the index is damaged, rebuild it")
    return top, whitening


def warn_non_finite(top: TopRows, ids: np.ndarray, source: str, cause: str) -> None:
    """One line when some rows scored inf/NaN: they are ranked last and `top_records` leaves them out."""
    if top.non_finite_rows:
        first = int(ids[top.first_non_finite])
        warn(
            f"{source}: {top.non_finite_rows} rows score inf/NaN (first: id {first}); "
            f"they are ranked last and left out of the results: {cause}"
        )


def raw_curvature_queries(index: GradientIndex, queries: torch.Tensor, damping: float) -> torch.Tensor:
    """[Q, D] (H + δ)⁻¹ g_q with the index's K-FAC/EK-FAC factors, for an index of raw (unprojected)
    rows: the plain inner product with its rows is then exactly the influence."""
    factors = index.kfac_factors()
    assert factors is not None
    return precondition_rows(queries, factors, Projector(0, 0), damping=damping).to(torch.float32)


def query_gradients(
    setup: GradientSetup, examples: Examples, token_batch_size: int, objective: Objective | None = None
) -> torch.Tensor:
    """[Q, D] fp32 gradients of `objective` (default: each example's loss) on the query examples,
    computed exactly as the index's rows were. Under torchrun each rank computes every
    world-th query and all ranks get them all."""
    dist = Distributed.current()
    mine = dist.interleave_array(np.arange(len(examples)))
    share = examples.subset(mine) if dist.active else examples
    rows = collect(setup, share, token_batch_size, objective)  # [len(mine), D] fp32
    grads = _assemble(dist.gather((mine, rows)), len(examples))
    finite = np.isfinite(grads).all(axis=1)
    if not finite.all():
        first = int(np.flatnonzero(~finite)[0])
        raise AssayError(
            f"query {first} (0-based, in order) has a non-finite gradient (inf/NaN) at {setup.policy.name}; "
            "check its text, or rebuild the index with --precision fp32"
        )
    return torch.from_numpy(grads)


def _assemble(parts: list[tuple[np.ndarray, np.ndarray]], n: int) -> np.ndarray:
    """[n, D] rows from the ranks' (positions, rows) shares."""
    out = np.zeros((n, parts[0][1].shape[1]), dtype=np.float32)
    for positions, rows in parts:
        out[positions] = rows
    return out


def top_records(ids: np.ndarray, query_ids: list[Any], top: TopRows, aggregate: str) -> list[dict]:
    """One record per score column: proponents and opponents as [train_id, score] pairs, `ids`
    [N] the example id of each row position (an index's `ids`)."""
    names = query_ids if aggregate == "none" else [aggregate]
    records = []
    for col, name in enumerate(names):
        record: dict[str, Any] = {"query": name}
        if aggregate != "none":
            record["queries"] = query_ids
        for key, rows, values in (
            ("proponents", top.top_rows, top.top_values),
            ("opponents", top.bottom_rows, top.bottom_values),
        ):
            record[key] = [  # non-finite: rows ranked last (`warn_non_finite` said so)
                [int(ids[r]), float(v)]
                for r, v in zip(rows[col].tolist(), values[col].tolist())
                if math.isfinite(v)
            ]
        records.append(record)
    return records


def train_texts(index: GradientIndex, ids: set[int]) -> dict[int, str]:
    """Texts of the given training ids, read through the saved data config of the segment of the
    index that holds each ({} for a dataset that can no longer be loaded; ids the index does not
    hold are looked for in its first dataset)."""
    rows = np.flatnonzero(np.isin(index.ids, np.fromiter(ids, dtype=np.int64, count=len(ids))))
    row_of = {int(index.ids[r]): int(r) for r in rows}
    texts: dict[int, str] = {}
    for k, seg in enumerate(segments(index.meta)):
        start, stop = seg["rows"]
        mine = {i for i in ids if start <= row_of.get(i, -1) < stop or (k == 0 and i not in row_of)}
        if mine:
            texts.update(dataset_texts(DataConfig(**seg["data"]), mine, int(seg["id_offset"])))
    return texts


def dataset_texts(data_cfg: DataConfig, ids: set[int], offset: int = 0) -> dict[int, str]:
    """{id: text} of the examples whose source row id plus `offset` is in `ids`."""
    try:
        table = load_table(data_cfg)
    except AssayError as e:
        note(f"training texts unavailable ({e}); showing ids only")
        return {}
    positions = [i for i, v in enumerate(table[ID_COLUMN]) if int(v) + offset in ids]
    subset = table.select(positions)
    texts = dict(zip((int(v) + offset for v in subset[ID_COLUMN]), texts_of(subset, data_cfg)))
    missing = sorted(ids - texts.keys())
    if missing:
        note(
            f"{len(missing)} training ids (first: {missing[0]}) are not in {data_cfg.dataset!r} "
            f"(split {data_cfg.split!r}, {len(table)} rows) as it loads now: the dataset changed since the "
            "index was built, or the index is damaged; their texts are left out"
        )
    return texts
