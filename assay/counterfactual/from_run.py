"""Metagradient scores of a finished `assay finetune` run (`assay score --finetune RUN`).

The run's saved config, data, visit order (order.json) and recipe are turned into a replay
(`replay.TrainingRun`): the base model is loaded and seeded exactly as the run loaded it, every
step is re-run from θ_0, and the replayed final weights are compared with the run's saved ones
before anything is differentiated: a run that does not replay (other weights, an order that
changed, non-deterministic kernels) is refused rather than attributed wrongly.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file

from assay.core.errors import AssayError
from assay.core.precision import PrecisionPolicy
from assay.core.runs import CONFIG_FILE, DONE_FILE, config_from_dict, read_json
from assay.counterfactual.metagradient import lm_loss_fns, metagradients, objective_gradients, summed
from assay.counterfactual.replay import AdamWSettings, Replay, TrainingRun, balanced_interval, finetune_order
from assay.lm.data import Examples
from assay.lm.models import load_model, load_tokenizer, setup_runtime
from assay.training.finetune import FinetuneConfig, prepare_data
from assay.training.subset import ORDER_FILE, read_weights, replayed_plan

REPLAY_TOLERANCE = 1e-5
"""Largest relative difference between replayed and saved final weights that is accepted (the
replay is bit-exact on one process; a margin keeps a run that saved through another dtype path)."""


@dataclass
class ReplayedRun:
    """A finished fine-tune ready to be differentiated through."""

    replay: Replay
    train: Examples
    """The examples trained on (the columns of the scores, in `train.ids` order)."""
    tokenizer: Any
    policy: PrecisionPolicy
    max_length: int
    replay_seconds: float
    max_weight_difference: float


def _finetune_config(run_dir: Path, trust_remote_code: bool) -> FinetuneConfig:
    if not (run_dir / DONE_FILE).exists():
        part = run_dir.with_name(run_dir.name + ".part")
        hint = f" ({part} is an interrupted run: finish it first)" if part.exists() else ""
        raise AssayError(f"--finetune {run_dir} is not a finished assay finetune run{hint}")
    saved = read_json(run_dir / CONFIG_FILE)
    if saved.get("command") != "finetune":
        raise AssayError(f"--finetune {run_dir} holds an assay {saved.get('command')} run, not finetune")
    if not (run_dir / ORDER_FILE).exists():
        raise AssayError(f"--finetune {run_dir} has no {ORDER_FILE}: its visit order is needed to replay it")
    cfg = config_from_dict(FinetuneConfig, saved["config"], trust_remote_code)
    if cfg.selection and cfg.selection_weights and read_weights(cfg.selection) is not None:
        raise AssayError(
            f"--finetune {run_dir} trained with per-example selection weights, which the replay does not "
            "model yet; replay a run made with --no_selection_weights"
        )
    if cfg.fsdp:
        raise AssayError(
            "--finetune: a run trained with --fsdp cannot be replayed yet; replay a 1-process run"
        )
    return cfg


def load_replay(run_dir: str | Path, device: str = "auto", checkpoint_every: int | None = None,
                trust_remote_code: bool = False, offload: Path | None = None) -> ReplayedRun:  # fmt: skip
    """Rebuild the run (data, order, recipe, θ_0), replay it and check the final weights.
    `checkpoint_every` None keeps a checkpoint every ⌈√T⌉ steps (`balanced_interval`).
    `trust_remote_code` comes from the caller's command line, never from the run's saved config."""
    run_dir = Path(run_dir)
    cfg = _finetune_config(run_dir, trust_remote_code)
    _, policy = setup_runtime(replace(cfg.runtime, device=device))  # seeds as the run did: same θ_0
    tokenizer = load_tokenizer(cfg.model)
    data = prepare_data(cfg, tokenizer)
    plan = replayed_plan(run_dir, data.train.ids, cfg.recipe.num_epochs)  # the order it really saw
    steps = cfg.recipe.steps(plan)
    position = {int(i): p for p, i in enumerate(data.train.ids)}
    lengths = data.train.lengths
    ordered = [finetune_order(lengths, np.array([position[int(i)] for i in ids])) for _, ids in steps]
    lrs = cfg.recipe.learning_rates(len(steps))
    opt = AdamWSettings(tuple(lrs), cfg.recipe.adam_betas, cfg.recipe.adam_eps, cfg.recipe.weight_decay,
                        cfg.recipe.max_grad_norm)  # fmt: skip
    model = load_model(cfg.model, policy, cfg.runtime.attention).train()
    loss_fn, curvature = lm_loss_fns(data.train, tokenizer.pad_token_id, policy.device)
    run = TrainingRun(ordered, data.train.num_loss_tokens(), loss_fn, opt, cfg.recipe.micro_batch_size,
                      policy, curvature_loss_fn=curvature, curvature_micro_batch_size=2)  # fmt: skip
    interval = balanced_interval(len(ordered)) if checkpoint_every is None else checkpoint_every
    replay = Replay(model, run, checkpoint_every=interval, offload=offload)
    start = time.perf_counter()
    replay.forward()
    seconds = time.perf_counter() - start
    gap = _compare_final(run_dir, model)
    return ReplayedRun(replay, data.train, tokenizer, policy, cfg.data.max_length, seconds, gap)


def _compare_final(run_dir: Path, model: torch.nn.Module) -> float:
    """Largest relative difference of the replayed trainable weights from the run's saved model."""
    folder = run_dir / "model"
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise AssayError(f"{folder} holds no saved weights (safetensors) to check the replay against")
    saved: dict[str, torch.Tensor] = {}
    for f in files:
        saved |= load_file(str(f))
    worst = 0.0
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        match = _saved_name(name, saved)
        if match is None:
            raise AssayError(
                f"{folder} has no weight for {name}; is --finetune the run this model was trained by?"
            )
        ref = saved[match].to(p.dtype)
        worst = max(worst, float((p.detach().cpu() - ref).abs().max() / ref.abs().max().clamp_min(1e-12)))
    if worst > REPLAY_TOLERANCE:
        raise AssayError(
            f"replaying {run_dir} does not reproduce its saved weights (relative difference {worst:.2g}): "
            "the run was not deterministic (several processes, other kernels) or its data or model changed"
        )
    return worst


