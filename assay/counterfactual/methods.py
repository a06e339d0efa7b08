"""The attribution methods `assay validate` computes itself, as [Q, N] score matrices.

Each method is an index kind (how the pool's gradients are collected and what statistics are
kept) and a score mode; every index is built on the model trained on the whole pool (the run
the ground truth's subsets are counterfactuals of), at each requested precision. Scores follow
`assay score`'s convention (positive = proponent), in the ground truth's row and query order.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from assay.attribution.build import BuildConfig, build_index, setup_from_index
from assay.attribution.index import open_index
from assay.attribution.score import ScoreOptions, check_compatible, query_gradients, score_index
from assay.core.config import DataConfig, ModelConfig, QueryConfig, RuntimeConfig
from assay.core.distributed import Distributed
from assay.core.errors import AssayError
from assay.core.memory import PeakResident
from assay.core.runs import DONE_FILE, read_json, write_json
from assay.counterfactual.from_run import load_replay, metagradient_scores
from assay.lm.lean import keep_compute_casts
from assay.lm.queries import load_queries


@dataclass(frozen=True)
class IndexKind:
    """How a method's index is built (beyond model, data, precision and projection)."""

    normalizer: str
    preconditioner: str
    optimizer_state: bool = False
    """Normalize by the full run's own Adam second moments (its optimizer_state.safetensors)."""


INDEX_KINDS: dict[str, IndexKind] = {
    "raw": IndexKind("none", "trackstar"),
    "adam": IndexKind("adam", "trackstar", optimizer_state=True),
    "kfac": IndexKind("none", "kfac"),
    "ekfac": IndexKind("none", "ekfac"),
}


@dataclass(frozen=True)
class Method:
    """An attribution method: the index it reads and the `assay score` mode it scores with."""

    index: str
    mode: str
    summary: str


METHODS: dict[str, Method] = {
    "trackstar": Method(
        "adam", "trackstar", "TrackStar: Adam-normalised gradients, R^(-1/2)-whitened cosine"
    ),
    "cosine": Method("raw", "cosine", "cosine of the raw projected gradients"),
    "inner": Method("raw", "inner", "inner product of the raw projected gradients"),
    "influence": Method("raw", "influence", "influence with the projected gradients' second moment"),
    "kfac": Method("kfac", "influence", "influence with K-FAC curvature"),
    "ekfac": Method("ekfac", "influence", "influence with EK-FAC curvature"),
    "replay": Method("", "replay", "exact metagradients through every step of the full run (MAGIC)"),
}


@dataclass
class MethodSetup:
    """What every method's index and scores share."""

    root: Path
    model: ModelConfig
    """The model trained on the whole pool (OUT/full/model)."""
    full_run: Path
    data: DataConfig
    queries: QueryConfig
    runtime: RuntimeConfig
    projection_dim: int
    token_batch_size: int
    damping: float
    replay_from_step: int = 0
    """replay: the first step differentiated (earlier ones held fixed); labelled replay-fromS."""


DEFAULT_PROJECTION = 16
"""Projection width per side of the methods' indexes unless told otherwise."""
DEFAULT_DAMPING = 0.1
"""Damping of the influence methods (× each module's mean eigenvalue) unless told otherwise."""


def _projection_tag(setup: MethodSetup) -> str:
    return "" if setup.projection_dim == DEFAULT_PROJECTION else f"-p{setup.projection_dim}"


def method_label(setup: MethodSetup, name: str, precision: str) -> str:
    """NAME-PRECISION, tagged -pP for another projection width and -dD for an influence method's
    other damping: scores made with other settings are rows of their own, never a stale reuse."""
    damping = METHODS[name].mode == "influence" and setup.damping != DEFAULT_DAMPING
    return f"{name}{_projection_tag(setup)}{f'-d{setup.damping:g}' if damping else ''}-{precision}"


def index_path(setup: MethodSetup, kind: str, precision: str) -> Path:
    return setup.root / "index" / f"{kind}{_projection_tag(setup)}-{precision}"


def build_method_index(setup: MethodSetup, kind: str, precision: str) -> Path:
    """Build (or resume, or reuse) the pool's index of this kind at this precision."""
    out = index_path(setup, kind, precision)
    if (out / DONE_FILE).exists():
        return out
    spec = INDEX_KINDS[kind]
    build_index(
        BuildConfig(
            out=str(out),
            model=setup.model,
            data=setup.data,
            runtime=replace(setup.runtime, precision=precision),  # type: ignore[arg-type]
            projection_dim=setup.projection_dim,
            token_batch_size=setup.token_batch_size,
            normalizer=spec.normalizer,  # type: ignore[arg-type]
            optimizer_state=str(setup.full_run) if spec.optimizer_state else None,
            preconditioner=spec.preconditioner,  # type: ignore[arg-type]
            stats_samples=10**9,  # the whole pool: it is small, and the statistics are then exact
        )
    )
    return out


