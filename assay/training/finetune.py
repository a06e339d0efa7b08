"""`assay finetune`: causal-LM fine-tuning (full or LoRA) under the project's precision policy.

Precision: bf16/fp16 run forward and backward under autocast over fp32 master weights;
AdamW's moments and every update stay fp32 (fp16 adds dynamic loss scaling). bf16-pure
keeps weights, gradients and Adam's moments in bf16 (what peers call "pure bf16"; small
updates can round away). fp32 is the reference.

The recipe (optimizer, schedule, batches) is training/recipe.py's TrainRecipe and one optimizer
step is training/step.py's; this module holds the run: data, resume, evaluation, outputs.
"""

from __future__ import annotations

import hashlib
import shutil
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import tyro

from assay.core import fsdp
from assay.core.config import DataConfig, ModelConfig, RuntimeConfig, is_single_file, require_config
from assay.core.console import note
from assay.core.distributed import Distributed
from assay.core.errors import AssayError
from assay.core.memory import reuse_freed_memory
from assay.core.precision import PrecisionPolicy, check_finite
from assay.core.progress import Progress
from assay.core.runs import check_inputs, config_to_dict, run_folder, write_json
from assay.lm.data import Examples, examples_fingerprint, load_examples, tokenizer_fingerprint
from assay.lm.models import (
    load_model,
    load_sharded_model,
    load_tokenizer,
    model_fingerprint,
    name_adapter_base,
    setup_runtime,
)
from assay.training import checkpoint as ckpt
from assay.training.metrics import MetricsLog, start_wandb
from assay.training.recipe import TrainRecipe
from assay.training.step import make_scaler, mean_loss, optimizer_update, train_step
from assay.training.subset import ORDER_FILE, read_ids, read_weights, replayed_plan, shuffled_plan, write_plan


@dataclass
class FinetuneConfig:
    """Fine-tune a causal LM (full or LoRA) on a dataset or on a selected subset of it."""

    out: tyro.conf.Positional[str]
    """Output folder: model/, optimizer_state.safetensors, metrics.jsonl, order.json, summary.json."""
    model: tyro.conf.OmitArgPrefixes[ModelConfig] = field(default_factory=ModelConfig)
    data: tyro.conf.OmitArgPrefixes[DataConfig] = field(default_factory=DataConfig)
    runtime: tyro.conf.OmitArgPrefixes[RuntimeConfig] = field(default_factory=RuntimeConfig)
    selection: str | None = None
    """Train only on these example ids: an `assay filter` output folder or a .txt/.json/.jsonl/.npy file.
    (Named --selection because --subset is the hub dataset configuration.)"""
    selection_weights: bool = True
    """Train with the per-example weights the --selection carries (facility location's CRAIG
    weights: each chosen example stands for that many pool examples; a weight of 2 trains as the
    example twice). False: every selected example counts once."""
    ordered: str | None = None
    """A finished full-data `assay finetune` run: replay its visit order, skipping unselected examples."""
    recipe: tyro.conf.OmitArgPrefixes[TrainRecipe] = field(default_factory=TrainRecipe)
    eval_dataset: str | None = None
    """Dataset for eval loss (default: --dataset). A file is read whole (it is one split)."""
    eval_split: str = "eval"
    """Split for eval loss ("" for none). A single file has no eval split: give the held-out rows
    as --eval_dataset FILE, or pick them from --dataset with --eval_filter_column/value."""
    eval_filter_column: str | None = None
    """Keep only eval rows whose column equals --eval_filter_value (e.g. collection)."""
    eval_filter_value: str | None = None
    """The value --eval_filter_column must equal."""
    eval_max_samples: int | None = None
    """Use only the first N eval examples."""
    eval_every: int = 0
    """Evaluate every N optimizer steps (0: only before and after training)."""
    log_every: int = 10
    """Write the running train loss to metrics.jsonl every N steps."""
    save_every: int = 50
    """Checkpoint every N steps, so an interrupted run resumes (0: never). May change when
    resuming: it decides where the run can restart, not what it computes."""
    pool_loss: bool = True
    """With --selection, also report the final loss on the whole dataset the subset came from."""
    token_batch_size: int = 8192
    """Most tokens (padding included) per forward batch when evaluating."""
    wandb: bool = False
    """Also log metrics to Weights & Biases (metrics.jsonl is written either way; honours
    WANDB_MODE=offline). Needs `pip install 'assay[wandb]'`."""
    wandb_project: str = "assay-finetune"
    """W&B project name (with --wandb)."""
    fsdp: bool = False
    """Under torchrun: shard weights, gradients and AdamW's moments over the processes (FSDP2,
    one unit per decoder block) for models that do not fit on one device; saved whole."""
    overwrite: bool = False
    """Replace a finished run in OUT."""

    def __post_init__(self) -> None:
        if self.log_every < 1 or self.save_every < 0 or self.eval_every < 0 or self.token_batch_size < 1:
            raise AssayError(
                "--log_every and --token_batch_size must be >= 1, --save_every and --eval_every >= 0"
            )
        if self.ordered and not self.selection:
            raise AssayError("--ordered replays a full run's order for a --selection; give --selection too")
        if (self.eval_filter_column is None) != (self.eval_filter_value is None):
            raise AssayError("--eval_filter_column and --eval_filter_value go together")
        if self.eval_max_samples is not None and self.eval_max_samples < 1:
            raise AssayError(f"--eval_max_samples must be positive, got {self.eval_max_samples}")


