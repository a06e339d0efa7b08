"""How query gradients are scored against index rows: one typed object every scoring path takes."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from assay.attribution.kernel import Aggregate, Mode
from assay.attribution.precondition import MIX_FRACTION
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
        if self.top_k < 1 or self.chunk_rows < 0:
            raise AssayError("--top_k must be positive and --chunk_rows >= 0")
        if self.mix is not None and not 0.0 <= self.mix <= 1.0:
            raise AssayError(f"--mix must be in [0, 1], got {self.mix}")
        if not 0 <= self.damping < math.inf or not 0.0 < self.mix_fraction <= 1.0:
            raise AssayError("--damping must be a finite number >= 0 and --mix_fraction in (0, 1]")
        if self.faiss_lists < 0 or self.faiss_probe < 1:
            raise AssayError("--faiss_lists must be >= 0 and --faiss_probe >= 1")
        if self.search == "faiss" and self.mode not in ("trackstar", "cosine"):
            raise AssayError("--search faiss gives top-k for trackstar or cosine only")
