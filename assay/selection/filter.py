"""`assay filter`: choose training examples, for coreset or targeted selection.

Strategies (strategies.py): score strategies (random, loss, gradcos, trackstar) keep the top
scores, or the bottom ones with --lowest, optionally de-duplicated first (--dedup); coverage
strategies (facility, kcenter, balanced) spread the selection over the pool's gradient
features, facility with CRAIG's per-example weights (which `assay finetune` then uses).

Queries: `--query eval` scores each pool example against the MEAN of the query set's unit
(whitened) gradients, i.e. the mean of its per-query scores (targeted selection, as LESS);
`--query self` uses the pool itself as the query set (coreset selection: each example's
agreement with the average direction of the whole set, the reference's "query over the
entire dataset"). Gradient strategies read an index from --index, or build one into
OUT/index from --model/--dataset (with TrackStar's preconditioner statistics).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
import tyro

from assay.attribution.build import BuildConfig, build_index, setup_from_index
from assay.attribution.index import GradientIndex, open_index
from assay.attribution.score import (
    ScoreOptions,
    check_compatible,
    dataset_texts,
    query_gradients,
    score_index,
    train_texts,
)
from assay.core.config import DataConfig, ModelConfig, QueryConfig, RuntimeConfig
from assay.core.console import note
from assay.core.distributed import Distributed
from assay.core.errors import AssayError
from assay.core.runs import run_folder, write_json, write_jsonl
from assay.lm.data import ID_COLUMN, load_table
from assay.lm.queries import load_queries
from assay.selection.coverage import DedupOptions, deduplicate
from assay.selection.coverage import select as cover
from assay.selection.similarity import Selection
from assay.selection.strategies import (
    FEATURES_FILE,
    GRADIENT_MODES,
    STRATEGIES,
    Features,
    StrategyName,
    WithinName,
    gradient_features,
)
from assay.training.evaluate import mean_token_loss
from assay.training.subset import read_ids


@dataclass
class FilterConfig:
    """Select --num_examples (or --fraction) training examples by a score."""

    out: tyro.conf.Positional[str]
    """Output folder: selection.jsonl (id, score, rank), selected_ids.txt, scores.npy, ids.npy."""
    model: tyro.conf.OmitArgPrefixes[ModelConfig] = field(default_factory=ModelConfig)
    data: tyro.conf.OmitArgPrefixes[DataConfig] = field(default_factory=DataConfig)
    runtime: tyro.conf.OmitArgPrefixes[RuntimeConfig] = field(default_factory=RuntimeConfig)
    strategy: StrategyName = "trackstar"
    """random | loss (mean token loss) | gradcos (raw gradient cosine) | trackstar (whitened cosine)
    | facility (CRAIG: greedy facility location, weighted) | kcenter | balanced (k-means strata)
    | typiclust (a k-means cluster per kept example, its most typical member)."""
    query: Literal["self", "eval"] = "self"
    """self: the pool is its own query (coreset); eval: a query dataset (targeted selection)."""
    queries: tyro.conf.OmitArgPrefixes[QueryConfig] = field(default_factory=QueryConfig)
    num_examples: int | None = None
    """How many examples to keep."""
    fraction: float | None = None
    """Or: which fraction of the pool to keep (0-1]."""
    lowest: bool = False
    """Score strategies: keep the lowest scores instead of the highest (the other tail)."""
    dedup: float | None = None
    """Score strategies: first drop near-duplicates (gradient cosine >= DEDUP to an already kept,
    higher-scoring example; SemDeDup), then keep the top scores."""
    features: Features = "whitened"
    """Coverage strategies' feature space: whitened (TrackStar's R^(-1/2), unit rows) or raw rows."""
    within: WithinName = "random"
    """balanced: which score ranks the examples within each cluster."""
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
        if self.dedup is not None and not 0.0 < self.dedup <= 1.0:
            raise AssayError(f"--dedup must be a cosine in (0, 1], got {self.dedup}")
        if self.dedup is not None and STRATEGIES[self.strategy].kind != "score":
            raise AssayError(
                f"--dedup applies to score strategies; {self.strategy} already avoids duplicates"
            )
        if (self.num_examples is None) == (self.fraction is None):
            raise AssayError("give exactly one of --num_examples and --fraction")
        if self.num_examples is not None and self.num_examples < 1:
            raise AssayError(f"--num_examples must be >= 1, got {self.num_examples}")
        if self.fraction is not None and not 0.0 < self.fraction <= 1.0:
            raise AssayError(f"--fraction must be in (0, 1], got {self.fraction}")
        gradient = self.strategy in GRADIENT_MODES or (
            self.strategy == "balanced" and self.within in GRADIENT_MODES
        )
        if self.query == "eval" and not self.queries.given and gradient:
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


def gradient_scores(cfg: FilterConfig, index: GradientIndex, name: str) -> np.ndarray:
    """[N] mean score of each index row against the queries (gradcos or trackstar)."""
    queries = query_gradients_of(cfg, index)
    out = np.zeros((1, len(index)), dtype=np.float32)
    options = ScoreOptions(mode=GRADIENT_MODES[name], aggregate="mean", top_k=1)  # type: ignore[arg-type]
    score_index(index, queries, options, scores_out=out)
    return out[0].astype(np.float64)


def pool_index(cfg: FilterConfig, folder: Path) -> tuple[GradientIndex | None, dict[str, Any]]:
    """The index gradient strategies read: --index, or one built (resumably) into OUT/index.
    Under torchrun every rank joins the build (the costly, rank-aware part)."""
    if cfg.index:
        index = open_index(cfg.index)
        refuse_another_pool(cfg, index)
        return index, {}
    within = cfg.strategy == "balanced" and cfg.within in GRADIENT_MODES
    if not (STRATEGIES[cfg.strategy].needs_index or within or cfg.dedup is not None):
        return None, {}
    return build_index_here(cfg, folder), {"index": str(Path(cfg.out) / "index")}


def refuse_another_pool(cfg: FilterConfig, index: GradientIndex) -> None:
    """With --index the pool and the model are the index's: a --model or --dataset given beside
    it (not left at its default) must name the same, or the run would record what it never read."""
    built = index.meta["config"]
    for option, given, default, own in (
        ("--model", cfg.model.model, ModelConfig().model, built["model"]["model"]),
        ("--dataset", cfg.data.dataset, DataConfig().dataset, built["data"]["dataset"]),
    ):
        same = given == own or (Path(given).exists() and Path(given).resolve() == Path(own).resolve())
        if given != default and not same:
            raise AssayError(
                f"{option} {given} is not what {index.path} was built from ({own}); with --index the "
                f"pool and model are the index's: drop {option}, or build an index of {given}"
            )


def pool_scores(cfg: FilterConfig, index: GradientIndex | None, name: str) -> tuple[np.ndarray, np.ndarray]:
    """(pool ids [N], scores [N]) of score strategy `name`, computed in this process."""
    if name == "random":
        ids = index.ids if index is not None else pool_ids(cfg)
        return np.asarray(ids, np.int64), random_scores(len(ids), cfg.runtime.seed)
    if name == "loss":
        if index is not None:
            return np.asarray(index.ids, np.int64), mean_token_losses(index)
        return model_token_losses(cfg)
    assert index is not None  # pool_index built one
    return np.asarray(index.ids, np.int64), gradient_scores(cfg, index, name)


def choose(
    cfg: FilterConfig, index: GradientIndex | None, folder: Path
) -> tuple[np.ndarray, np.ndarray, Selection]:
    """(pool ids, pool scores, the selection), computed on rank 0 alone (no collectives)."""
    if STRATEGIES[cfg.strategy].kind == "score":
        return _top_scores(cfg, index, folder)
    assert index is not None
    ids = np.asarray(index.ids, np.int64)
    within = None
    if cfg.strategy == "balanced" and cfg.within != "random":
        within = pool_scores(cfg, index, cfg.within)[1]
        _require_finite(within, cfg.within)
    features = gradient_features(index, cfg.features, folder)
    chosen = cover(cfg.strategy, features, selection_size(cfg, len(ids)), within, cfg.runtime.seed)
    (folder / FEATURES_FILE).unlink(missing_ok=True)  # a pool-sized scratch file
    scores = np.zeros(len(ids))
    scores[chosen.positions] = chosen.weights if chosen.weights is not None else 1.0
    return ids, scores, chosen


def _top_scores(
    cfg: FilterConfig, index: GradientIndex | None, folder: Path
) -> tuple[np.ndarray, np.ndarray, Selection]:
    """The top (or bottom) k scores, among the examples --dedup keeps."""
    ids, scores = pool_scores(cfg, index, cfg.strategy)
    _require_finite(scores, cfg.strategy)
    k = selection_size(cfg, len(ids))
    candidates = np.arange(len(ids))
    if cfg.dedup is not None:
        assert index is not None  # pool_index built one
        features = gradient_features(index, cfg.features, folder)
        order = -scores if cfg.lowest else scores  # the best-ranked of near-duplicates is kept
        kept = deduplicate(features, order, cfg.runtime.seed, DedupOptions(threshold=cfg.dedup))
        (folder / FEATURES_FILE).unlink(missing_ok=True)
        candidates = np.sort(kept.positions)
        if len(candidates) < k:
            raise AssayError(
                f"only {len(candidates)} examples are left after --dedup {cfg.dedup}; keep fewer"
            )
    chosen = candidates[select_top(ids[candidates], scores[candidates], k, cfg.lowest)]
    return ids, scores, Selection(chosen, None, {"kept_after_dedup": int(len(candidates))})


def _require_finite(scores: np.ndarray, name: str) -> None:
    if not np.isfinite(scores).all():
        raise AssayError(f"{name} produced non-finite scores; check the model and the index")


REPORT_TEXTS = 50
"""Selected examples whose texts texts.jsonl keeps, in rank order (what `assay report` lists)."""


def write_selected_texts(
    folder: Path, data: DataConfig, index: GradientIndex | None, ids: np.ndarray, chosen: Selection
) -> None:
    """texts.jsonl: {id, text} of the first REPORT_TEXTS selected examples, read from the index's
    own datasets (or the pool's, without an index): the report reads run folders only."""
    first = [int(ids[p]) for p in chosen.positions[:REPORT_TEXTS]]
    texts = train_texts(index, set(first)) if index is not None else dataset_texts(data, set(first))
    write_jsonl(folder / "texts.jsonl", [{"id": i, "text": texts[i]} for i in first if i in texts])


def write_selection(folder: Path, ids: np.ndarray, scores: np.ndarray, chosen: Selection) -> None:
    """selection.jsonl (rank order; with each example's weight when the strategy gives one),
    selected_ids.txt, and every pool score (ids.npy, scores.npy)."""
    records = []
    for rank, pos in enumerate(chosen.positions):
        record: dict[str, Any] = {"id": int(ids[pos]), "score": float(scores[pos]), "rank": rank}
        if chosen.weights is not None:
            record["weight"] = float(chosen.weights[rank])
        records.append(record)
    write_jsonl(folder / "selection.jsonl", records)
    (folder / "selected_ids.txt").write_text("".join(f"{int(ids[p])}\n" for p in chosen.positions))
    np.save(folder / "ids.npy", ids.astype(np.int64))
    np.save(folder / "scores.npy", scores.astype(np.float64))


def select(cfg: FilterConfig) -> dict[str, Any]:
    """Choose k examples of the pool with the strategy and write them (rank 0 writes)."""
    dist = Distributed.current()
    with run_folder(cfg.out, "filter", cfg, cfg.overwrite) as run:
        index, details = pool_index(cfg, run.path)
        ids, scores, chosen = dist.main_only(choose, cfg, index, run.path)
        if dist.is_main:
            write_selection(run.path, ids, scores, chosen)
            write_selected_texts(run.path, cfg.data, index, ids, chosen)
        picked = scores[chosen.positions]
        facts = {k: v for k, v in chosen.details.items() if isinstance(v, int | float | str)}
        summary = {
            "strategy": cfg.strategy, "kind": STRATEGIES[cfg.strategy].kind, "query": cfg.query,
            "lowest": cfg.lowest,
            "num_selected": int(len(chosen.positions)), "pool_size": len(ids),
            "score_range": [float(picked.min()), float(picked.max())], "weighted": chosen.weights is not None,
            **({"index": str(index.path), "precision": index.meta["precision"]} if index is not None else {}),
            **details, **facts,
        }  # fmt: skip
        if dist.is_main:
            write_json(run.path / "summary.json", summary)
    return summary


def read_selection(folder: str | Path) -> np.ndarray:
    """The selected ids of a finished `assay filter` run, in rank order."""
    path = Path(folder) / "selection.jsonl"
    if not path.exists():
        raise AssayError(f"{folder} is not a finished assay filter run (no selection.jsonl)")
    return read_ids(path)


def overlap(a: np.ndarray, b: np.ndarray) -> float:
    """|A ∩ B| / |A| for two selections of the same size."""
    return len(np.intersect1d(a, b)) / max(len(a), 1)