FREE_ON_RESUME = ("save_every", "wandb", "wandb_project")
"""Finetune settings a run may resume under changed (besides --threads and --overwrite): where
checkpoints are written and where metrics are mirrored, never what is computed."""


@dataclass
class TrainData:
    train: Examples  # what the optimizer sees
    pool: Examples | None  # the whole dataset, when training on a subset
    eval: Examples | None
    plan: list[np.ndarray]  # example ids per epoch, in visit order
    weights: np.ndarray | None = None  # [len(train)] per-example loss weights (CRAIG's), or None
    weight_tokens: bool = True  # a weight counts its example's tokens too (`train_step`)


def eval_data_config(cfg: FinetuneConfig) -> DataConfig | None:
    """The held-out data (None: no eval loss). A single file is one split: by default (no
    --eval_dataset) its own rows are never taken as held out; other rows of it
    (--eval_filter_column) or a file named by --eval_dataset are read whole."""
    if not cfg.eval_split:
        return None
    dataset, split = cfg.eval_dataset or cfg.data.dataset, cfg.eval_split
    if is_single_file(dataset):
        if cfg.eval_dataset is None and cfg.eval_filter_column is None:
            return None  # the training rows themselves: not held out
        split = "train" if split == "eval" else split  # the default asks for "the held-out data"
    return replace(
        cfg.data,
        dataset=dataset,
        split=split,
        max_samples=cfg.eval_max_samples,
        filter_column=cfg.eval_filter_column if cfg.eval_filter_column else cfg.data.filter_column,
        filter_value=cfg.eval_filter_value if cfg.eval_filter_column else cfg.data.filter_value,
    )


def prepare_data(cfg: FinetuneConfig, tokenizer: Any) -> TrainData:
    _, pool = load_examples(cfg.data, tokenizer)
    train, keep_pool = pool, None
    if cfg.selection:
        ids = read_ids(cfg.selection)
        train, keep_pool = pool.subset(pool.positions_of(ids)), pool
    eval_cfg = eval_data_config(cfg)
    evals = load_examples(eval_cfg, tokenizer)[1] if eval_cfg else None
    if eval_cfg is None and cfg.eval_split:
        note(
            f"no held-out loss: {cfg.data.dataset} is a single file (one split); give held-out rows with "
            "--eval_dataset FILE or --eval_filter_column/--eval_filter_value"
        )
    if cfg.ordered:
        plan = replayed_plan(cfg.ordered, train.ids, cfg.recipe.num_epochs)
    else:
        plan = shuffled_plan(train.ids, cfg.recipe.num_epochs, cfg.runtime.seed)
    weights = None
    if cfg.selection and cfg.selection_weights:
        by_id = read_weights(cfg.selection)
        weights = None if by_id is None else np.array([by_id[int(i)] for i in train.ids], dtype=np.float64)
    return TrainData(train, keep_pool if cfg.pool_loss else None, evals, plan, weights)


def _after_step(step: int) -> None:
    """Called after every optimizer step (tests replace it to simulate an interruption)."""


