"""`assay finetune`: causal-LM fine-tuning (full or LoRA) under the project's precision policy.

Precision: bf16/fp16 run forward and backward under autocast over fp32 master weights;
AdamW's moments and every update stay fp32 (fp16 adds dynamic loss scaling). bf16-pure
keeps weights, gradients and Adam's moments in bf16 (what peers call "pure bf16"; small
updates can round away). fp32 is the reference.

Loss normalisation: an optimizer step's loss is the SUM of its token losses divided by the
number of loss-carrying tokens in the whole effective batch, so splitting a batch of 8 into
micro-batches (1x8, 4x2, ...) gives the same gradient (exactly, up to fp32 summation order).
"""

from __future__ import annotations

import math
import shutil
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import tyro

from assay.core import fsdp
from assay.core.config import DataConfig, ModelConfig, RuntimeConfig
from assay.core.console import note
from assay.core.distributed import Distributed
from assay.core.errors import AssayError
from assay.core.precision import PrecisionPolicy, check_finite, full_precision
from assay.core.progress import Progress
from assay.core.runs import config_to_dict, run_folder, write_json
from assay.lm.data import Examples, collate, load_examples
from assay.lm.losses import evaluate_losses, example_losses
from assay.lm.models import load_model, load_sharded_model, load_tokenizer, setup_runtime
from assay.training import checkpoint as ckpt
from assay.training.metrics import MetricsLog, start_wandb
from assay.training.schedule import ScheduleName, lr_factor, warmup_steps_for
from assay.training.subset import ORDER_FILE, read_ids, replayed_plan, shuffled_plan, step_batches, write_plan


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
    ordered: str | None = None
    """A finished full-data `assay finetune` run: replay its visit order, skipping unselected examples."""
    learning_rate: float = 1e-4
    """Peak learning rate (AdamW)."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay."""
    adam_betas: tuple[float, float] = (0.9, 0.999)
    """AdamW's beta1 and beta2."""
    num_epochs: int = 1
    """Passes over the (sub)set."""
    max_steps: int = 0
    """Stop after this many optimizer steps (0: run every epoch to the end)."""
    effective_batch_size: int = 32
    """Examples per optimizer step."""
    micro_batch_size: int = 8
    """Examples per forward/backward; gradients accumulate over effective/micro of them."""
    schedule: ScheduleName = "cosine"
    """Learning-rate decay after warm-up."""
    warmup_ratio: float = 0.1
    """Fraction of the steps spent warming up linearly (ignored when --warmup_steps > 0)."""
    warmup_steps: int = 0
    """Warm-up steps (0: use --warmup_ratio)."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this (0: no clipping)."""
    eval_dataset: str | None = None
    """Dataset for eval loss (default: --dataset)."""
    eval_split: str = "eval"
    """Split for eval loss ("" for none)."""
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
    """Checkpoint every N steps, so an interrupted run resumes (0: never)."""
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
        if self.effective_batch_size < 1 or self.micro_batch_size < 1:
            raise AssayError("--effective_batch_size and --micro_batch_size must be >= 1")
        if self.effective_batch_size % self.micro_batch_size:
            raise AssayError(
                f"--effective_batch_size {self.effective_batch_size} must be a multiple of "
                f"--micro_batch_size {self.micro_batch_size}"
            )
        if self.num_epochs < 1 or self.learning_rate <= 0:
            raise AssayError("--num_epochs must be >= 1 and --learning_rate > 0")
        if self.ordered and not self.selection:
            raise AssayError("--ordered replays a full run's order for a --selection; give --selection too")
        if (self.eval_filter_column is None) != (self.eval_filter_value is None):
            raise AssayError("--eval_filter_column and --eval_filter_value go together")


@dataclass
class TrainData:
    train: Examples  # what the optimizer sees
    pool: Examples | None  # the whole dataset, when training on a subset
    eval: Examples | None
    plan: list[np.ndarray]  # example ids per epoch, in visit order


