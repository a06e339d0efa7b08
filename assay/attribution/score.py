"""`assay score`: attribute queries to the training examples of a gradient index (TrackStar).

The queries' gradients are computed with exactly the index's settings (model, adapter, modules,
projection, normalizer, precision); the index is then streamed in chunks and scored against
them (see kernel.py and docs/attribution.md). OUT receives `top.jsonl` (proponents and
opponents per query or aggregate), `queries.jsonl`, `summary.json` and, with --save_scores,
the full `scores.npy` [A, N] float32.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
import tyro

from assay.attribution.index import GradientIndex, open_index
from assay.attribution.kernel import (
    Aggregate,
    ArrayRows,
    Mode,
    TopRows,
    base_sq_norms,
    half_gemm_is_exact_enough,
    plan_queries,
    row_norms,
    score_rows,
)
from assay.attribution.precondition import MIX_FRACTION, Whitening, build_whitening, second_moment_sums
from assay.core.config import DataConfig
from assay.core.console import note, say
from assay.core.distributed import Distributed
from assay.core.errors import AssayError
from assay.core.paths import cache_dir
from assay.core.runs import DONE_FILE, run_folder, write_json
from assay.lm.data import ID_COLUMN, Examples, load_table, texts_of, tokenize, tokenizer_fingerprint
from assay.lm.lean import keep_compute_casts
from assay.lm.table import Table


@dataclass
class ScoreConfig:
    """Attribute queries to the training examples of an index built by `assay build`."""

    out: tyro.conf.Positional[str]
    """Output folder (top.jsonl, queries.jsonl, summary.json, optional scores.npy)."""
    index: str
    """The gradient index folder (the OUT of `assay build`)."""
    query_dataset: str | None = None
    """Dataset of queries (same forms as --dataset: a file, a folder, `abc-tunes`, ...)."""
    query_split: str = "eval"
    """Split of the query dataset."""
    query_text_column: str = "text"
    """Column holding the query text."""
    query_prompt_column: str | None = None
    """Column holding a prompt; then only the completion's tokens carry the query's loss."""
    query_completion_column: str | None = None
    """Column holding the completion (with --query_prompt_column)."""
    query_max_samples: int | None = None
    """Use only the first N queries (after filtering)."""
    query_filter_column: str | None = None
    """Keep only query rows whose column equals --query_filter_value (e.g. collection)."""
    query_filter_value: str | None = None
    """Value --query_filter_column must equal (e.g. oneill)."""
    query_text: tuple[str, ...] = ()
    """Ad-hoc query texts (`--query_text TEXT [TEXT ...]`); scored along with --query_dataset."""
    mode: Mode = "trackstar"
    """trackstar: cosine after R^(-1/2) on both sides; cosine: raw gradient cosine; inner: raw
    inner product; influence: <g_query, R^(-1) g_train> without unit normalisation."""
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
    save_scores: bool = False
    """Also write every score: scores.npy [queries or 1, N] float32."""
    chunk_rows: int = 0
    """Index rows scored per chunk (0: ~64 MiB of fp32 rows; the arithmetic runs on cache-sized
    blocks within it)."""
    search: Literal["exact", "faiss"] = "exact"
    """exact: stream every row (default). faiss: an approximate IVF index, built once per index
    and cached, for many millions of rows (needs `assay[faiss]`; trackstar then uses λ = 0)."""
    faiss_lists: int = 0
    """FAISS inverted lists (0: about 4·sqrt(N))."""
    faiss_probe: int = 16
    """Lists searched per query (more: closer to exact, slower)."""
    cache_norms: bool = True
    """Cache per-row numbers the fast paths need (in the assay cache), computed on first use:
    trackstar with few queries, each row's whitened norm under the training statistics; inner,
    influence and cosine on an fp16 index without norms.npy (built before it existed), each
    row's norm."""
    token_batch_size: int = 2048
    """Most tokens per batch when computing the query gradients."""
    device: str = "auto"
    """cpu, cuda, cuda:N or auto."""
    show: int = 3
    """Proponents shown per query on stdout (top.jsonl holds --top_k)."""
    query_sae: str | None = None
    """An SAE folder (SAELens format). With --latent, each query is that latent's activation summed
    over the query's tokens instead of its loss: proponents are the training examples whose
    training step raises the feature (see docs/report.md)."""
    latent: int | None = None
    """The SAE latent to attribute (with --query_sae)."""
    overwrite: bool = False
    """Replace a finished run in OUT."""

    def __post_init__(self) -> None:
        if self.query_dataset is None and not self.query_text:
            raise AssayError("give queries: --query_dataset DATASET and/or --query_text TEXT")
        if any(not text.strip() for text in self.query_text):
            raise AssayError("a --query_text is empty; give the text to attribute")
        if self.top_k < 1 or self.chunk_rows < 0 or self.token_batch_size < 1:
            raise AssayError("--top_k and --token_batch_size must be positive, --chunk_rows >= 0")
        if self.mix is not None and not 0.0 <= self.mix <= 1.0:
            raise AssayError(f"--mix must be in [0, 1], got {self.mix}")
        if self.damping < 0 or not 0.0 < self.mix_fraction <= 1.0:
            raise AssayError("--damping must be >= 0 and --mix_fraction in (0, 1]")
        if self.search == "faiss" and (self.save_scores or self.mode not in ("trackstar", "cosine")):
            raise AssayError("--search faiss gives top-k only (no --save_scores), for trackstar or cosine")
        if (self.query_filter_column is None) != (self.query_filter_value is None):
            raise AssayError("--query_filter_column and --query_filter_value go together")
        if (self.query_sae is None) != (self.latent is None):
            raise AssayError("--query_sae and --latent go together")