@dataclass
class Trainer:
    """The state of one fine-tuning run and the loop over its optimizer steps."""

    cfg: FinetuneConfig
    model: Any
    data: TrainData
    policy: PrecisionPolicy
    pad_id: int
    folder: Path
    wandb_run: Any = None
    optimizer: torch.optim.AdamW = field(init=False)
    scaler: Any = field(init=False)

    def __post_init__(self) -> None:
        recipe = self.cfg.recipe
        self.optimizer = recipe.optimizer(list(ckpt.trainable_parameters(self.model).values()))
        self.scaler = make_scaler(self.policy)
        self.steps = recipe.steps(self.data.plan)
        if not self.steps:
            raise AssayError("nothing to train on: the plan has no steps")
        self.lrs = recipe.learning_rates(len(self.steps))
        self.position = {int(i): p for p, i in enumerate(self.data.train.ids)}

    def eval_loss(self) -> float | None:
        if self.data.eval is None:
            return None
        return mean_loss(self.model, self.data.eval, self.policy, self.pad_id, self.cfg.token_batch_size)

    def resume(self, log: MetricsLog) -> tuple[int, float]:
        """Start step and train seconds so far (restored from a checkpoint if any); the metrics
        log is cut back to the checkpoint's step."""
        folder = ckpt.find_checkpoint(self.folder / ckpt.CHECKPOINT_DIR)
        if folder is None:
            log.truncate_after(-1)
            return 0, 0.0
        state = ckpt.load_checkpoint(folder, self.model, self.optimizer, self.scaler)
        note(f"resuming from step {state['step']} of {len(self.steps)}")
        log.truncate_after(int(state["step"]))
        return int(state["step"]), float(state["train_s"])

    def run(self) -> dict[str, Any]:
        cfg = self.cfg
        log = MetricsLog(self.folder / "metrics.jsonl", self.wandb_run)
        start, train_s = self.resume(log)
        if start == 0:
            log.log({"step": 0, "eval_loss": self.eval_loss()})
        self.model.train()
        window = np.zeros(4)  # summed loss, loss tokens, real tokens, seconds since the last log line
        n_examples = sum(len(ids) for _, ids in self.steps)
        done = sum(len(ids) for _, ids in self.steps[:start])
        with Progress(n_examples, "finetune", enabled=Distributed.current().is_main, initial=done) as bar:
            for step in range(start, len(self.steps)):
                t0 = time.perf_counter()
                epoch, ids = self.steps[step]
                positions = np.array([self.position[int(i)] for i in ids], dtype=np.int64)
                loss, toks, real = train_step(
                    self.model,
                    self.data.train,
                    positions,
                    cfg.recipe.micro_batch_size,
                    self.policy,
                    self.pad_id,
                    self.scaler,
                    self.data.weights,
                    self.data.weight_tokens,
                )
                lr = self.lrs[step]
                norm = optimizer_update(self.model, self.optimizer, self.scaler, cfg.recipe.max_grad_norm, lr)
                seconds = time.perf_counter() - t0
                train_s += seconds
                check_finite(torch.tensor(loss), "the training loss", self.policy)
                window += (loss, toks, real, seconds)
                bar.update(len(ids), real, loss=f"{loss / max(toks, 1):.3f}")
                if (step + 1) % cfg.log_every == 0 or step + 1 == len(self.steps):
                    log.log(self.log_record(step + 1, epoch, lr, norm, window, train_s))
                    window[:] = 0
                self.periodic(step + 1, train_s, log)
                _after_step(step + 1)
        return {"train_s": train_s, "steps": len(self.steps), "log": log}

    @staticmethod
    def log_record(step: int, epoch: int, lr: float, norm: float, window: np.ndarray, train_s: float) -> dict:
        return {
            "step": step,
            "epoch": epoch,
            "lr": lr,
            "grad_norm": norm,
            "train_loss": float(window[0] / max(window[1], 1)),
            "tokens_per_s": float(window[2] / max(window[3], 1e-9)),
            "train_s": train_s,
        }

    def periodic(self, step: int, train_s: float, log: MetricsLog) -> None:
        """Evaluate and checkpoint on their schedules (the final step is handled by the caller)."""
        cfg = self.cfg
        if step == len(self.steps):
            return
        if cfg.eval_every and step % cfg.eval_every == 0:
            log.log({"step": step, "eval_loss": self.eval_loss()})
        if cfg.save_every and step % cfg.save_every == 0:  # every rank gathers, rank 0 writes
            state = {"step": step, "train_s": train_s}
            ckpt.save_checkpoint(
                self.folder / ckpt.CHECKPOINT_DIR, self.model, self.optimizer, self.scaler, state
            )


