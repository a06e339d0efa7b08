"""`assay filter`: choose training examples by a score, for coreset or targeted selection.

Strategies (every one writes a score per pool example; the selection is the top scores, or
the bottom ones with --lowest):

- random:    seeded uniform scores (the baseline every other strategy must beat);
- loss:      the example's mean token loss under the model (high loss = most to learn);
- gradcos:   raw gradient cosine with the query (no normalizer, no preconditioner);
- trackstar: TrackStar's cosine after R^(-1/2) whitening on both sides.

Queries: `--query eval` scores each pool example against the MEAN of the query set's unit
(whitened) gradients, i.e. the mean of its per-query scores (targeted selection, as LESS);
`--query self` uses the pool itself as the query set (coreset selection: each example's
agreement with the average direction of the whole set, the reference's "query over the
entire dataset"). Gradient strategies read an index from --index, or build one into
OUT/index from --model/--dataset (with TrackStar's preconditioner statistics).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
import tyro

from assay.attribution.build import BuildConfig, build_index, setup_from_index
from assay.attribution.index import GradientIndex, open_index
from assay.attribution.score import ScoreOptions, check_compatible, query_gradients, score_index
from assay.core.config import DataConfig, ModelConfig, QueryConfig, RuntimeConfig
from assay.core.console import note
from assay.core.distributed import Distributed
from assay.core.errors import AssayError
from assay.core.runs import run_folder, write_json
from assay.lm.data import ID_COLUMN, load_table
from assay.lm.queries import load_queries
from assay.training.evaluate import mean_token_loss

Strategy = Literal["random", "loss", "gradcos", "trackstar"]
STRATEGIES: tuple[str, ...] = ("random", "loss", "gradcos", "trackstar")
GRADIENT_MODES = {"gradcos": "cosine", "trackstar": "trackstar"}


@dataclass
class FilterConfig:
    """Select --num_examples (or --fraction) training examples by a score."""

    out: tyro.conf.Positional[str]
    """Output folder: selection.jsonl (id, score, rank), selected_ids.txt, scores.npy, ids.npy."""
    model: tyro.conf.OmitArgPrefixes[ModelConfig] = field(default_factory=ModelConfig)
    data: tyro.conf.OmitArgPrefixes[DataConfig] = field(default_factory=DataConfig)
    runtime: tyro.conf.OmitArgPrefixes[RuntimeConfig] = field(default_factory=RuntimeConfig)
    strategy: Strategy = "trackstar"
    """random | loss (mean token loss) | gradcos (raw gradient cosine) | trackstar."""
    query: Literal["self", "eval"] = "self"
    """self: the pool is its own query (coreset); eval: a query dataset (targeted selection)."""
    queries: tyro.conf.OmitArgPrefixes[QueryConfig] = field(default_factory=QueryConfig)
    num_examples: int | None = None
    """How many examples to keep."""
    fraction: float | None = None
    """Or: which fraction of the pool to keep (0-1]."""
    lowest: bool = False
    """Keep the lowest scores instead of the highest (the other tail)."""
    index: str | None = None
    """A gradient index of the pool (`assay build`); without it gradient strategies build one in OUT/index."""
    projection_dim: int = 16
    """Projection width per side when building an index here."""
    token_batch_size: int = 2048
    """Most tokens per batch for gradients and losses."""
    overwrite: bool = False
    """Replace a finished run in OUT."""

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise AssayError(f"unknown --strategy {self.strategy!r}; choose one of {', '.join(STRATEGIES)}")
        if (self.num_examples is None) == (self.fraction is None):
            raise AssayError("give exactly one of --num_examples and --fraction")
        if self.num_examples is not None and self.num_examples < 1:
            raise AssayError(f"--num_examples must be >= 1, got {self.num_examples}")
        if self.fraction is not None and not 0.0 < self.fraction <= 1.0:
            raise AssayError(f"--fraction must be in (0, 1], got {self.fraction}")
        if self.query == "eval" and not self.queries.given and self.strategy in GRADIENT_MODES:
            raise AssayError("--query eval needs the query set: --query_dataset DATASET (and --query_split)")


def selection_size(cfg: FilterConfig, pool: int) -> int:
    """How many to keep; more than the pool holds is an error, not a silent clamp."""
    k = cfg.num_examples if cfg.num_examples is not None else max(1, round(cfg.fraction * pool))  # type: ignore[operator]
    if k > pool:
        raise AssayError(f"--num_examples {k} is more than the {pool} examples in the pool")
    return int(k)


def select_top(ids: np.ndarray, scores: np.ndarray, k: int, lowest: bool = False) -> np.ndarray:
    """Positions of the k highest (or lowest) scores; ties broken by id, so it is deterministic."""
    key = scores if lowest else -scores
    order = np.lexsort((ids, key))
    return order[:k]


def random_scores(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng([seed, 7919]).random(n)


def mean_token_losses(index: GradientIndex) -> np.ndarray:
    """[N] mean loss per token from the index's summed losses (no extra forward pass)."""
    return np.asarray(index.losses, np.float64) / np.maximum(np.asarray(index.token_counts, np.float64), 1)


def model_token_losses(cfg: FilterConfig) -> tuple[np.ndarray, np.ndarray]:
    """(ids, [N] mean token loss) computed with the model, when no index is given."""
    result = mean_token_loss(cfg.model, cfg.data, cfg.runtime, cfg.token_batch_size)
    return result["ids"], result["losses"] / np.maximum(result["tokens"], 1)


def pool_ids(cfg: FilterConfig) -> np.ndarray:
    return np.asarray(load_table(cfg.data)[ID_COLUMN], dtype=np.int64)