def scores_path(setup: MethodSetup, label: str) -> Path:
    return setup.root / "methods" / f"{label}.npy"


def compute_method(
    setup: MethodSetup, name: str, precision: str, pool_ids: np.ndarray, query_ids: list[Any]
) -> Path:
    """[Q, N] scores of method `name` at `precision` in the ground truth's order, saved as
    OUT/methods/LABEL.npy (`method_label`; + .json with how long it took and the process's peak
    resident memory meanwhile). Reused when already there."""
    label = method_label(setup, name, precision)
    path = scores_path(setup, label)
    if path.exists():
        return path
    with PeakResident() as peak:
        scores, facts = _method_scores(setup, name, precision, pool_ids, query_ids, label)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp.npy")
    np.save(tmp, scores)
    write_json(path.with_suffix(".json"), {**facts, "peak_gb": peak.gb})
    tmp.replace(path)
    return path


def _method_scores(
    setup: MethodSetup, name: str, precision: str, pool_ids: np.ndarray, query_ids: list[Any], label: str
) -> tuple[np.ndarray, dict[str, Any]]:
    """[Q, N] scores in the ground truth's order and how they were made (index, seconds)."""
    method = METHODS[name]
    start = time.perf_counter()
    index = open_index(build_method_index(setup, method.index, precision))
    built = time.perf_counter() - start
    gradient_setup = setup_from_index(index, setup.runtime.device)
    check_compatible(index, gradient_setup)
    keep_compute_casts(gradient_setup.model, gradient_setup.policy)
    queries = load_queries(setup.queries, int(index.meta["data"]["max_length"]), gradient_setup.tokenizer)
    if [str(q) for q in queries.ids] != [str(q) for q in query_ids]:
        raise AssayError(
            f"the queries of {label} differ from the ground truth's; delete {setup.root} to redo"
        )
    grads = query_gradients(gradient_setup, queries.examples, setup.token_batch_size)
    scores = np.zeros((len(queries.ids), len(index)), dtype=np.float32)
    score_index(index, grads, ScoreOptions(mode=method.mode, damping=setup.damping), scores_out=scores)  # type: ignore[arg-type]
    order = _positions(np.asarray(index.ids), pool_ids, label)
    scored = time.perf_counter() - start - built
    facts = {
        "method": name, "precision": precision, "mode": method.mode, "index": str(index.path),
        "summary": method.summary, "index_seconds": built, "score_seconds": scored,
    }  # fmt: skip
    return scores[:, order], facts


REPLAY_QUERY_BATCH = 4
"""Queries differentiated together in one reverse pass (each adds 3 parameter copies of memory)."""


def replay_method(setup: MethodSetup, precision: str, pool_ids: np.ndarray, query_ids: list[Any]) -> Path:
    """Metagradient scores through the full run itself (its own precision: `precision` must be it).

    The queries go in batches of REPLAY_QUERY_BATCH, each one reverse pass, shared out over the
    torchrun ranks (each rank replays the run once, alone, then differentiates its batches). Each
    batch's rows are saved as it finishes (OUT/methods/replay-P.parts/), so an interrupted
    validation redoes only the unfinished batches. Costs are summed over ranks and resumes.
    """
    dist, path = Distributed.current(), scores_path(setup, replay_label(setup, precision))
    if dist.broadcast_object(path.exists()):
        return path
    parts = path.with_name(f"{path.stem}.parts")
    batches = [list(range(i, min(i + REPLAY_QUERY_BATCH, len(query_ids))))
               for i in range(0, len(query_ids), REPLAY_QUERY_BATCH)]  # fmt: skip
    todo = dist.broadcast_object([b for b in range(len(batches)) if not _part(parts, b).exists()])
    mine = [(b, batches[b]) for b in dist.interleave(todo)]
    dist.on_every_rank(_replay_batches, setup, precision, pool_ids, query_ids, mine, parts)
    if dist.is_main:
        _assemble_parts(parts, len(batches), path, precision, setup.replay_from_step)
    dist.barrier()
    return path


