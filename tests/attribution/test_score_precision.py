"""bf16 (autocast) vs fp32 attribution on assay-tiny with ABC tunes: the same ranking.

Both the index and the queries are computed at each precision; statistics, the preconditioner
and the scoring are fp32/fp64 either way. Per query: Spearman of the scores over all training
tunes >= 0.99 and top-10 overlap >= 0.9 (docs/BENCHMARKS.md reports the measured figures).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from assay.attribution.build import BuildConfig, build_index
from assay.attribution.score import ScoreOptions
from assay.commands.score import DEMO_QUERIES, ScoreConfig, run_score
from assay.core.config import DataConfig, ModelConfig, RuntimeConfig

MODEL = "assay-tiny"


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    """Rank correlation (continuous scores: no ties to average)."""
    ra, rb = np.argsort(np.argsort(a)), np.argsort(np.argsort(b))
    return float(np.corrcoef(ra, rb)[0, 1])


def top_overlap(a: np.ndarray, b: np.ndarray, k: int = 10) -> float:
    return len(set(np.argsort(-a)[:k]) & set(np.argsort(-b)[:k])) / k


def compare(tmp, precisions=("fp32", "bf16"), tunes=100, queries=5, mode="trackstar"):
    scores = {}
    for precision in precisions:
        index = tmp / f"index-{precision}"
        build_index(
            BuildConfig(
                out=str(index),
                model=ModelConfig(model=MODEL),
                data=DataConfig(dataset="abc-tunes", max_samples=tunes, max_length=96),
                runtime=RuntimeConfig(precision=precision),  # type: ignore[arg-type]
                preconditioner="trackstar",
            )
        )
        out = tmp / f"score-{precision}"
        cfg = ScoreConfig(
            out=str(out), index=str(index), queries=replace(DEMO_QUERIES, query_max_samples=queries),
            options=ScoreOptions(mode=mode), save_scores=True,
        )  # fmt: skip
        run_score(cfg)
        scores[precision] = np.load(out / "scores.npy")
    a, b = (scores[p] for p in precisions)
    return [spearman(x, y) for x, y in zip(a, b)], [top_overlap(x, y) for x, y in zip(a, b)]


@pytest.mark.slow
def test_bf16_matches_fp32_ranking(tmp_path):
    rho, overlap = compare(tmp_path)
    print(f"bf16 vs fp32: Spearman min {min(rho):.4f} mean {np.mean(rho):.4f}; top-10 overlap {overlap}")
    assert min(rho) >= 0.99, rho
    assert min(overlap) >= 0.9, overlap