@dataclass
class Queries:
    """The queries' ids (source rows, or "text:i" for ad-hoc texts), texts and examples."""

    ids: list[Any]
    texts: list[str]
    examples: Examples


def query_data_config(cfg: ScoreConfig, index: GradientIndex) -> DataConfig:
    """The query dataset as a DataConfig, cut to the index's max_length."""
    assert cfg.query_dataset is not None
    return DataConfig(
        dataset=cfg.query_dataset,
        split=cfg.query_split,
        text_column=cfg.query_text_column,
        prompt_column=cfg.query_prompt_column,
        completion_column=cfg.query_completion_column,
        max_samples=cfg.query_max_samples,
        max_length=int(index.meta["data"]["max_length"]),
        filter_column=cfg.query_filter_column,
        filter_value=cfg.query_filter_value,
    )


def load_queries(cfg: ScoreConfig, index: GradientIndex, tokenizer: Any) -> Queries:
    """Tokenize the dataset queries and the ad-hoc texts with the index's tokenizer."""
    parts: list[Queries] = []
    if cfg.query_dataset is not None:
        data_cfg = query_data_config(cfg, index)
        table = load_table(data_cfg)
        ids: list[Any] = [int(i) for i in table[ID_COLUMN]]
        parts.append(Queries(ids, texts_of(table, data_cfg), tokenize(table, data_cfg, tokenizer)))
    if cfg.query_text:
        texts = list(cfg.query_text)
        table = Table.from_columns({"text": texts, ID_COLUMN: list(range(len(texts)))})
        text_cfg = DataConfig(dataset="query_text", max_length=int(index.meta["data"]["max_length"]))
        parts.append(
            Queries([f"text:{i}" for i in range(len(texts))], texts, tokenize(table, text_cfg, tokenizer))
        )
    queries = Queries(
        [i for p in parts for i in p.ids],
        [t for p in parts for t in p.texts],
        _concat_examples([p.examples for p in parts]),
    )
    empty = [q for q, n in zip(queries.ids, queries.examples.num_loss_tokens()) if n == 0]
    if empty:
        raise AssayError(f"query {empty[0]!r} has no tokens that carry loss (empty text or completion?)")
    return queries


def _concat_examples(parts: list[Examples]) -> Examples:
    if len(parts) == 1:
        return parts[0]
    shifts = np.cumsum([0] + [len(p.tokens) for p in parts[:-1]])
    return Examples(
        ids=np.concatenate([p.ids for p in parts]),
        offsets=np.concatenate([parts[0].offsets[:1]] + [p.offsets[1:] + s for p, s in zip(parts, shifts)]),
        tokens=np.concatenate([p.tokens for p in parts]),
        loss_start=np.concatenate([p.loss_start for p in parts]),
    )


