"""How query gradients are scored against index rows: one typed object every scoring path takes,
and the checks every scoring path makes of its queries and output before any work."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch

from assay.attribution.kernel import Aggregate, Mode
from assay.attribution.precondition import MIX_FRACTION
from assay.core.config import require_config
from assay.core.errors import AssayError


@dataclass
class ScoreOptions:
    """How query gradients are scored against the rows of an index."""

    mode: Mode = "trackstar"
    """trackstar: cosine after R^(-1/2) on both sides; cosine: raw gradient cosine; inner: raw
    inner product; influence: <g_query, H^(-1) g_train> without unit normalisation (H: the index's
    K-FAC/EK-FAC curvature when it was built with one, else the projected R)."""
    aggregate: Aggregate = "none"
    """none: one column per query; mean: the mean query (mean of the scores); max: best query."""
    top_k: int = 10
    """Proponents and opponents kept per query (or aggregate)."""
    mix: float | None = None
    """λ in R = λ·R_query + (1-λ)·R_train. Default: TrackStar's automatic rule (trackstar mode),
    0 (the training R alone) in influence mode."""
    mix_fraction: float = MIX_FRACTION
    """Fraction of the query statistics' rank the automatic λ down-weights (TrackStar: 1000 of
    65,536 dimensions, with full-rank query statistics)."""
    damping: float = 0.1
    """Added to R_train's eigenvalues before mixing, as a multiple of their mean (per module)."""
    chunk_rows: int = 0
    """Index rows scored per chunk (0: ~64 MiB of fp32 rows; the arithmetic runs on cache-sized
    blocks within it)."""
    cache_norms: bool = True
    """Cache per-row numbers the fast paths need (in the assay cache), computed on first use:
    trackstar with few queries, each row's whitened norm under the training statistics; inner,
    influence and cosine on an fp16 index without norms.npy (built before it existed), each
    row's norm."""
    search: Literal["exact", "faiss"] = "exact"
    """exact: stream every row (default). faiss: an approximate IVF index, built once per index
    and cached, for many millions of rows (needs `assay[faiss]`; trackstar then uses λ = 0)."""
    faiss_lists: int = 0
    """FAISS inverted lists (0: about 4·sqrt(N))."""
    faiss_probe: int = 16
    """Lists searched per query (more: closer to exact, slower)."""

    def __post_init__(self) -> None:
        if self.top_k < 1:
            raise AssayError(f"--top_k must be positive, got {self.top_k}")
        if self.chunk_rows < 0:
            raise AssayError(f"--chunk_rows must be >= 0 (0: automatic), got {self.chunk_rows}")
        if self.mix is not None and not 0.0 <= self.mix <= 1.0:
            raise AssayError(f"--mix must be in [0, 1], got {self.mix}")
        if not 0 <= self.damping < math.inf or not 0.0 < self.mix_fraction <= 1.0:
            raise AssayError("--damping must be a finite number >= 0 and --mix_fraction in (0, 1]")
        if self.faiss_lists < 0 or self.faiss_probe < 1:
            raise AssayError("--faiss_lists must be >= 0 and --faiss_probe >= 1")
        if self.search == "faiss" and self.mode not in ("trackstar", "cosine"):
            raise AssayError("--search faiss gives top-k for trackstar or cosine only")


def score_options(options: Any) -> ScoreOptions:
    """`options`, or the defaults for None (one line for anything else)."""
    if options is None:
        return ScoreOptions()
    require_config(options, ScoreOptions, "options")
    return options


def gradient_rows(rows: Any, dim: int, what: str = "query") -> torch.Tensor:
    """[Q, dim] gradients from a tensor or numpy array of floats ([dim]: one row), or one line
    saying what is wrong with them: a NaN or inf would fail R's eigendecomposition or make every
    score non-finite, far from its cause."""
    if isinstance(rows, np.ndarray) and rows.dtype.kind == "f":
        rows = torch.from_numpy(np.ascontiguousarray(rows))
    if not isinstance(rows, torch.Tensor) or not rows.is_floating_point():
        got = f"{type(rows).__name__} of {rows.dtype}" if hasattr(rows, "dtype") else type(rows).__name__
        raise AssayError(f"{what} gradients must be a float tensor or numpy array [Q, {dim}], not a {got}")
    rows = rows.detach()  # rows that require grad (a user's own) cannot become the numpy the kernel reads
    if rows.ndim == 1:
        rows = rows[None]
    if rows.ndim != 2 or rows.shape[1] != dim:
        raise AssayError(
            f"{what} gradients must be [Q, {dim}] (or one row [{dim}]), got shape {list(rows.shape)}: "
            "compute them with the same modules and projection"
        )
    if rows.shape[0] == 0:
        raise AssayError(f"no {what} gradients to score: the {what} set is empty")
    finite = torch.isfinite(rows).all(dim=1)
    if not bool(finite.all()):
        first = int(torch.nonzero(~finite)[0, 0])
        raise AssayError(f"{what} gradient {first} (0-based) holds inf/NaN; recompute it (e.g. at fp32)")
    return rows


def check_scores_out(scores_out: Any, columns: int, rows: int) -> None:
    """Refuse a `scores_out` that is not a writable float32 array [columns, rows] (None: fine)."""
    if scores_out is None:
        return
    shape = list(getattr(scores_out, "shape", ()))
    if not (
        isinstance(scores_out, np.ndarray)
        and scores_out.dtype == np.float32
        and shape == [columns, rows]
        and scores_out.flags.writeable
    ):
        got = (
            f"{scores_out.dtype} {shape}" if isinstance(scores_out, np.ndarray) else type(scores_out).__name__
        )
        raise AssayError(
            f"scores_out must be a writable float32 numpy array [A, N] = [{columns}, {rows}] (A: the "
            f"queries, or 1 when aggregated; N: the index's rows), not {got}"
        )
