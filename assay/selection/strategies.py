"""Selection strategies by name, and the gradient features the coverage strategies read.

Two kinds:
- score strategies rank the pool by one number per example and keep the top (or bottom) k:
  random, loss, gradcos, trackstar. Against the pool itself as the query (coreset selection)
  the gradient ones rank by *typicality*, so a small selection fills with the dominant group.
- coverage strategies spread the selection over the pool's gradient features (coverage.py,
  facility.py): facility (CRAIG, with per-example weights), kcenter, balanced, typiclust.

Coverage features: `whitened` (default) are the index rows in TrackStar's whitened space,
W = (R_train + δI)^(-1/2) per module, unit-normalised, so that no direction with large gradient
variance (a few long or high-loss examples) dominates the distances; `raw` are the stored rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import torch

from assay.attribution.index import GradientIndex
from assay.attribution.kernel import ArrayRows
from assay.attribution.precondition import MIX_FRACTION
from assay.attribution.score import auto_chunk_rows, whitening_for

StrategyName = Literal[
    "random", "loss", "gradcos", "trackstar", "facility", "kcenter", "balanced", "typiclust"
]
Features = Literal["whitened", "raw"]
WithinName = Literal["random", "loss", "gradcos", "trackstar"]


@dataclass(frozen=True)
class Strategy:
    """How a named strategy chooses: by a score (top k) or by covering the gradient features."""

    kind: Literal["score", "coverage"]
    needs_index: bool
    summary: str
    seeded: bool = False
    """The selection is itself a random draw (another seed chooses other examples), so its worth
    is an expectation over seeds, as random selection's is."""


STRATEGIES: dict[str, Strategy] = {
    "random": Strategy(
        "score", False, "seeded uniform scores: the baseline every strategy must beat", seeded=True
    ),
    "loss": Strategy("score", False, "mean token loss under the model (high loss = most to learn)"),
    "gradcos": Strategy("score", True, "raw gradient cosine with the queries (the mean over queries)"),
    "trackstar": Strategy("score", True, "TrackStar: cosine after R^(-1/2) whitening, mean over queries"),
    "facility": Strategy("coverage", True, "greedy facility location (CRAIG) with per-example weights"),
    "kcenter": Strategy(
        "coverage", True, "greedy k-center: each pick the example farthest from all picks", seeded=True
    ),
    "balanced": Strategy(
        "coverage", True, "k-means clusters, each kept in proportion to its size", seeded=True
    ),
    "typiclust": Strategy(
        "coverage", True, "TypiClust: a k-means cluster per kept example, its densest", seeded=True
    ),
}


def seeded(row: str) -> bool:
    """Whether a selection named `strategy` or `strategy_precision` is a random draw."""
    return STRATEGIES[row.partition("_")[0]].seeded


GRADIENT_MODES = {"gradcos": "cosine", "trackstar": "trackstar"}
FEATURES_FILE = "features.npy"


def gradient_features(
    index: GradientIndex, features: Features, folder: Path, damping: float = 0.1
) -> np.ndarray:
    """[N, D] the rows coverage strategies read: the index's own (raw) or whitened and unit-normalised
    rows, written chunk by chunk to FOLDER/features.npy (in the index's store dtype: unit rows fit
    fp16) and returned memory-mapped, so a pool larger than memory is never held whole."""
    if features == "raw":
        return index.gradients
    empty = torch.zeros(0, index.dim)
    whitening = whitening_for(index, empty, "trackstar", 0.0, damping, MIX_FRACTION)
    assert whitening is not None
    path = folder / FEATURES_FILE
    out = np.lib.format.open_memmap(path, mode="w+", dtype=index.gradients.dtype, shape=index.gradients.shape)
    source = ArrayRows(index.gradients)
    step = auto_chunk_rows(index.dim)
    for start in range(0, len(index), step):
        rows = source.read(start, min(start + step, len(index)))  # [n, D] fp32
        white = whitening.apply(rows)  # [n, D] fp32: W x per module
        white /= white.norm(dim=1, keepdim=True).clamp_min(1e-30)
        out[start : start + len(white)] = white.numpy().astype(out.dtype)
    out.flush()
    del out
    return np.load(path, mmap_mode="r", allow_pickle=False)