def _saved_name(name: str, saved: dict[str, torch.Tensor]) -> str | None:
    """The saved tensor of parameter `name` (PEFT saves adapters without the adapter name)."""
    candidates = (name, name.replace(".default", ""), name.removeprefix("base_model.model."))
    found = next((c for c in candidates if c in saved), None)
    if found is None:
        found = next((k for k in saved if name.replace(".default", "").endswith(k)), None)
    return found


def metagradient_scores(
    replayed: ReplayedRun, queries: Examples, aggregate: bool, query_batch_size: int = 4, first_step: int = 0
) -> np.ndarray:
    """[Q, N] (or [1, N]) −d f_q / d w_i, f_q the query's summed loss under the run's final model:
    positive = proponent, as `assay score`. The forward replay `load_replay` made is reused;
    queries are differentiated `query_batch_size` at a time (one reverse pass each), through the
    steps from `first_step` on."""
    loss_fn, _ = lm_loss_fns(queries, replayed.tokenizer.pad_token_id, replayed.policy.device)
    groups = [np.array([q]) for q in range(len(queries))]
    grads = objective_gradients(replayed.replay.model, loss_fn, groups, replayed.policy)
    if aggregate:
        grads = [summed(grads)]
    parts = [
        -metagradients(replayed.replay, grads[i : i + query_batch_size], first_step=first_step)
        for i in range(0, len(grads), query_batch_size)
    ]
    return torch.cat(parts).numpy()