def check_compatible(index: GradientIndex, setup: Any) -> None:
    """Refuse a model, tokenizer, projection or module set other than the index's (one line)."""
    from assay.lm.models import model_fingerprint

    meta = index.meta
    if model_fingerprint(setup.model) != meta["model"]["fingerprint"]:
        raise AssayError(
            f"the model differs from the one {index.path} was built with ({meta['model']['name']})"
        )
    if tokenizer_fingerprint(setup.tokenizer) != meta["model"]["tokenizer_fingerprint"]:
        raise AssayError(f"the tokenizer differs from the one {index.path} was built with")
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
    index: GradientIndex, queries: torch.Tensor, cfg: ScoreConfig
) -> tuple[TopRows, Whitening | None]:
    """Approximate top/bottom rows through a cached FAISS index (see ann.py: trackstar uses λ = 0)."""
    from assay.attribution.ann import load_or_build_ann, search_ann

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
    queries: torch.Tensor,
    mode: str = "trackstar",
    aggregate: str = "none",
    top_k: int = 10,
    mix: float | None = None,
    damping: float = 0.1,
    mix_fraction: float = MIX_FRACTION,
    scores_out: np.ndarray | None = None,
    chunk_rows: int = 0,
    cache_norms: bool = True,
) -> tuple[TopRows, Whitening | None]:
    """Score query gradients [Q, D] (computed like the index's rows) against every index row.

    trackstar with few queries (Q ≤ d_m/4) and `cache_norms` takes each row's ‖W t‖ from the
    Woodbury form and a per-index cache, so the pass over the index is a plain streamed GEMM.
    inner, influence and cosine on an fp16 index (without `scores_out`) screen the rows with a
    half-precision GEMM and score exactly only those that may reach the top k (kernel.Screen).
    """
    if queries.shape[-1] != index.dim:
        raise AssayError(f"query gradients have {queries.shape[-1]} dimensions, the index {index.dim}")
    chunk_rows = chunk_rows or auto_chunk_rows(index.dim)
    whitening = whitening_for(index, queries, mode, mix, damping, mix_fraction)
    base = None
    smallest = min(sl.stop - sl.start for sl in index.modules.values())
    if mode == "trackstar" and cache_norms and whitening is not None and whitening.lowrank is not None:
        if 4 * queries.shape[0] <= smallest:
            base = cached_base_norms(index, whitening, chunk_rows)
    norms = index_row_norms(index, mode, cache_norms, chunk_rows)
    plan = plan_queries(queries, mode, aggregate, whitening, base, norms)
    from tqdm.auto import tqdm

    with tqdm(total=len(index), desc="score", unit="row", unit_scale=True, mininterval=1.0) as bar:

        def advance(done: int) -> None:
            bar.update(done - bar.n)

        top = score_rows(ArrayRows(index.gradients), plan, top_k, scores_out, chunk_rows, advance)
    return top, whitening


# --- the command --------------------------------------------------------------------------------
def query_gradients(cfg: ScoreConfig, index: GradientIndex) -> tuple[Any, Queries, torch.Tensor]:
    """(setup, queries, [Q, D] fp32 gradients) computed exactly as the index's rows were."""
    from assay.attribution.build import collect, setup_from_index

    setup = setup_from_index(index, cfg.device)
    check_compatible(index, setup)
    keep_compute_casts(setup.model, setup.policy)  # from here on the model only collects gradients
    queries = load_queries(cfg, index, setup.tokenizer)
    if cfg.query_sae is not None:  # the query is an SAE latent's activation, not the loss
        from assay.bridge.latent import latent_objective, load_sae

        objective = latent_objective(load_sae(cfg.query_sae).to(setup.policy.device), int(cfg.latent or 0))
        collect = partial(collect, objective=objective)  # type: ignore[assignment]
    # under torchrun each rank computes every world-th query's gradient; all ranks get them all
    dist = Distributed.current()
    mine = dist.interleave_array(np.arange(len(queries.examples)))
    share = queries.examples.subset(mine) if dist.active else queries.examples
    rows = collect(setup, share, cfg.token_batch_size)  # [len(mine), D] fp32
    grads = torch.from_numpy(_assemble(dist.gather((mine, rows)), len(queries.examples)))
    zero = [q for q, n in zip(queries.ids, grads.norm(dim=1)) if float(n) == 0.0]
    if zero:
        if cfg.query_sae is not None:
            raise AssayError(
                f"latent {cfg.latent} never fires on query {zero[0]!r} (all-zero gradient); choose queries "
                "where it fires (`assay report` on the SAE run shows its top contexts)"
            )
        raise AssayError(f"query {zero[0]!r} has an all-zero gradient; it cannot be attributed")
    return setup, queries, grads


def _assemble(parts: list[tuple[np.ndarray, np.ndarray]], n: int) -> np.ndarray:
    """[n, D] rows from the ranks' (positions, rows) shares."""
    out = np.zeros((n, parts[0][1].shape[1]), dtype=np.float32)
    for positions, rows in parts:
        out[positions] = rows
    return out


