"""On-the-fly scoring: `assay score OUT --model M --dataset D --query_...` without an index.

The queries' gradients are computed first. Then the corpus's gradients are computed token batch
by token batch exactly as `assay build` computes its rows, each batch is scored against the
queries at once and dropped: only the running top-k are kept (with --save_scores also each row's
score, and always each row's loss, [N] numbers on disk). Nothing of the corpus's gradients is
stored, so a corpus never needs to fit on disk as an index.

R_train (trackstar and influence need it): `assay build --preconditioner trackstar` sums g gᵀ
over a seeded sample of --stats_samples rows. Here the same sample (the same positions, from the
same seed) is computed in a first pass and its sums taken, so the whitening exists before any row
is scored and the scores are the build-then-score ones up to fp32 summation order. The sample's
rows are kept in memory while they fit --stream_buffer_mib and scored straight after that pass,
so they are not computed twice; sample rows beyond the buffer are computed again in the scoring
pass. Cost: the gradients of N rows plus the sample rows that did not fit; memory: the buffer,
one batch, the queries and the top-k, whatever N is (the tokenized corpus itself is loaded as
`assay build` loads it).

Resumable: after the statistics pass (OUT/preconditioner.safetensors) and after every batch of
the scoring pass, the running top-k and the number of batches done are checkpointed
(`stream_state.npz`) once the per-row outputs are flushed; a rerun continues from there. An
interruption before the buffered rows were scored computes the statistics pass again.
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
import tyro

from assay.attribution import index as ix
from assay.attribution.build import (
    BuildConfig,
    GradientSetup,
    iter_gradients,
    load_or_estimate_normalizer,
    refuse_non_finite,
)
from assay.attribution.collector import DEFAULT_MODULES, linear_modules, warn_silent_lora
from assay.attribution.kernel import QueryPlan, RunningTop, TopRows, chunk_scores, plan_queries
from assay.attribution.normalizers import sample_positions
from assay.attribution.options import ScoreOptions
from assay.attribution.precondition import Whitening, build_whitening
from assay.attribution.projection import Projector
from assay.core.config import DataConfig, ModelConfig, PrecisionName, RuntimeConfig
from assay.core.errors import AssayError
from assay.core.precision import STATS_DTYPE, full_precision
from assay.core.progress import Progress
from assay.lm.data import Examples, load_examples, token_batches
from assay.lm.lean import keep_compute_casts
from assay.lm.models import load_model, load_tokenizer, model_fingerprint, setup_runtime

STATE_FILE = "stream_state.npz"


@dataclass
class CorpusConfig:
    """A corpus scored on the fly: its examples' gradients computed as `assay build` would index them."""

    model: str | None = None
    """Instead of --index: score the examples of --dataset on the fly with this model (as `assay
    build --model`), keeping only the top-k (docs/attribution.md)."""
    tokenizer: str | None = None
    """Tokenizer folder or hub id, when it differs from the model's."""
    lora_rank: int = 0
    """Attach a fresh LoRA adapter of this rank (0: none), as `assay build` does."""
    lora_alpha: int = 16
    """LoRA scaling numerator."""
    lora_modules: tuple[str, ...] = ()
    """Module names LoRA attaches to (default: every linear layer but the output head, i.e. every
    attention and MLP projection, whatever the family calls them)."""
    data: tyro.conf.OmitArgPrefixes[DataConfig] = field(default_factory=DataConfig)
    precision: PrecisionName = "auto"
    """Precision of the corpus's and the queries' gradients (as `assay build --precision`)."""
    seed: int = 0
    """Seed of the statistics and normalizer samples (as `assay build --seed`)."""
    attention: Literal["auto", "sdpa", "eager"] = "auto"
    """Attention kernel (as `assay build --attention`)."""
    modules: tuple[str, ...] = DEFAULT_MODULES
    """Glob patterns choosing the linear layers (as `assay build --modules`)."""
    projection_dim: int = 16
    """Projection width per side (as `assay build --projection_dim`)."""
    projection_seed: int = 0
    """Seed of the projection matrices."""
    normalizer: Literal["none", "adafactor", "adam"] = "none"
    """Optimizer second-moment normalizer (as `assay build --normalizer`)."""
    optimizer_state: str | None = None
    """Second moments to use (as `assay build --optimizer_state`)."""
    normalizer_samples: int = 1000
    """Examples the second moments are estimated from (when no --optimizer_state)."""
    normalizer_beta2: float = 0.999
    """Second-moment decay of the estimate."""
    stats_samples: int = 10000
    """trackstar / influence: R_train is summed over this seeded sample of the corpus, computed in a
    first pass (the rows `assay build --preconditioner trackstar` would sum)."""
    stream_buffer_mib: int = 256
    """Memory for the statistics sample's rows, kept to be scored without computing them again."""

    def __post_init__(self) -> None:
        if self.stream_buffer_mib < 0:
            raise AssayError(f"--stream_buffer_mib must be >= 0, got {self.stream_buffer_mib}")

    def first_set_flag(self) -> str | None:
        """The first flag given another value than its default (None: all defaults)."""
        default = CorpusConfig()
        for f in dataclasses.fields(self):
            mine, theirs = getattr(self, f.name), getattr(default, f.name)
            if f.name == "data":
                names = [
                    d.name
                    for d in dataclasses.fields(mine)
                    if getattr(mine, d.name) != getattr(theirs, d.name)
                ]
                if names:
                    return names[0]
            elif mine != theirs:
                return f.name
        return None

    def build_config(self, device: str, token_batch_size: int, trust_remote_code: bool) -> BuildConfig:
        """The `assay build` settings whose rows are scored (validated as build validates them)."""
        model = ModelConfig(
            model=str(self.model), tokenizer=self.tokenizer, trust_remote_code=trust_remote_code,
            lora_rank=self.lora_rank, lora_alpha=self.lora_alpha, lora_modules=self.lora_modules,
        )  # fmt: skip
        runtime = RuntimeConfig(
            precision=self.precision, device=device, seed=self.seed, attention=self.attention
        )
        return BuildConfig(
            out="", model=model, data=self.data, runtime=runtime, modules=self.modules,
            projection_dim=self.projection_dim, projection_seed=self.projection_seed,
            token_batch_size=token_batch_size, normalizer=self.normalizer,
            optimizer_state=self.optimizer_state, normalizer_samples=self.normalizer_samples,
            normalizer_beta2=self.normalizer_beta2, stats_samples=self.stats_samples,
        )  # fmt: skip


