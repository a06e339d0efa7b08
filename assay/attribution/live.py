"""Per-example gradients from a training loop's own backward, written as an index (what the
trainer callback and the plain-loop recorder of assay.integrations run on).

The collector's hooks ride along the loop's forward and backward: the weights keep
`requires_grad` and nothing the loop computes changes; each hooked layer adds its projections
and one batched product per backward. The loop's loss is not what an index stores, though: it
is the batch's mean token loss (or, under gradient accumulation, the sum over its tokens divided
by `num_items_in_batch`), and its backward may be scaled further (1/accumulation steps, an fp16
loss scale). Examples do not interact in a causal LM's forward, so example i's part of the
backward is k·∇s_i / c, with s_i its summed token loss (the index's objective), c the loss's
divisor and k = ∂(what is backpropagated)/∂loss. c is read from the forward (`num_items_in_batch`,
else the batch's target tokens) and checked against Σ s_i / loss, which refuses any other loss
(label smoothing, a custom loss) in one line; k is read by a hook on the loss tensor. Each row is
then multiplied by c / k: the row `assay build` computes for that example and model state, up to
the order of fp32 sums (tested in a real Trainer run).

An index of the examples of one optimizer step: its rows, their losses and loss-token counts, the
examples' texts (`examples.jsonl`, decoded from their tokens: its dataset, so `assay score` shows
them) and a copy of the model as it was at that step (`model/`, what `assay score` loads and
checks the fingerprint of). The optimizer's live second moments are its normalizer.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from torch import nn

from assay.attribution import index as ix
from assay.attribution.build import BuildConfig, GradientSetup, index_metadata
from assay.attribution.collector import DEFAULT_MODULES, GradientCollector, linear_modules
from assay.attribution.normalizers import Normalizer, live_optimizer_state
from assay.attribution.projection import Projector
from assay.core.config import DataConfig, ModelConfig, PrecisionName, RuntimeConfig
from assay.core.console import warn
from assay.core.distributed import Distributed
from assay.core.errors import AssayError
from assay.core.precision import PrecisionPolicy, full_precision
from assay.core.runs import RunFolder, write_json
from assay.lm.losses import token_losses
from assay.lm.models import model_fingerprint

MODEL_DIR = "model"
EXAMPLES_FILE = "examples.jsonl"
LOSS_TOLERANCE = 1e-3  # relative: fp32 rounding is ~1e-6; label smoothing 0.1 is off by ~10%


@dataclass
class LiveConfig:
    """What the rows collected during training are (as `assay build`'s flags of the same names)."""

    projection_dim: int = 16
    """Projection width per side: each module stores a p×p block (0: raw weight gradients)."""
    projection_seed: int = 0
    """Seed of the projection matrices (queries are projected with the index's)."""
    modules: tuple[str, ...] = DEFAULT_MODULES
    """Glob patterns over module names choosing the linear layers; `!` excludes."""
    normalizer: Literal["none", "adafactor", "adam"] = "adafactor"
    """Divide by the square root of the optimizer's live second moments (its state at the step):
    adafactor (the default) reads Adafactor's factors, or an Adam(W)'s moments factored into row
    and column means (bergson's `to_adafactor`), which fold into the projections; adam divides
    each example's full weight gradient by Adam's exact moments, which makes the hooks form every
    per-example weight gradient (+59-68% of a SmolLM2-135M step on 2 CPU cores against +2-15%;
    docs/BENCHMARKS.md); none."""
    store_dtype: Literal["float32", "float16"] = "float32"
    """Dtype of the stored rows (as `assay build --store_dtype`)."""
    max_length: int = 512
    """Tokens a query is cut to when `assay score` reads the index (the index's --max_length)."""
    overwrite: bool = False
    """Replace an index already in the folder of a step."""

    def __post_init__(self) -> None:
        if not 0 <= self.projection_dim <= 2048:
            raise AssayError(f"projection_dim must be in [0, 2048], got {self.projection_dim}")
        if self.max_length < 2:
            raise AssayError(f"max_length must be at least 2, got {self.max_length}")


@dataclass
class LiveBatch:
    """One micro-batch's rows, as an index stores them."""

    rows: torch.Tensor  # [B, D] fp32: gradients of each example's summed token loss
    losses: torch.Tensor  # [B] fp32 summed token losses
    loss_tokens: np.ndarray  # [B] int64 target tokens
    tokens: list[np.ndarray]  # each example's tokens (attention mask 1)


class LiveCollector(GradientCollector):
    """The collector's hooks on a model being trained, plus a hook on the model itself: every
    training forward called with `labels=` starts a micro-batch, whose rows `finish` returns once
    its backward is done (module docstring)."""

    def attach(self) -> None:
        super().attach()
        self._batch: dict[str, Any] | None = None
        self._done: list[LiveBatch] = []
        model_hooks = (
            self.model.register_forward_pre_hook(self._begin, with_kwargs=True),
            self.model.register_forward_hook(self._end, with_kwargs=True),
        )
        self._handles.extend(model_hooks)

    def _begin(self, module: nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        if not (module.training and torch.is_grad_enabled()):
            return
        self._collect()
        self._saved, self._blocks, self._pending = {}, {}, None
        self._use_mask(kwargs.get("attention_mask"))

    def _end(self, module: nn.Module, args: Any, kwargs: dict[str, Any], output: Any) -> None:
        if not (module.training and torch.is_grad_enabled()):
            return
        labels, loss = kwargs.get("labels"), getattr(output, "loss", None)
        if labels is None or loss is None or not loss.requires_grad or "input_ids" not in kwargs:
            raise AssayError(
                "collecting gradients during training needs the model called with input_ids= and labels= "
                "and its own loss backpropagated"
            )
        with full_precision(labels.device):
            losses = token_losses(output.logits.detach(), labels).sum(dim=1)  # [B] fp32
        targets = (labels[:, 1:] != -100).sum(dim=1)
        given = kwargs.get("num_items_in_batch")
        divisor = float(given) if given is not None else float(targets.sum())
        value = float(loss.detach())
        if abs(float(losses.sum()) / max(divisor, 1.0) - value) > LOSS_TOLERANCE * max(abs(value), 1e-6):
            raise AssayError(
                "the model's loss is not the mean token cross-entropy of its labels (label smoothing? a "
                "custom loss?): per-example gradients cannot be read from its backward"
            )
        mask = kwargs.get("attention_mask")
        ids = kwargs["input_ids"].detach().cpu().numpy()
        keep = mask.detach().cpu().numpy().astype(bool) if mask is not None else np.ones_like(ids, bool)
        self._batch = {
            "divisor": divisor, "losses": losses.detach().cpu(), "targets": targets.cpu().numpy(),
            "tokens": [row[k] for row, k in zip(ids, keep)], "scale": None,
        }  # fmt: skip
        batch = self._batch
        loss.register_hook(lambda g: batch.__setitem__("scale", float(g)))

    def _collect(self) -> None:
        """Rows of the micro-batch whose backward has run (none pending: nothing)."""
        batch, self._batch = self._batch, None
        if batch is None:
            return
        if batch["scale"] is None:
            raise AssayError("a training forward was not followed by the backward of its loss")
        size = len(batch["tokens"])
        rows = self._assemble(size) * (batch["divisor"] / batch["scale"])
        self._saved, self._blocks, self._pending, self._mask = {}, {}, None, None
        if not bool(torch.isfinite(rows).all()):  # an fp16 step the loss scaler skips
            warn(
                "a micro-batch's gradients overflowed (its step is skipped by the loss scaler): rows left out"
            )
            return
        self._done.append(
            LiveBatch(rows.cpu(), batch["losses"], batch["targets"].astype(np.int64), batch["tokens"])
        )

    def finish(self) -> list[LiveBatch]:
        """The micro-batches collected since attaching (the last one's backward must have run)."""
        self._collect()
        done, self._done = self._done, []
        return done


class StepRecorder:
    """One step's index: `begin` (before the step's forward: the model copy, the optimizer's second
    moments, the hooks), the loop's forward and backward, `end` (the rows written, OUT committed).

    Under data parallelism (torchrun, DDP: every rank holds the whole model and the same optimizer
    state) each rank records its own micro-batches; rank 0 gathers them, in rank order, and writes
    the one index (the model copy and the normalizer are rank 0's, equal on every rank)."""

    def __init__(
        self, out: Path | str, cfg: LiveConfig, model: Any, tokenizer: Any, precision: PrecisionName
    ):
        if tokenizer is None:
            raise AssayError("collecting gradients during training needs the tokenizer (texts and queries)")
        self.out, self.cfg, self.model, self.tokenizer = Path(out).resolve(), cfg, model, tokenizer
        device = next(model.parameters()).device
        self.policy = PrecisionPolicy.resolve(precision, device)
        self.build = BuildConfig(
            out=str(self.out), model=ModelConfig(model=str(self.out / MODEL_DIR)),
            data=DataConfig(dataset=str(self.out / EXAMPLES_FILE), max_length=cfg.max_length),
            runtime=RuntimeConfig(precision=self.policy.name), modules=cfg.modules,
            projection_dim=cfg.projection_dim, projection_seed=cfg.projection_seed,
            store_dtype=cfg.store_dtype, normalizer=cfg.normalizer,
        )  # fmt: skip
        self.dist = Distributed.current()
        self.run: RunFolder | None = None
        self.collector: LiveCollector | None = None
        self.setup: GradientSetup | None = None

    def begin(self, optimizer: Any = None) -> None:
        modules = linear_modules(self.model, self.cfg.modules)
        normalizer: Normalizer | None = None
        if self.cfg.normalizer != "none":
            if optimizer is None:
                raise AssayError(f"normalizer {self.cfg.normalizer} reads the optimizer: pass it")
            normalizer = live_optimizer_state(optimizer, self.cfg.normalizer, modules)
        self.dist.main_only(self._open)
        projector = Projector(self.cfg.projection_dim, self.cfg.projection_seed)
        fingerprint = model_fingerprint(self.model)
        pad = self.tokenizer.pad_token_id
        setup = GradientSetup(
            self.model, self.tokenizer, self.policy, modules, projector, normalizer, pad, fingerprint
        )
        self.setup = setup
        self.collector = LiveCollector(self.model, modules, projector, self.policy, normalizer)
        self.collector.attach()

    def _open(self) -> None:
        """The run folder, with the weights the step's rows are taken at (rank 0)."""
        self.run = RunFolder(self.out, "build", self.build, self.cfg.overwrite, resumable=False).open()
        self.model.save_pretrained(self.run.path / MODEL_DIR)
        self.tokenizer.save_pretrained(self.run.path / MODEL_DIR)

    def end(self) -> Path | None:
        """Write and commit the index (None when no training forward ran while recording)."""
        assert self.collector is not None and self.setup is not None
        try:
            batches = self.collector.finish()
        finally:
            self.collector.detach()
        batches = [b for part in self.dist.gather(batches) for b in part]  # rank order
        if not batches:
            self.abandon()
            return None
        self.dist.main_only(self._write, batches)
        return self.out

    def _write(self, batches: list[LiveBatch]) -> None:
        assert self.run is not None and self.setup is not None and self.collector is not None
        write_live_index(self.run.path, self.build, self.setup, self.collector, batches)
        self.run.commit()

    def abandon(self) -> None:
        """After a failure (or nothing collected): hooks removed, the unfinished folder dropped."""
        if self.collector is not None:
            self.collector.detach()
        if self.run is not None:
            shutil.rmtree(self.run.path, ignore_errors=True)
            self.run.close()


def write_live_index(
    folder: Path, cfg: BuildConfig, setup: GradientSetup, col: GradientCollector, batches: list[LiveBatch]
) -> None:
    """The index files of `batches` in `folder` (as `assay build` writes them)."""
    rows = torch.cat([b.rows for b in batches]).numpy()
    stored = rows.astype(cfg.store_dtype)
    if cfg.store_dtype == "float16" and np.abs(rows).max(initial=0.0) > 65504:
        raise AssayError("a gradient value exceeds float16's range (65504): use store_dtype float32")
    meta = index_metadata(cfg, setup, col, len(rows), setup.tokenizer)
    meta["collected"] = "during training (assay.integrations): the loop's own backward"
    write_json(folder / ix.META_FILE, meta)
    np.save(folder / ix.GRADIENTS_FILE, stored)
    np.save(folder / ix.IDS_FILE, np.arange(len(rows), dtype=np.int64))
    np.save(folder / ix.LOSSES_FILE, torch.cat([b.losses for b in batches]).numpy().astype(np.float32))
    np.save(folder / ix.TOKENS_FILE, np.concatenate([b.loss_tokens for b in batches]))
    np.save(folder / ix.NORMS_FILE, np.linalg.norm(stored.astype(np.float32), axis=1).astype(np.float32))
    if setup.normalizer is not None:
        setup.normalizer.save(folder / ix.NORMALIZER_FILE)
    tokens = [t for b in batches for t in b.tokens]
    with open(folder / EXAMPLES_FILE, "w") as f:
        for seq in tokens:
            f.write(
                json.dumps({"text": setup.tokenizer.decode(seq.tolist(), skip_special_tokens=True)}) + "\n"
            )
    ix.write_checksums(folder, meta)


def precision_of(bf16: bool, fp16: bool) -> PrecisionName:
    """The precision name of a loop's mixed precision (bf16 or fp16 autocast, else fp32)."""
    return "bf16" if bf16 else "fp16" if fp16 else "fp32"