def replay_label(setup: MethodSetup, precision: str) -> str:
    """replay-P, or replay-fromS-P when the first S steps are held fixed."""
    start = f"-from{setup.replay_from_step}" if setup.replay_from_step else ""
    return f"replay{start}-{precision}"


def _part(parts: Path, b: int) -> Path:
    return parts / f"batch-{b:04d}.npy"


def _replay_batches(
    setup: MethodSetup, precision: str, pool_ids: np.ndarray, query_ids: list[Any],
    batches: list[tuple[int, list[int]]], parts: Path,
) -> None:  # fmt: skip
    """Replay the full run once (this process alone), then write each batch's [B, N] scores."""
    if not batches:
        return
    with Distributed.alone(), PeakResident() as peak:
        _replay_and_score(setup, precision, pool_ids, query_ids, batches, parts, peak)


def _replay_and_score(
    setup: MethodSetup, precision: str, pool_ids: np.ndarray, query_ids: list[Any],
    batches: list[tuple[int, list[int]]], parts: Path, peak: PeakResident,
) -> None:  # fmt: skip
    replayed = load_replay(setup.full_run, setup.runtime.device)
    if replayed.policy.name != precision:
        raise AssayError(
            f"replay differentiates the run at its own precision ({replayed.policy.name}), not {precision}"
        )
    queries = load_queries(setup.queries, replayed.max_length, replayed.tokenizer)
    if [str(q) for q in queries.ids] != [str(q) for q in query_ids]:
        raise AssayError(f"the queries of replay-{precision} differ from the ground truth's")
    order = _positions(np.asarray(replayed.train.ids), pool_ids, f"replay-{precision}")
    if setup.replay_from_step >= len(replayed.replay.run.steps):
        raise AssayError(f"--replay_from_step {setup.replay_from_step} is past the full run's last step")
    parts.mkdir(parents=True, exist_ok=True)
    replay_seconds = replayed.replay_seconds
    for b, rows in batches:
        start = time.perf_counter()
        subset = queries.examples.subset(rows)
        scores = metagradient_scores(replayed, subset, aggregate=False, first_step=setup.replay_from_step)
        target = _part(parts, b)
        tmp = target.with_name(target.name + ".tmp.npy")
        np.save(tmp, scores[:, order].astype(np.float32))
        write_json(target.with_suffix(".json"), {
            "replay_seconds": replay_seconds, "score_seconds": time.perf_counter() - start,
            "peak_gb": peak.gb,  # this process's, so far
        })  # fmt: skip
        tmp.replace(target)
        replay_seconds = 0.0  # the forward replay is counted once per process


def _assemble_parts(parts: Path, num_batches: int, path: Path, precision: str, first_step: int) -> None:
    """Stack the batches' rows into methods/replay-P.npy, with their summed costs."""
    scores = np.concatenate([np.load(_part(parts, b)) for b in range(num_batches)])
    costs = [read_json(_part(parts, b).with_suffix(".json")) for b in range(num_batches)]
    tmp = path.with_name(path.name + ".tmp.npy")
    np.save(tmp, scores)
    write_json(path.with_suffix(".json"), {
        "method": "replay", "precision": precision, "mode": "replay", "index": None,
        "summary": METHODS["replay"].summary + (f", from step {first_step}" if first_step else ""),
        "replay_from_step": first_step,
        "index_seconds": sum(c["replay_seconds"] for c in costs),
        "score_seconds": sum(c["score_seconds"] for c in costs),
        "peak_gb": max(c.get("peak_gb", 0.0) for c in costs),  # of the processes that replayed
    })  # fmt: skip
    tmp.replace(path)


def _positions(index_ids: np.ndarray, pool_ids: np.ndarray, label: str) -> np.ndarray:
    """Column positions in the index of each ground-truth pool id (refusing a different pool)."""
    where = {int(v): i for i, v in enumerate(index_ids)}
    missing = [int(v) for v in pool_ids if int(v) not in where]
    if missing or len(index_ids) != len(pool_ids):
        raise AssayError(
            f"{label}: the index holds {len(index_ids)} examples, the ground truth's pool {len(pool_ids)}"
            + (f" (id {missing[0]} missing)" if missing else "")
        )
    return np.array([where[int(v)] for v in pool_ids], dtype=np.int64)


def method_facts(path: Path) -> dict[str, Any]:
    """What a method's .json says about it (method, precision, mode, seconds...)."""
    meta = path.with_suffix(".json")
    return read_json(meta) if meta.exists() else {}
