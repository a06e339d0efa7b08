"""Approximate top-k with FAISS, for indexes of many millions of rows (optional: `assay[faiss]`).

Exact scoring streams the whole index once per query batch, at memory speed. When the same
index is queried again and again at many millions of rows, an inverted-file FAISS index over
the rows pays off: it is built once (cached) and each batch then probes a few lists only.

The rows must live in a space that does not depend on the queries, so with FAISS:
- trackstar scores are TrackStar's cosine with λ = 0: ⟨unit(W₀ q), unit(W₀ t)⟩ with
  W₀ = (R_train + δI)^{-1/2} (no query statistics in R; those change with every batch);
- cosine scores are ⟨unit(q), unit(t)⟩.
Inner products there are the scores, so FAISS's METRIC_INNER_PRODUCT ranks them; opponents
are the top hits of the negated queries. `--faiss_probe` equal to the number of lists makes
the search exhaustive (the tests use that to compare with the exact path).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from assay.attribution.kernel import TopRows, unit_rows
from assay.attribution.precondition import Whitening
from assay.attribution.rows import RowSource
from assay.core.console import note
from assay.core.errors import AssayError

ANN_MODES = ("trackstar", "cosine")


def require_faiss() -> Any:
    try:
        import faiss  # optional (assay[faiss]): loaded only for --search faiss
    except ImportError:
        raise AssayError("--search faiss needs FAISS: pip install 'assay[faiss]' (or faiss-cpu)") from None
    return faiss


def to_space(rows: torch.Tensor, mode: str, whitening: Whitening | None) -> np.ndarray:
    """Rows (or queries) [B, D] in the query-independent scoring space, fp32 C-contiguous."""
    if mode == "trackstar":
        assert whitening is not None and whitening.lowrank is not None
        rows = whitening.apply(rows, 1, whitening.lowrank.base)
    return np.ascontiguousarray(unit_rows(rows.float()).numpy())


def build_ann(
    source: RowSource, mode: str, whitening: Whitening | None, path: Path, lists: int, chunk_rows: int
) -> Any:
    """An IVF (flat) inner-product index over every row, trained on a sample, saved at `path`."""
    faiss = require_faiss()
    lists = lists or max(1, min(int(4 * source.num_rows**0.5), source.num_rows // 39))
    train_rows = min(source.num_rows, max(64 * lists, 10_000))
    sample = np.sort(np.random.default_rng(0).choice(source.num_rows, train_rows, replace=False))
    note(f"building a FAISS IVF index ({lists} lists) over {source.num_rows:,} rows (once; cached)")
    quantizer = faiss.IndexFlatIP(source.dim)
    ann = faiss.IndexIVFFlat(quantizer, source.dim, lists, faiss.METRIC_INNER_PRODUCT)
    picked = [source.read(int(i), int(i) + 1)[0].clone() for i in sample]
    ann.train(to_space(torch.stack(picked), mode, whitening))
    for start in range(0, source.num_rows, chunk_rows):
        stop = min(start + chunk_rows, source.num_rows)
        ann.add(to_space(source.read(start, stop), mode, whitening))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    faiss.write_index(ann, str(tmp))
    os.replace(tmp, path)
    return ann


def load_or_build_ann(
    source: RowSource, mode: str, whitening: Whitening | None, path: Path, lists: int, chunk_rows: int
) -> Any:
    if mode not in ANN_MODES:
        raise AssayError(f"--search faiss supports --mode {' or '.join(ANN_MODES)}, not {mode}")
    if path.exists():
        ann = require_faiss().read_index(str(path))
        if ann.ntotal == source.num_rows and ann.d == source.dim:
            return ann
    return build_ann(source, mode, whitening, path, lists, chunk_rows)


def search_ann(
    ann: Any,
    source: RowSource,
    queries: torch.Tensor,
    mode: str,
    whitening: Whitening | None,
    aggregate: str,
    top_k: int,
    probe: int,
) -> TopRows:
    """Top and bottom rows per query (or for the mean query / best over queries)."""
    ann.nprobe = max(1, min(probe, ann.nlist))
    q = torch.from_numpy(to_space(queries, mode, whitening))  # [Q, D]
    if aggregate == "mean":
        q = q.mean(dim=0, keepdim=True)
    k = min(top_k, ann.ntotal)
    found = []
    for sign in (1.0, -1.0):
        values, rows = ann.search(np.ascontiguousarray(sign * q.numpy()), k)
        found.append((torch.from_numpy(sign * values), torch.from_numpy(rows).long()))
    if aggregate == "max":
        return _best_over_queries(source, q, mode, whitening, found, k)
    (tv, tr), (bv, br) = found
    return TopRows(tv, tr, bv, br)


def _best_over_queries(source, q, mode, whitening, found, k) -> TopRows:
    """--aggregate max: rescore every candidate row against all queries, keep its best score.

    The top-k by max is exact given each query's own top-k (a row best for query q* but outside
    q*'s top-k is beaten by k rows whose max is at least as high); the bottom-k by max is
    approximate (candidates come from each query's bottom hits).
    """
    out = []
    for largest, (_, rows) in zip((True, False), found):
        cand = sorted({int(r) for r in rows.flatten().tolist() if r >= 0})
        vecs = torch.from_numpy(
            to_space(torch.cat([source.read(r, r + 1).clone() for r in cand]), mode, whitening)
        )
        best = (vecs @ q.T).max(dim=1).values  # [candidates]
        vals, idx = best.topk(min(k, len(cand)), largest=largest)
        out.append((vals[None], torch.tensor(cand)[idx][None]))
    (tv, tr), (bv, br) = out
    return TopRows(tv, tr, bv, br)