def eval_data_config(cfg: FinetuneConfig) -> DataConfig | None:
    if not cfg.eval_split:
        return None
    return replace(
        cfg.data,
        dataset=cfg.eval_dataset or cfg.data.dataset,
        split=cfg.eval_split,
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
    if cfg.ordered:
        plan = replayed_plan(cfg.ordered, train.ids, cfg.num_epochs)
    else:
        plan = shuffled_plan(train.ids, cfg.num_epochs, cfg.runtime.seed)
    return TrainData(train, keep_pool if cfg.pool_loss else None, evals, plan)


def make_optimizer(model: torch.nn.Module, cfg: FinetuneConfig) -> torch.optim.AdamW:
    """AdamW over the trainable parameters; its moments take the parameters' dtype (fp32 masters)."""
    params = list(ckpt.trainable_parameters(model).values())
    if not params:
        raise AssayError("the model has no trainable parameters")
    return torch.optim.AdamW(
        params, lr=cfg.learning_rate, betas=cfg.adam_betas, weight_decay=cfg.weight_decay, foreach=False
    )


def make_scaler(policy: PrecisionPolicy) -> Any:
    """Dynamic loss scaling for fp16 (None otherwise: bf16 has fp32's exponent range)."""
    if not policy.uses_loss_scaling:
        return None
    return torch.amp.GradScaler(policy.device.type)


def train_step(
    model: torch.nn.Module,
    examples: Examples,
    positions: np.ndarray,
    micro_batch_size: int,
    policy: PrecisionPolicy,
    pad_id: int,
    scaler: Any,
) -> tuple[float, int, int]:
    """Accumulate the effective batch's gradient; returns (summed loss, loss tokens, real tokens).

    Each micro-batch's summed token loss is divided by the whole batch's loss-token count,
    so the accumulated gradient is the token-mean gradient of the effective batch.
    """
    positions = positions[np.argsort(-examples.lengths[positions], kind="stable")]  # less padding
    loss_tokens = int(examples.num_loss_tokens()[positions].sum())  # of the whole effective batch
    # Data-parallel: each rank takes every world-th example (balanced lengths), so accumulation
    # steps per rank = effective / (micro x world); summing the ranks' gradients gives exactly
    # the one-process gradient (each micro-batch already divides by the global token count).
    dist = Distributed.current()
    mine = dist.interleave_array(positions)
    total, real = 0.0, 0
    for chunk in _micro_batches(mine, len(positions), micro_batch_size, dist.world_size):
        weight = 1.0 if len(chunk) else 0.0  # a rank short of examples runs one with weight 0
        batch = collate(examples, chunk if len(chunk) else positions[-1:], pad_id, policy.device)
        with policy.autocast():
            losses = example_losses(model, batch)  # [b] fp32 summed token losses
        with full_precision(policy.device):
            loss = losses.sum() * weight / max(loss_tokens, 1)
        (scaler.scale(loss) if scaler is not None else loss).backward()
        total += float(losses.detach().sum()) * weight
        real += int(batch["attention_mask"].sum()) * int(weight)
    if not fsdp.is_sharded(model):  # FSDP reduce-scattered (summed, fp32) them in the backward
        dist.all_reduce_grads_(p for p in model.parameters() if p.requires_grad)  # fp32 sum, as DDP
    total, real_sum = dist.sum_scalars(total, real)
    return total, loss_tokens, int(real_sum)


def _micro_batches(mine: np.ndarray, n: int, micro: int, world: int) -> list[np.ndarray]:
    """This rank's micro-batches, padded with empty ones so that every rank runs as many as the
    rank with the largest share (ceil(n / world) examples): with --fsdp every forward and
    backward is a collective, and under DDP the extra pass costs only time a rank would wait."""
    largest = math.ceil(n / world)
    rounds = math.ceil(largest / micro)
    return [mine[i * micro : (i + 1) * micro] for i in range(rounds)]


def optimizer_update(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, scaler: Any, max_grad_norm: float, lr: float
) -> float:
    """Clip, step and zero the gradients; returns the (unscaled) global gradient norm."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if scaler is not None:
        scaler.unscale_(optimizer)
    limit = max_grad_norm if max_grad_norm > 0 else math.inf
    norm = float(fsdp.full_tensor(torch.nn.utils.clip_grad_norm_(params, limit, foreach=False)))
    if scaler is not None:
        scaler.step(optimizer)  # skips the step when the scaled gradients overflowed
        scaler.update()
    else:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return norm


def mean_loss(
    model: torch.nn.Module, examples: Examples, policy: PrecisionPolicy, pad_id: int, tbs: int
) -> float:
    """Token-weighted mean loss (nats/token), with the model in eval mode."""
    model.eval()
    dist = Distributed.current()
    # Each rank evaluates its share and the loss sums are added up (fp64); with --fsdp every
    # forward is a collective, so every rank evaluates every example (in the same batches).
    if dist.active and not fsdp.is_sharded(model):
        mine = examples.subset(dist.interleave_array(np.arange(len(examples))))
        part = float(evaluate_losses(model, mine, policy, pad_id, tbs, desc="eval").sum()) if len(mine) else 0
        model.train()
        return dist.sum_scalars(part)[0] / max(int(examples.num_loss_tokens().sum()), 1)
    losses = evaluate_losses(model, examples, policy, pad_id, tbs, desc="eval")
    model.train()
    return float(losses.sum() / max(int(examples.num_loss_tokens().sum()), 1))


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
        self.optimizer = make_optimizer(self.model, self.cfg)
        self.scaler = make_scaler(self.policy)
        self.steps = step_batches(self.data.plan, self.cfg.effective_batch_size)
        if self.cfg.max_steps > 0:
            self.steps = self.steps[: self.cfg.max_steps]
        if not self.steps:
            raise AssayError("nothing to train on: the plan has no steps")
        self.warmup = warmup_steps_for(len(self.steps), self.cfg.warmup_ratio, self.cfg.warmup_steps)
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
                    cfg.micro_batch_size,
                    self.policy,
                    self.pad_id,
                    self.scaler,
                )
                lr = cfg.learning_rate * lr_factor(step, len(self.steps), self.warmup, cfg.schedule)
                norm = optimizer_update(self.model, self.optimizer, self.scaler, cfg.max_grad_norm, lr)
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
        "train_loss": mean_loss(trainer.model, data.train, *args),
        "eval_loss": trainer.eval_loss(),
        "pool_loss": mean_loss(trainer.model, data.pool, *args) if data.pool is not None else None,
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
    write_plan(folder / ORDER_FILE, trainer.data.plan)


def finetune(cfg: FinetuneConfig) -> dict[str, Any]:
    """Train, evaluate, save into cfg.out (resumable); returns the summary (also in summary.json)."""
    wall = time.perf_counter()
    dist = Distributed.current()
    if cfg.fsdp:
        fsdp.require_processes(dist)  # before OUT.part exists
    with run_folder(cfg.out, "finetune", cfg, cfg.overwrite) as run:
        _, policy = setup_runtime(cfg.runtime)
        tokenizer = load_tokenizer(cfg.model)
        data = prepare_data(cfg, tokenizer)
        if cfg.fsdp:
            model = load_sharded_model(cfg.model, policy, cfg.runtime.attention, dist)
        else:
            model = load_model(cfg.model, policy, cfg.runtime.attention)
            dist.broadcast_module_(model)  # identical start on every rank (as DDP)
        wandb_run = None
        if cfg.wandb and dist.is_main:
            wandb_run = start_wandb(cfg.wandb_project, Path(cfg.out).name, config_to_dict(cfg), run.path)
        trainer = Trainer(cfg, model, data, policy, tokenizer.pad_token_id, run.path, wandb_run)
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
            "trainable_parameters": trained[0],
            "precision": policy.name,
            "train_s": result["train_s"],
            "wall_s": time.perf_counter() - wall,
        }
        write_json(run.path / "summary.json", summary)
        shutil.rmtree(run.path / ckpt.CHECKPOINT_DIR, ignore_errors=True)
        result["log"].close()
    return summary


def count_parameters(model: torch.nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter counts."""
    params = list(model.parameters())
    return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)