def corpus_setup(build: BuildConfig, folder: Path) -> tuple[GradientSetup, Any, Examples]:
    """(setup, table, examples) of the corpus: the model, modules, projection and normalizer as
    `assay build` would use them (the normalizer saved in `folder`, reused when resuming)."""
    _, policy = setup_runtime(build.runtime)
    tokenizer = load_tokenizer(build.model)
    table, examples = load_examples(build.data, tokenizer)
    model = load_model(build.model, policy, build.runtime.attention)
    modules = linear_modules(model, build.modules)
    warn_silent_lora(model, modules)
    fingerprint = model_fingerprint(model)
    pad = tokenizer.pad_token_id
    normalizer = load_or_estimate_normalizer(build, folder, model, modules, examples, policy, pad)
    projector = Projector(build.projection_dim, build.projection_seed)
    setup = GradientSetup(model, tokenizer, policy, modules, projector, normalizer, pad, fingerprint)
    keep_compute_casts(model, policy)  # from here on the model only collects gradients
    return setup, table, examples


@dataclass
class StreamResult:
    """What a streamed scoring pass found."""

    top: TopRows
    """Top and bottom rows (positions in the corpus's examples) per score column."""
    whitening: Whitening | None
    """R^(-1/2) used (trackstar, influence)."""
    rows_computed: int
    """Gradients computed in this process (the corpus, plus sample rows that did not fit the buffer)."""
    seconds: float
    """Wall time of the passes."""


@dataclass
class Plan:
    """Which corpus positions each pass computes, in which batches (a pure function of the settings)."""

    sample: list[np.ndarray]  # batches of the statistics sample (positions), empty without statistics
    buffered: int  # leading sample batches whose rows are kept and scored after the sample pass
    rest: list[np.ndarray]  # batches of every position not buffered


def pass_plan(examples: Examples, build: BuildConfig, statistics: bool, buffer_rows: int) -> Plan:
    """The batches of the statistics pass and of the scoring pass."""
    tbs = build.token_batch_size
    sample: list[np.ndarray] = []
    if statistics:
        rows = sample_positions(len(examples), build.stats_samples, build.runtime.seed)
        sample = [rows[b] for b in token_batches(examples.subset(rows), tbs)]
    kept, total = 0, 0
    while kept < len(sample) and total + len(sample[kept]) <= buffer_rows:
        total += len(sample[kept])
        kept += 1
    buffered = np.concatenate(sample[:kept]) if kept else np.zeros(0, np.int64)
    rest = np.setdiff1d(np.arange(len(examples)), buffered)
    return Plan(sample, kept, [rest[b] for b in token_batches(examples.subset(rest), tbs)])