def build_index_here(cfg: FilterConfig, folder: Path) -> GradientIndex:
    """Build (or resume) an index of the pool with TrackStar statistics in OUT/index."""
    target = folder / "index"
    if not (target / "run.json").exists():
        note(f"building a gradient index of the pool in {target}")
        build_index(
            BuildConfig(
                out=str(target),
                model=cfg.model,
                data=cfg.data,
                runtime=cfg.runtime,
                projection_dim=cfg.projection_dim,
                token_batch_size=cfg.token_batch_size,
                preconditioner="trackstar",
            )
        )
    return open_index(target)


def query_gradients_of(cfg: FilterConfig, index: GradientIndex) -> torch.Tensor:
    """[Q, D] fp32 query gradients: the pool's own rows (self) or the query set's, computed like the index."""
    if cfg.query == "self":
        return torch.from_numpy(np.array(index.gradients, dtype=np.float32))  # a copy, not the memmap
    setup = setup_from_index(index, cfg.runtime.device)
    check_compatible(index, setup)
    queries = load_queries(cfg.queries, int(index.meta["data"]["max_length"]), setup.tokenizer)
    note(f"query set: {len(queries.ids)} examples")
    return query_gradients(setup, queries.examples, cfg.token_batch_size)


def gradient_scores(cfg: FilterConfig, index: GradientIndex) -> np.ndarray:
    """[N] mean score of each index row against the queries (gradcos or trackstar)."""
    queries = query_gradients_of(cfg, index)
    out = np.zeros((1, len(index)), dtype=np.float32)
    options = ScoreOptions(mode=GRADIENT_MODES[cfg.strategy], aggregate="mean", top_k=1)  # type: ignore[arg-type]
    score_index(index, queries, options, scores_out=out)
    return out[0].astype(np.float64)


def compute_scores(cfg: FilterConfig, folder: Path) -> tuple[np.ndarray, np.ndarray, dict[str, Any]]:
    """(pool ids [N], scores [N], details) for the chosen strategy.

    Under torchrun every rank joins the index build (the costly part, rank-aware); rank 0 alone
    scores (cheap next to the gradients) and every rank gets its scores.
    """
    index = open_index(cfg.index) if cfg.index else None
    details: dict[str, Any] = {}
    if index is None and cfg.strategy in GRADIENT_MODES:
        index = build_index_here(cfg, folder)
        details["index"] = str(Path(cfg.out) / "index")  # where it will be once OUT is finished
    return Distributed.current().main_only(_scores, cfg, index, details)


def _scores(
    cfg: FilterConfig, index: GradientIndex | None, details: dict[str, Any]
) -> tuple[np.ndarray, np.ndarray, dict[str, Any]]:
    """The strategy's scores of the pool, computed in this process (no collectives)."""
    if cfg.strategy == "random":
        ids = index.ids if index is not None else pool_ids(cfg)
        return np.asarray(ids, np.int64), random_scores(len(ids), cfg.runtime.seed), {}
    if cfg.strategy == "loss":
        if index is not None:
            return np.asarray(index.ids, np.int64), mean_token_losses(index), {"index": str(index.path)}
        ids, losses = model_token_losses(cfg)
        return np.asarray(ids, np.int64), losses, {}
    assert index is not None  # compute_scores built one
    details = {"index": str(index.path), **details, "precision": index.meta["precision"]}
    return np.asarray(index.ids, np.int64), gradient_scores(cfg, index), details


def write_selection(folder: Path, ids: np.ndarray, scores: np.ndarray, chosen: np.ndarray) -> None:
    """selection.jsonl (rank order), selected_ids.txt, and every pool score (ids.npy, scores.npy)."""
    with open(folder / "selection.jsonl", "w") as f:
        for rank, pos in enumerate(chosen):
            f.write(json.dumps({"id": int(ids[pos]), "score": float(scores[pos]), "rank": rank}) + "\n")
    (folder / "selected_ids.txt").write_text("".join(f"{int(ids[p])}\n" for p in chosen))
    np.save(folder / "ids.npy", ids.astype(np.int64))
    np.save(folder / "scores.npy", scores.astype(np.float64))


def select(cfg: FilterConfig) -> dict[str, Any]:
    """Score the pool, keep the top (or bottom) k, write them with their scores (rank 0 writes)."""
    with run_folder(cfg.out, "filter", cfg, cfg.overwrite) as run:
        ids, scores, details = compute_scores(cfg, run.path)
        k = selection_size(cfg, len(ids))
        if not np.isfinite(scores).all():
            raise AssayError(f"{cfg.strategy} produced non-finite scores; check the model and the index")
        chosen = select_top(ids, scores, k, cfg.lowest)
        if Distributed.current().is_main:
            write_selection(run.path, ids, scores, chosen)
        summary = {
            "strategy": cfg.strategy,
            "query": cfg.query,
            "lowest": cfg.lowest,
            "num_selected": k,
            "pool_size": len(ids),
            "score_range": [float(scores[chosen].min()), float(scores[chosen].max())],
            **details,
        }
        if Distributed.current().is_main:
            write_json(run.path / "summary.json", summary)
    return summary


def read_selection(folder: str | Path) -> np.ndarray:
    """The selected ids of a finished `assay filter` run, in rank order."""
    path = Path(folder) / "selection.jsonl"
    if not path.exists():
        raise AssayError(f"{folder} is not a finished assay filter run (no selection.jsonl)")
    return np.array([json.loads(line)["id"] for line in path.read_text().splitlines()], dtype=np.int64)


def overlap(a: np.ndarray, b: np.ndarray) -> float:
    """|A ∩ B| / |A| for two selections of the same size."""
    return len(np.intersect1d(a, b)) / max(len(a), 1)
