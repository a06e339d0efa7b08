"""`assay build`: one projected loss gradient per example, streamed to a memory-mapped index.

Resumable: batches come in a deterministic (length-sorted) order; after each batch the rows
are flushed to `gradients.npy` and only then `progress.json` records the batch as done. A
killed run leaves `OUT.part/`; the same command again skips the finished batches and yields
the same index an uninterrupted run would have.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
import tyro
from torch import nn

from assay.attribution import index as ix
from assay.attribution.collector import (
    DEFAULT_MODULES,
    GradientCollector,
    Objective,
    linear_modules,
    warn_silent_lora,
)
from assay.attribution.index import save_preconditioner_stats
from assay.attribution.kfac import Kind, save_factors
from assay.attribution.kfac_fit import fit_kfac
from assay.attribution.normalizers import (
    Normalizer,
    estimate_normalizer,
    load_optimizer_state,
    sample_positions,
)
from assay.attribution.projection import Projector
from assay.core import fsdp
from assay.core.config import DataConfig, ModelConfig, RuntimeConfig, require_config
from assay.core.console import note
from assay.core.disk import reserve
from assay.core.distributed import Distributed
from assay.core.errors import AssayError
from assay.core.memory import reuse_freed_memory
from assay.core.precision import PrecisionPolicy
from assay.core.progress import Progress
from assay.core.runs import check_inputs, config_from_dict, config_to_dict, read_json, run_folder, write_json
from assay.lm.data import (
    Examples,
    collate,
    example_hashes,
    examples_fingerprint,
    load_examples,
    token_batches,
    tokenizer_fingerprint,
)
from assay.lm.lean import keep_compute_casts
from assay.lm.losses import example_losses
from assay.lm.models import (
    FINGERPRINT_VERSION,
    architecture_of,
    load_model,
    load_sharded_model,
    load_tokenizer,
    model_fingerprint,
    setup_runtime,
)
from assay.lm.packing import pack, packable, saves_padding

PROGRESS_FILE = "progress.json"
FLOAT16_MAX = 65504.0
MAX_PROJECTION = 2048  # p² numbers per module and example: 4M at this width


@dataclass
class BuildConfig:
    """Compute one projected loss gradient per example and stream it to an on-disk index."""

    out: tyro.conf.Positional[str]
    """Output index folder (written as OUT.part/ and renamed when complete; resumable)."""
    model: tyro.conf.OmitArgPrefixes[ModelConfig] = field(default_factory=ModelConfig)
    data: tyro.conf.OmitArgPrefixes[DataConfig] = field(default_factory=DataConfig)
    runtime: tyro.conf.OmitArgPrefixes[RuntimeConfig] = field(default_factory=RuntimeConfig)
    modules: tuple[str, ...] = DEFAULT_MODULES
    """Glob patterns over module names choosing the linear layers; `!` excludes. Only trainable
    layers count (with a LoRA adapter: its A/B layers). A mixture of experts' experts count as
    two layers each (`*.experts.gate_up.E`, `*.experts.down.E`). Default: all but the output head."""
    projection_dim: int = 16
    """Projection width per side: each module stores a p×p block. 0 stores raw weight gradients."""
    projection_seed: int = 0
    """Seed of the projection matrices (queries must use the index's)."""
    token_batch_size: int = 2048
    """Most tokens (padding included) per batch; bounds memory."""
    store_dtype: Literal["float32", "float16"] = "float32"
    """Dtype of the stored rows. float32 is exact and cannot overflow; float16 halves the disk,
    lets `assay score` screen rows with fp16 GEMMs (inner, influence and cosine 1.4–1.6× faster
    than on float32 rows; docs/BENCHMARKS.md), and fails with a clear error (never silently) if
    a value exceeds 65504."""
    normalizer: Literal["none", "adafactor", "adam"] = "none"
    """Divide gradients by the square root of an optimizer's second moments (fp32)."""
    optimizer_state: str | None = None
    """Second moments to use: an `assay finetune` run folder (its optimizer_state.safetensors) or
    a torch / HF Trainer optimizer.pt (Adam or Adafactor); without it they are estimated from
    --normalizer_samples examples."""
    normalizer_samples: int = 1000
    """Examples the second moments are estimated from (when no --optimizer_state)."""
    normalizer_beta2: float = 0.999
    """Second-moment decay used for the estimate (Adam's default)."""
    preconditioner: Literal["none", "trackstar", "kfac", "ekfac"] = "none"
    """trackstar: save per-module sums of g gᵀ (fp32) of the stored rows for TrackStar's R^(-1/2)
    (and `--mode influence` on the projected rows). kfac / ekfac: also fit Kronecker-factored
    curvature of the model (A = E[a aᵀ], G = E[g gᵀ] per layer, eigendecomposed in fp64; EK-FAC
    refits the eigenvalues on per-example gradients) over the same sample, for `assay score
    --mode influence` (docs/attribution.md). Needs --normalizer none."""
    stats_samples: int = 10000
    """Examples (a seeded sample of the index) the preconditioner statistics sum over."""
    compile: bool = False
    """torch.compile the collector's elementwise steps (SwiGLU gates and RMSNorms, forward and
    backward) into fused kernels. The same rows up to rounding; compiling takes seconds up front,
    so it pays on long runs (docs/BENCHMARKS.md). On CPU it needs a C++ compiler."""
    fsdp: bool = False
    """Under torchrun: shard the model's weights over the processes (FSDP2, one unit per decoder
    block) for models that do not fit on one device. Same index; see docs/distributed.md."""
    overwrite: bool = False
    """Replace a finished index in OUT."""
    append: bool = False
    """Add the rows of --dataset to the finished index in OUT (same model, projection, normalizer,
    modules and preconditioner: the index's settings are used, a flag set to another value is
    refused). Resumable; OUT stays a whole index until the append is done (docs/index-format.md)."""
    id_offset: int | None = None
    """With --append: added to the new dataset's row ids (default: one more than the index's largest
    id). Ids already in the index are refused."""

    def __post_init__(self) -> None:
        if not 0 <= self.projection_dim <= MAX_PROJECTION:
            raise AssayError(
                f"--projection_dim must be in [0, {MAX_PROJECTION}] (0: raw weight gradients), "
                f"got {self.projection_dim}"
            )
        if not 0.0 <= self.normalizer_beta2 < 1.0:
            raise AssayError(f"--normalizer_beta2 must lie in [0, 1), got {self.normalizer_beta2}")
        if self.token_batch_size < 1:
            raise AssayError(f"--token_batch_size must be positive, got {self.token_batch_size}")
        if self.optimizer_state and self.normalizer == "none":
            raise AssayError("--optimizer_state needs --normalizer adafactor or adam")
        if self.preconditioner in ("kfac", "ekfac") and self.normalizer != "none":
            raise AssayError(
                f"--preconditioner {self.preconditioner} is the curvature of the plain loss gradients; "
                "build with --normalizer none"
            )
        if self.preconditioner in ("kfac", "ekfac") and self.fsdp:
            raise AssayError(f"--preconditioner {self.preconditioner} is not available with --fsdp yet")
        if min(self.normalizer_samples, self.stats_samples) < 1:
            raise AssayError("--normalizer_samples and --stats_samples must be positive")
        if self.id_offset is not None and (not self.append or self.id_offset < 0):
            raise AssayError("--id_offset goes with --append and must be >= 0")
        if self.append and self.overwrite:
            raise AssayError("--append adds to the index in OUT; --overwrite would replace it: choose one")


@dataclass
class GradientSetup:
    """Everything needed to compute gradients exactly as an index did."""

    model: nn.Module
    tokenizer: Any
    policy: PrecisionPolicy
    modules: dict[str, nn.Module]
    projector: Projector
    normalizer: Normalizer | None
    pad_id: int
    fingerprint: str | None = None
    """The model's fingerprint when it was checked against an index (saves hashing it again)."""
    packed: bool = True
    """Run the language-model loss on packed, padding-free batches where the model allows
    (`assay.lm.packing`); False keeps right-padded batches (the same rows up to rounding)."""
    compiled: bool = False
    """Run the collector's elementwise steps as compiled kernels (--compile)."""

    def collector(self) -> GradientCollector:
        return GradientCollector(
            self.model, self.modules, self.projector, self.policy, self.normalizer, compiled=self.compiled
        )


def iter_gradients(
    setup: GradientSetup,
    examples: Examples,
    batches: list[np.ndarray],
    objective: Objective | None = None,
) -> Iterator[tuple[np.ndarray, torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]]:
    """(positions, [B, D] fp32 gradients, [B] fp32 objective values, batch) per token batch.

    The language-model loss runs on packed batches where the model allows and packing saves
    enough padding (`assay.lm.packing`): the same gradients without computing the padding."""
    packed = setup.packed and objective is None and packable(setup.model)
    objective = objective or example_losses
    with setup.collector() as col:
        for positions in batches:
            if packed and saves_padding(examples, positions):
                batch = pack(examples, positions, setup.policy.device)
            else:
                batch = collate(examples, positions, setup.pad_id, setup.policy.device)
            grads, values = col.gradients(batch, objective)
            yield positions, grads, values, batch


def collect(
    setup: GradientSetup, examples: Examples, token_batch_size: int, objective: Objective | None = None
) -> np.ndarray:
    """[N, D] float32 gradients of `examples`, in their order (e.g. queries for scoring)."""
    dim = layout_dim(setup)
    out = np.zeros((len(examples), dim), dtype=np.float32)
    batches = token_batches(examples, token_batch_size)
    with Progress(len(examples), "gradients") as bar:
        for positions, grads, _, batch in iter_gradients(setup, examples, batches, objective):
            out[positions] = grads.cpu().numpy()
            bar.update(len(positions), int(batch["attention_mask"].sum()))
    return out


def layout_dim(setup: GradientSetup) -> int:
    return setup.collector().dim


def setup_from_index(
    index: ix.GradientIndex, device: str = "auto", trust_remote_code: bool = False
) -> GradientSetup:
    """Load model, tokenizer, policy, modules, projector and normalizer as the index was built.

    `trust_remote_code` comes from the caller (the command line), never from the index's saved
    config: an index received from someone else must not run code shipped with its model."""
    cfg = config_from_dict(BuildConfig, index.meta["config"], trust_remote_code=trust_remote_code)
    runtime = dataclasses.replace(cfg.runtime, device=device, precision=index.meta["precision"])
    _, policy = setup_runtime(runtime)
    tensors = index.normalizer_tensors()  # before loading a model: a missing file is refused at once
    normalizer = Normalizer(index.meta["normalizer"], tensors) if tensors else None
    tokenizer = load_tokenizer(cfg.model)
    ix.check_tokenizer(index.meta, tokenizer, index.path)  # both before the weights load
    ix.check_architecture(index.meta, cfg.model, index.path)
    model = load_model(cfg.model, policy, cfg.runtime.attention)
    fingerprint = ix.index_fingerprint(model, index.meta)
    if fingerprint != index.meta["model"]["fingerprint"]:
        raise AssayError(f"model {cfg.model.model!r} is not the one {index.path} was built with")
    modules = linear_modules(model, cfg.modules)
    if list(modules) != list(index.modules):
        raise AssayError(f"{index.path}: the model's modules differ from the index's")
    projector = Projector(index.meta["projection_dim"], index.meta["projection_seed"])
    pad = tokenizer.pad_token_id
    return GradientSetup(model, tokenizer, policy, modules, projector, normalizer, pad, fingerprint)


def build_index(cfg: BuildConfig) -> dict[str, Any]:
    """Build (or resume) the index in cfg.out, or with --append add rows to it; returns its metadata
    and throughput."""
    require_config(cfg, BuildConfig, "build_index's config")
    if cfg.append:
        from assay.attribution.append import append_index  # it builds on this module

        return append_index(cfg)
    dist = Distributed.current()
    if cfg.fsdp:
        fsdp.require_processes(dist)  # before OUT.part exists
    with run_folder(cfg.out, "build", cfg, cfg.overwrite) as run:
        _, policy = setup_runtime(cfg.runtime)
        tokenizer = load_tokenizer(cfg.model)
        _, examples = load_examples(cfg.data, tokenizer)
        if cfg.fsdp:
            model = load_sharded_model(cfg.model, policy, cfg.runtime.attention, dist)
        else:
            model = load_model(cfg.model, policy, cfg.runtime.attention)
        modules = linear_modules(model, cfg.modules)
        warn_silent_lora(model, modules)
        fingerprint = model_fingerprint(model)  # of the fp32 weights, before any cast
        inputs = {"dataset": examples_fingerprint(examples), "model": fingerprint}
        check_inputs(run, {**inputs, "tokenizer": tokenizer_fingerprint(tokenizer)})
        # Rank 0 estimates the normalizer and saves it, the others then load that file; with
        # sharded weights every rank must join its forward/backward passes, so all estimate.
        with nullcontext() if cfg.fsdp else dist.main_first():
            pad = tokenizer.pad_token_id
            normalizer = load_or_estimate_normalizer(cfg, run.path, model, modules, examples, policy, pad)
        if cfg.preconditioner in ("kfac", "ekfac"):
            fit_curvature(cfg, run.path, model, modules, examples, policy, tokenizer.pad_token_id)
        projector = Projector(cfg.projection_dim, cfg.projection_seed)
        setup = GradientSetup(
            model, tokenizer, policy, modules, projector, normalizer, tokenizer.pad_token_id, fingerprint,
            compiled=cfg.compile,
        )  # fmt: skip
        col = setup.collector()
        meta = index_metadata(cfg, setup, col, len(examples), tokenizer)
        keep_compute_casts(model, policy)  # from here on the model only collects gradients
        if dist.is_main:
            write_json(run.path / ix.META_FILE, meta)
            np.save(run.path / ix.IDS_FILE, examples.ids.astype(np.int64))
            np.save(run.path / ix.HASHES_FILE, example_hashes(examples))
        if cfg.runtime.keep_freed_memory:
            reuse_freed_memory()  # after loading: the load's transient copies still go back
        summary = write_rows(setup, examples, run.path, cfg)
        if ix.keeps_stats(meta):
            save_preconditioner_stats(run.path, meta, cfg.stats_samples, cfg.runtime.seed)
        dist.barrier()  # every file is written before rank 0 records their checksums
        if dist.is_main:
            ix.write_checksums(run.path, meta)
    return {**meta, **summary}


def index_metadata(
    cfg: BuildConfig, setup: GradientSetup, col: GradientCollector, num_examples: int, tok: Any
) -> dict[str, Any]:
    """index.json of an index of `num_examples` rows computed with `setup` (see docs/index-format.md)."""
    lora = None
    if cfg.model.lora_rank > 0 or (Path(cfg.model.model) / "adapter_config.json").exists():
        lora = {"rank": cfg.model.lora_rank, "alpha": cfg.model.lora_alpha, "adapter": cfg.model.model}
    return {
        "format": "assay-gradient-index",
        "format_version": ix.FORMAT_VERSION,
        "num_examples": num_examples,
        "dim": col.dim,
        "modules": [
            {"name": s.name, "start": s.start, "stop": s.stop, "shape": list(s.shape)} for s in col.slots
        ],
        "projection_dim": cfg.projection_dim,
        "projection_seed": cfg.projection_seed,
        "projection": "rademacher/sqrt(p), per module and side; block = P_out · ∇W(out×in) · P_inᵀ",
        "precision": setup.policy.name,
        "store_dtype": cfg.store_dtype,
        "normalizer": cfg.normalizer,
        "preconditioner": cfg.preconditioner,
        "model": {
            "name": cfg.model.model,
            "fingerprint": setup.fingerprint or model_fingerprint(setup.model),
            "fingerprint_version": FINGERPRINT_VERSION,
            "tokenizer_fingerprint": tokenizer_fingerprint(tok),
            "architecture": architecture_of(setup.model.config),
            "lora": lora,
        },
        "data": dataclasses.asdict(cfg.data),
        "objective": "lm_loss",
        "token_batch_size": cfg.token_batch_size,
        "config": config_to_dict(cfg),
    }


def load_or_estimate_normalizer(
    cfg, folder: Path, model, modules, examples, policy, pad_id
) -> Normalizer | None:
    """Load it from the run folder when resuming (never re-estimate), else load or estimate."""
    if cfg.normalizer == "none":
        return None
    path = folder / ix.NORMALIZER_FILE
    if path.exists():
        return Normalizer.load(path)
    if cfg.optimizer_state:
        normalizer = load_optimizer_state(cfg.optimizer_state, cfg.normalizer, model, modules)
    else:
        sample = examples.subset(sample_positions(len(examples), cfg.normalizer_samples, cfg.runtime.seed))
        note(f"estimating {cfg.normalizer} second moments from {len(sample)} examples")
        with fsdp.same_batch_on_every_rank(model):  # --fsdp: all ranks run the sample together
            normalizer = estimate_normalizer(
                cfg.normalizer,
                model,
                modules,
                sample,
                policy,
                pad_id,
                cfg.token_batch_size,
                cfg.normalizer_beta2,
            )
    if Distributed.current().is_main:
        normalizer.save(path)
    return normalizer


def fit_curvature(
    cfg: BuildConfig, folder: Path, model: nn.Module, modules: dict[str, nn.Module], examples: Examples,
    policy: PrecisionPolicy, pad_id: int,
) -> None:  # fmt: skip
    """K-FAC / EK-FAC factors of the loss over a seeded sample of --stats_samples examples, saved to
    kfac.safetensors (kept when resuming). Under torchrun each rank fits its share of the batches
    and the sums are reduced, so every rank ends with the same factors; rank 0 saves them."""
    path = folder / ix.KFAC_FILE
    if path.exists():
        return
    sample = examples.subset(sample_positions(len(examples), cfg.stats_samples, cfg.runtime.seed))
    dist = Distributed.current()
    shares = dist.interleave_padded(token_batches(sample, cfg.token_batch_size))
    batches = [collate(sample, p, pad_id, policy.device) for p in shares if p is not None]
    note(f"fitting {cfg.preconditioner} curvature over {len(sample)} examples")
    kind: Kind = "kfac" if cfg.preconditioner == "kfac" else "ekfac"
    factors = fit_kfac(model, batches, example_losses, kind, modules, policy, dist=dist)
    if dist.is_main:
        save_factors(factors, path)
    dist.barrier()


def _open_arrays(folder: Path, n: int, dim: int, store_dtype: str) -> tuple[list[Any], bool]:
    """The row memmaps, reopened for resuming, or created empty (then `fresh` is True)."""
    specs = [(ix.GRADIENTS_FILE, (n, dim), store_dtype), (ix.LOSSES_FILE, (n,), "float32")]
    specs += [(ix.TOKENS_FILE, (n,), "int64"), (ix.NORMS_FILE, (n,), "float32")]
    arrays, fresh = [], False
    for name, shape, dtype in specs:
        path = folder / name
        arr = None
        if path.exists():
            try:
                arr = np.lib.format.open_memmap(path, mode="r+")
            except (ValueError, OSError):  # killed while the file was being created
                arr = None
        if arr is None or arr.shape != shape or arr.dtype != np.dtype(dtype):
            arr = np.lib.format.open_memmap(path, mode="w+", dtype=dtype, shape=shape)
            fresh = True
        reserve(path)  # every block allocated now: a full disk is one line here, never a SIGBUS later
        arrays.append(arr)
    return arrays, fresh


def write_rows(setup: GradientSetup, examples: Examples, folder: Path, cfg: BuildConfig) -> dict[str, Any]:
    """Stream every example's gradient row to disk, batch by batch, resumably."""
    dim = setup.collector().dim
    dist = Distributed.current()
    with dist.main_first():  # rank 0 creates (or checks) the memmaps; the others open them
        arrays, fresh = _open_arrays(folder, len(examples), dim, cfg.store_dtype)
    grads_out, losses_out, tokens_out, norms_out = arrays
    fresh = bool(dist.broadcast_object(fresh))
    # Each rank takes every world-th batch (length-sorted, so shares are balanced) and writes
    # its own rows. Every rank runs the same number of batches (a short share repeats a batch
    # and discards its rows): with --fsdp each forward/backward is a collective.
    every = token_batches(examples, cfg.token_batch_size)
    batches = dist.interleave_padded(every)
    progress = folder / dist.rank_file(PROGRESS_FILE)
    done = int(read_json(progress)["batches_done"]) if progress.exists() and not fresh else 0
    done = min(dist.gather(done))  # ranks resume in step (redoing a batch gives the same rows)
    if done:
        note(f"resuming: {done} of {len(batches)} batches already done")
    loss_tokens = examples.num_loss_tokens()
    initial = int(sum(len(b) for b in batches[:done] if b is not None))
    total = int(sum(len(b) for b in batches if b is not None))
    with Progress(total, "build", enabled=dist.is_main, initial=initial) as bar:
        todo = [every[0] if b is None else b for b in batches[done:]]
        for k, (positions, grads, losses, batch) in enumerate(
            iter_gradients(setup, examples, todo), done + 1
        ):
            if batches[k - 1] is not None:
                refuse_non_finite(grads, losses, examples.ids[positions], setup.policy)
                stored = _to_store(grads, cfg.store_dtype)
                grads_out[positions] = stored
                norms_out[positions] = np.linalg.norm(stored.astype(np.float32, copy=False), axis=1)
                losses_out[positions] = losses.cpu().numpy()
                tokens_out[positions] = loss_tokens[positions]
                for arr in arrays:
                    arr.flush()  # type: ignore[attr-defined]
                bar.update(len(positions), int(batch["attention_mask"].sum()))
            write_json(progress, {"batches_done": k, "num_batches": len(batches)})
        elapsed = max(time.perf_counter() - bar.start, 1e-9)
    tokens, resumed = dist.sum_scalars(bar.tokens, done)
    elapsed = max(dist.gather(elapsed))  # the job's wall time is the slowest rank's
    return {"tokens_per_s": tokens / elapsed, "seconds": elapsed, "resumed_batches": int(resumed)}


def refuse_non_finite(
    grads: torch.Tensor, losses: torch.Tensor, ids: np.ndarray, policy: PrecisionPolicy
) -> None:
    """One line naming the first example whose gradient row [D] or loss is inf or NaN: such a row
    would score NaN against every query (and NaN sorts as the best)."""
    finite = torch.isfinite(grads).all(dim=1) & torch.isfinite(losses)  # [B]
    if bool(finite.all()):
        return
    first = int(ids[int((~finite).nonzero()[0])])
    hint = (
        "fp16 overflowed; rebuild with --precision bf16 or fp32"
        if policy.name == "fp16"
        else "check that example's text, or rebuild with --precision fp32"
    )
    raise AssayError(f"example {first} has a non-finite gradient or loss (inf/NaN) at {policy.name}: {hint}")


def _to_store(grads: torch.Tensor, store_dtype: str) -> np.ndarray:
    """[B, D] fp32 -> store dtype; float16 refuses (loudly) to overflow."""
    rows = grads.cpu().numpy()
    if store_dtype == "float16":
        peak = float(np.abs(rows).max()) if rows.size else 0.0
        if peak > FLOAT16_MAX:
            raise AssayError(
                f"a gradient value ({peak:.3g}) exceeds float16's range (65504); "
                "rebuild with --store_dtype float32"
            )
    return rows.astype(store_dtype)