def final_losses(trainer: Trainer) -> dict[str, float | None]:
    """Train loss on what was trained on, eval loss, and (for subsets) loss on the whole pool."""
    cfg, data = trainer.cfg, trainer.data
    args = (trainer.policy, trainer.pad_id, cfg.token_batch_size)
    return {
        "train_loss": mean_loss(trainer.model, data.train, *args, desc="train loss"),
        "eval_loss": trainer.eval_loss(),
        "pool_loss": mean_loss(trainer.model, data.pool, *args, desc="pool loss")
        if data.pool is not None
        else None,
    }


def save_outputs(trainer: Trainer, folder: Path, tokenizer: Any) -> None:
    """The trained model (or adapter), its tokenizer, the optimizer moments and the visit order.

    Every rank calls it (a sharded model's weights and moments are gathered whole: collectives);
    rank 0 writes, in the same format with or without --fsdp."""
    model = trainer.model
    weights = fsdp.full_state_dict(model) if fsdp.is_sharded(model) else None  # None: its own
    params = ckpt.trainable_parameters(model)
    ckpt.export_optimizer_state(
        folder / ckpt.OPTIMIZER_STATE_FILE, trainer.optimizer, params, len(trainer.steps), trainer.policy.name
    )
    if not Distributed.current().is_main:
        return
    model.save_pretrained(folder / "model", safe_serialization=True, state_dict=weights)
    tokenizer.save_pretrained(folder / "model")
    name_adapter_base(folder / "model", trainer.cfg.model.model)
    write_plan(folder / ORDER_FILE, trainer.data.plan)


def finetune(cfg: FinetuneConfig) -> dict[str, Any]:
    """Train, evaluate, save into cfg.out (resumable); returns the summary (also in summary.json)."""
    require_config(cfg, FinetuneConfig, "finetune's config")
    wall = time.perf_counter()
    dist = Distributed.current()
    if cfg.fsdp:
        fsdp.require_processes(dist)  # before OUT.part exists
    with run_folder(cfg.out, "finetune", cfg, cfg.overwrite, free=FREE_ON_RESUME) as run:
        _, policy = setup_runtime(cfg.runtime)
        tokenizer = load_tokenizer(cfg.model)
        data = prepare_data(cfg, tokenizer)
        if cfg.fsdp:
            model = load_sharded_model(cfg.model, policy, cfg.runtime.attention, dist)
        else:
            model = load_model(cfg.model, policy, cfg.runtime.attention)
            dist.broadcast_module_(model)  # identical start on every rank (as DDP)
        check_inputs(run, input_fingerprints(data, model, tokenizer))  # before a checkpoint is loaded
        wandb_run = None
        if cfg.wandb and dist.is_main:
            wandb_run = start_wandb(cfg.wandb_project, Path(cfg.out).name, config_to_dict(cfg), run.path)
        trainer = Trainer(cfg, model, data, policy, tokenizer.pad_token_id, run.path, wandb_run)
        if cfg.runtime.keep_freed_memory:
            reuse_freed_memory()  # after loading: the load's transient copies still go back
        trained = count_parameters(model)
        note(f"training {trained[0]:,} of {trained[1]:,} parameters, {len(trainer.steps)} steps")
        result = trainer.run()
        losses = final_losses(trainer)
        result["log"].log({"step": result["steps"], "final": True, **losses})
        save_outputs(trainer, run.path, tokenizer)
        summary = {
            **losses,
            "steps": result["steps"],
            "examples": len(data.train),
            "weighted": data.weights is not None,
            "trainable_parameters": trained[0],
            "precision": policy.name,
            "train_s": result["train_s"],
            "wall_s": time.perf_counter() - wall,
        }
        if dist.is_main:  # every rank holds the same summary
            write_json(run.path / "summary.json", summary)
            shutil.rmtree(run.path / ckpt.CHECKPOINT_DIR, ignore_errors=True)
        result["log"].close()
    return summary


def input_fingerprints(data: TrainData, model: Any, tokenizer: Any) -> dict[str, str]:
    """What a resumed run must find unchanged: the examples it trains on, evaluates on and the pool
    (tokens and ids) with its visit plan, the starting weights, the tokenizer."""
    plan = hashlib.sha256(np.concatenate([np.asarray(p, np.int64) for p in data.plan]).tobytes())
    dataset = examples_fingerprint(data.train, data.eval, data.pool) + plan.hexdigest()[:16]
    return {
        "dataset": dataset,
        "model": model_fingerprint(model),
        "tokenizer": tokenizer_fingerprint(tokenizer),
    }


def count_parameters(model: torch.nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter counts."""
    params = list(model.parameters())
    return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)