def stream_scores(
    setup: GradientSetup,
    examples: Examples,
    build: BuildConfig,
    queries: torch.Tensor,
    options: ScoreOptions,
    folder: Path,
    outputs: dict[str, np.ndarray],
    resumed: bool,
    buffer_mib: int = 256,
) -> StreamResult:
    """Score every example of the corpus against query gradients [Q, D] (module docstring).

    `outputs`: "losses" [N] and optionally "scores" [A, N] arrays (memmaps in `folder`) filled by
    position; `resumed`: continue from `folder`'s checkpoint if it has one."""
    statistics = options.mode in ("trackstar", "influence")
    dim = setup.collector().dim
    plan = pass_plan(examples, build, statistics, (buffer_mib << 20) // (4 * dim))
    columns = 1 if options.aggregate != "none" else queries.shape[0]
    state = _load_state(folder, options.top_k) if resumed else None
    start, computed = time.perf_counter(), 0
    whitening = None
    if state is None:
        top, done = RunningTop(columns, options.top_k), 0
        if statistics:
            sums, count, kept = _statistics_pass(setup, examples, plan)
            computed += sum(len(b) for b in plan.sample)
            ix.write_preconditioner(folder, sums, count)
            whitening = _whitening(sums, count, queries, setup, options)
            planned = plan_for(queries, options, whitening)
            for positions, rows, losses in kept:
                _score(planned, rows, positions, losses, top, outputs)
        _save_state(folder, 0, top, outputs)
    else:
        done, top = state
        if statistics:
            saved = ix.load_safetensors(folder / ix.PRECONDITIONER_FILE)
            count = int(saved.pop("__count__").item())
            whitening = _whitening(saved, count, queries, setup, options)
    planned = plan_for(queries, options, whitening)
    total, initial = sum(len(b) for b in plan.rest), sum(len(b) for b in plan.rest[:done])
    with Progress(total, "score", initial=initial) as bar:
        for k, (positions, grads, losses, batch) in enumerate(
            iter_gradients(setup, examples, plan.rest[done:]), done + 1
        ):
            refuse_non_finite(grads, losses, examples.ids[positions], setup.policy)
            _score(planned, grads, positions, losses, top, outputs)
            _save_state(folder, k, top, outputs)
            computed += len(positions)
            bar.update(len(positions), int(batch["attention_mask"].sum()))
    return StreamResult(top.result(), whitening, computed, time.perf_counter() - start)


def plan_for(queries: torch.Tensor, options: ScoreOptions, whitening: Whitening | None) -> QueryPlan:
    return plan_queries(queries, options.mode, options.aggregate, whitening)


def _whitening(
    sums: dict[str, torch.Tensor],
    count: int,
    queries: torch.Tensor,
    setup: GradientSetup,
    options: ScoreOptions,
) -> Whitening:
    """R^(-1/2) as `assay score` builds it from an index's statistics (influence: λ = 0 by default)."""
    slices = {s.name: slice(s.start, s.stop) for s in setup.collector().slots}
    mix = 0.0 if options.mode == "influence" and options.mix is None else options.mix
    return build_whitening(sums, count, queries, slices, mix, options.damping, options.mix_fraction)


def _statistics_pass(
    setup: GradientSetup, examples: Examples, plan: Plan
) -> tuple[dict[str, torch.Tensor], int, list[tuple[np.ndarray, torch.Tensor, torch.Tensor]]]:
    """(per-module fp32 Σ g gᵀ over the sample, its size, the buffered batches' (positions, [B, D]
    rows, [B] losses))."""
    slots = setup.collector().slots
    sums = {s.name: torch.zeros(s.stop - s.start, s.stop - s.start) for s in slots}
    kept = []
    with Progress(sum(len(b) for b in plan.sample), "statistics") as bar:
        for k, (positions, grads, losses, batch) in enumerate(iter_gradients(setup, examples, plan.sample)):
            refuse_non_finite(grads, losses, examples.ids[positions], setup.policy)
            rows = grads.cpu()
            with full_precision("cpu"):
                for s in slots:
                    x = rows[:, s.start : s.stop].to(STATS_DTYPE)
                    sums[s.name] += x.T @ x
            if k < plan.buffered:
                kept.append((positions, rows, losses.cpu()))
            bar.update(len(positions), int(batch["attention_mask"].sum()))
    return sums, sum(len(b) for b in plan.sample), kept


def _score(
    plan: QueryPlan,
    rows: torch.Tensor,
    positions: np.ndarray,
    losses: torch.Tensor,
    top: RunningTop,
    outputs: dict[str, np.ndarray],
) -> None:
    """Score rows [B, D] at corpus positions [B] into the running top-k and the per-row outputs."""
    scores = chunk_scores(plan, rows.to(plan.vectors.device, STATS_DTYPE))  # [A, B]
    top.update(scores.cpu(), 0, torch.from_numpy(np.asarray(positions, dtype=np.int64)))
    if "scores" in outputs:
        outputs["scores"][:, positions] = scores.cpu().numpy()
    outputs["losses"][positions] = losses.cpu().numpy()


def _save_state(folder: Path, batches_done: int, top: RunningTop, outputs: dict[str, np.ndarray]) -> None:
    """Checkpoint after the per-row outputs are on disk (atomic)."""
    for arr in outputs.values():
        flush = getattr(arr, "flush", None)
        if flush is not None:
            flush()
    tmp = folder / (STATE_FILE + ".tmp.npz")
    arrays: dict[str, Any] = {"batches_done": np.array(batches_done), **top.state()}
    np.savez(tmp, **arrays)
    os.replace(tmp, folder / STATE_FILE)


def _load_state(folder: Path, k: int) -> tuple[int, RunningTop] | None:
    path = folder / STATE_FILE
    if not path.exists():
        return None
    with np.load(path, allow_pickle=False) as saved:
        state = {name: saved[name] for name in saved.files}
    return int(state.pop("batches_done")), RunningTop.restore(state, k)
