"""bf16 (autocast) vs fp32 attribution: does mixed precision change who gets credited?

Builds the same index at fp32 and at bf16 (rows stored float32 either way), computes the same
queries at each precision, scores, and compares per query: Spearman of the scores over every
training example, and the overlap of the top-10 proponents.
Usage: python bench/bench_score_precision.py [--model assay-tiny] [--tunes 1000] [--queries 10]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np

from assay.attribution.build import BuildConfig, build_index
from assay.attribution.score import ScoreConfig, run_score
from assay.core.config import DataConfig, ModelConfig, RuntimeConfig


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    ra, rb = np.argsort(np.argsort(a)), np.argsort(np.argsort(b))
    return float(np.corrcoef(ra, rb)[0, 1])


def top_overlap(a: np.ndarray, b: np.ndarray, k: int = 10) -> float:
    return len(set(np.argsort(-a)[:k]) & set(np.argsort(-b)[:k])) / k


def scores_at(tmp: Path, precision: str, args: argparse.Namespace) -> dict[str, np.ndarray]:
    index = tmp / f"index-{precision}"
    build_index(
        BuildConfig(
            out=str(index),
            model=ModelConfig(model=args.model),
            data=DataConfig(dataset="abc-tunes", max_samples=args.tunes, max_length=args.max_length),
            runtime=RuntimeConfig(precision=precision),  # type: ignore[arg-type]
            preconditioner="trackstar",
        )
    )
    out = {}
    for mode in ("trackstar", "cosine"):
        folder = tmp / f"score-{precision}-{mode}"
        cfg = ScoreConfig(
            out=str(folder), index=str(index), query_dataset="abc-tunes", query_split="eval",
            query_filter_column="collection", query_filter_value="oneill", query_max_samples=args.queries,
            mode=mode, save_scores=True,  # type: ignore[arg-type]
        )  # fmt: skip
        run_score(cfg)
        out[mode] = np.load(folder / "scores.npy")
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="assay-tiny")
    ap.add_argument("--tunes", type=int, default=1000)
    ap.add_argument("--queries", type=int, default=10)
    ap.add_argument("--max_length", type=int, default=256)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        fp32, bf16 = (scores_at(Path(tmp), p, args) for p in ("fp32", "bf16"))
    print(f"{args.model}, {args.tunes} ABC training tunes, {args.queries} held-out O'Neill queries")
    for mode in fp32:
        rho = [spearman(a, b) for a, b in zip(fp32[mode], bf16[mode])]
        top = [top_overlap(a, b) for a, b in zip(fp32[mode], bf16[mode])]
        print(
            f"{mode:<10} Spearman min {min(rho):.4f} median {np.median(rho):.4f}; "
            f"top-10 overlap min {min(top):.2f} mean {np.mean(top):.2f}"
        )


if __name__ == "__main__":
    main()