def run_score(cfg: ScoreConfig) -> dict[str, Any]:
    """Compute the queries' gradients like the index's, score, write OUT, print the table."""
    index = open_index(cfg.index)
    setup, queries, grads = query_gradients(cfg, index)  # user errors surface before OUT.part exists
    if not Distributed.current().is_main:  # rank 0 streams the index and writes OUT
        with run_folder(cfg.out, "score", cfg, cfg.overwrite):
            return {}
    with run_folder(cfg.out, "score", cfg, cfg.overwrite) as run:
        columns = len(queries.ids) if cfg.aggregate == "none" else 1
        scores_out = None
        if cfg.save_scores:
            scores_out = np.lib.format.open_memmap(
                run.path / "scores.npy", mode="w+", dtype=np.float32, shape=(columns, len(index))
            )
        start = time.perf_counter()
        if cfg.search == "faiss":
            top, whitening = faiss_top(index, grads, cfg)
        else:
            top, whitening = score_index(
                index, grads, cfg.mode, cfg.aggregate, cfg.top_k, cfg.mix, cfg.damping, cfg.mix_fraction,
                scores_out, cfg.chunk_rows, cfg.cache_norms,
            )  # fmt: skip
        seconds = time.perf_counter() - start
        if scores_out is not None:
            scores_out.flush()
            del scores_out
        records = top_records(index, queries.ids, top, cfg.aggregate)
        _write_jsonl(run.path / "top.jsonl", records)
        _write_jsonl(
            run.path / "queries.jsonl", [{"query": q, "text": t} for q, t in zip(queries.ids, queries.texts)]
        )
        summary = {
            "index": str(index.path),
            "mode": cfg.mode,
            "aggregate": cfg.aggregate,
            "search": cfg.search,
            "num_queries": len(queries.ids),
            "num_rows": len(index),
            "mix": whitening.mix if whitening else None,
            "damping": cfg.damping,
            "precision": setup.policy.name,
            "score_seconds": seconds,
            "rows_per_s": len(index) / max(seconds, 1e-9),
        }
        write_json(run.path / "summary.json", summary)
    print_table(index, records, dict(zip(queries.ids, queries.texts)), cfg.show)
    say(f"results in {cfg.out}/ (top.jsonl, queries.jsonl{', scores.npy' if cfg.save_scores else ''})")
    return summary


def top_records(index: GradientIndex, query_ids: list[Any], top: TopRows, aggregate: str) -> list[dict]:
    """One record per score column: proponents and opponents as [train_id, score] pairs."""
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
            record[key] = [
                [int(index.ids[r]), float(v)] for r, v in zip(rows[col].tolist(), values[col].tolist())
            ]
        records.append(record)
    return records


def _write_jsonl(path: Path, records: list[dict]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    tmp.replace(path)


def train_texts(index: GradientIndex, ids: set[int]) -> dict[int, str]:
    """Texts of the given training ids, read through the index's saved data config."""
    data_cfg = DataConfig(**index.meta["data"])
    try:
        table = load_table(data_cfg)
    except AssayError as e:
        note(f"training texts unavailable ({e}); showing ids only")
        return {}
    positions = [i for i, v in enumerate(table[ID_COLUMN]) if int(v) in ids]
    subset = table.select(positions)
    return dict(zip((int(v) for v in subset[ID_COLUMN]), texts_of(subset, data_cfg)))


def fold(text: str, width: int = 90) -> str:
    """One line: newlines shown as ' / ', cut to `width` characters."""
    line = " / ".join(part.strip() for part in text.strip().splitlines() if part.strip())
    return line if len(line) <= width else line[: width - 1] + "…"


def print_table(index: GradientIndex, records: list[dict], query_texts: dict[Any, str], show: int) -> None:
    """Each query's text, then its top proponents: rank, score, train id, text."""
    wanted = {pid for r in records for pid, _ in r["proponents"][:show] + r["opponents"][:1]}
    texts = train_texts(index, wanted)
    for r in records:
        label = r["query"]
        text = query_texts.get(label) or f"{label} of {len(r.get('queries', []))} queries"
        say(f"\nquery {label}: {fold(text)}")
        say(f"  {'rank':>4}  {'score':>8}  {'train id':>8}  text")
        for rank, (pid, value) in enumerate(r["proponents"][:show], 1):
            say(f"  {rank:>4}  {value:>8.4f}  {pid:>8}  {fold(texts.get(pid, ''), 70)}")
        if r["opponents"]:
            pid, value = r["opponents"][0]
            say(f"  {'opp.':>4}  {value:>8.4f}  {pid:>8}  {fold(texts.get(pid, ''), 70)}")


def score_demo(index_dir: str, out_dir: str, queries: int = 3, overwrite: bool = False) -> dict[str, Any]:
    """The README's main job: attribute held-out O'Neill tunes to the ABC training tunes."""
    cfg = ScoreConfig(
        out=out_dir,
        index=index_dir,
        query_dataset="abc-tunes",
        query_split="eval",
        query_filter_column="collection",
        query_filter_value="oneill",
        query_max_samples=queries,
        overwrite=overwrite,
    )
    return run_score(cfg)
