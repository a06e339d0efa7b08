"""`assay sae train`: build the activation source and the SAEs, train them (assay/sae/loop.py),
save each in the SAELens format with its metrics. One run trains one SAE, a transcoder
(--hookpoint_out), or several SAEs from one pass of the language model (--hookpoints,
--sweep_k, --sweep_d_sae), each into its own subfolder.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from assay.core.distributed import Distributed
from assay.core.errors import AssayError
from assay.core.precision import PrecisionPolicy
from assay.core.runs import check_inputs, config_to_dict, run_folder, write_json
from assay.lm.models import setup_runtime
from assay.sae.activations import ShuffledBatches
from assay.sae.checkpoint import CHECKPOINT
from assay.sae.config import SaeTrainConfig
from assay.sae.evaluate import splice_metrics
from assay.sae.loop import (  # noqa: F401  (re-exported: the loop's public names)
    Trainee,
    calibrate_threshold,
    fit,
    fit_all,
    init_from_data,
    lr_at,
    sparsity_coef_at,
    split_rows,
    step_record,
    train_step,
)
from assay.sae.model import SparseAutoencoder
from assay.sae.optim import (  # noqa: F401  (re-exported: the SAE's optimizer API)
    RENORM,
    SIGNUM_LR_C,
    UNIT_LR_C,
    ScheduleFreeSignSGD,
    averaged,
    default_learning_rate,
    encoder_step_scale,
    make_optimizer,
    normalise_decoder,
)
from assay.sae.saelens_format import saved_architecture, write_sae_files
from assay.sae.sources import build_data, hookpoints
from assay.training.metrics import start_wandb


# ---- the command -----------------------------------------------------------------------
def new_sae(cfg: SaeTrainConfig, widths: list[int]) -> SparseAutoencoder:
    """The untrained SAE (a transcoder with --hookpoint_out) for input (and target) widths."""
    d_in = widths[0]
    d_sae = cfg.sae.d_sae or cfg.sae.expansion_factor * d_in
    sae = SparseAutoencoder(d_in, d_sae, cfg.sae, d_out=widths[1] if cfg.hookpoint_out else None)
    saved_architecture(sae)  # an SAE SAELens cannot load is refused before any training
    return sae


def sae_specs(cfg: SaeTrainConfig) -> list[tuple[str, SaeTrainConfig]]:
    """(subfolder name, single-SAE config) of every SAE the run trains: one per combination of
    --hookpoints, --sweep_d_sae and --sweep_k; ("", cfg) for a single SAE. A name holds the
    parts that vary (`model.layers.2`, `model.layers.2-d8192-k64`)."""
    hooks = cfg.hookpoints or [cfg.hookpoint]
    widths: list[int | None] = list(cfg.sweep_d_sae) or [cfg.sae.d_sae]
    ks = cfg.sweep_k or [cfg.sae.k]
    if len(hooks) * len(widths) * len(ks) == 1 and not cfg.hookpoints:
        return [("", cfg)]
    specs = []
    for hook in hooks:
        for d_sae in widths:
            for k in ks:
                name = hook + (f"-d{d_sae}" if len(widths) > 1 else "") + (f"-k{k}" if len(ks) > 1 else "")
                sub = replace(cfg, hookpoint=hook, hookpoints=[], sweep_d_sae=[], sweep_k=[])
                specs.append((name, replace(sub, sae=replace(cfg.sae, d_sae=d_sae, k=k))))
    return specs


def _columns(source: Any, cfg: SaeTrainConfig, hook: str) -> tuple[slice, list[int]]:
    """(the columns of `hook`'s activations in the source's rows, the SAE's widths)."""
    if cfg.hookpoint_out:  # a transcoder reads both: [input | target]
        return slice(None), list(source.widths)
    names, widths = hookpoints(cfg), list(source.widths)
    i = names.index(hook)
    start = sum(widths[:i])
    return slice(start, start + widths[i]), [widths[i]]


def _trainees(
    cfg: SaeTrainConfig,
    source: Any,
    model: Any,
    eval_contexts: Any,
    lm_region: Any,
    out: Path,
    wandb_run: Any,
    device: torch.device,
) -> tuple[list[str], list[Trainee]]:
    """(subfolder names, trainees) of the run's SAEs, each started from the same random state."""
    dist = Distributed.current()
    names, trainees = [], []
    rng = torch.get_rng_state()
    for name, sub in sae_specs(cfg):
        cols, widths = _columns(source, cfg, sub.hookpoint)
        torch.set_rng_state(rng)  # every SAE starts as it would in a run of its own
        sae = new_sae(sub, widths).to(device)
        if cfg.compile:
            sae.rule.dense_forward = torch.compile(sae.rule.dense_forward)  # type: ignore[method-assign]

        def evaluate(s: SparseAutoencoder, hook: str = sub.hookpoint) -> dict[str, float]:
            return splice_metrics(
                model, s, hook, eval_contexts, lm_region=lm_region, hookpoint_out=cfg.hookpoint_out
            )

        evaluator = evaluate if len(eval_contexts) and dist.is_main else None  # splice metrics: rank 0
        (out / name).mkdir(exist_ok=True)
        trainees.append(Trainee(sae, sub, out / name, cols, evaluator, wandb_run))
        names.append(name)
    return names, trainees


def train_sae(cfg: SaeTrainConfig) -> dict[str, Any]:
    """Train the SAE(s) as configured; write each (SAELens format) with its metrics into
    cfg.out (several: one subfolder each).

    Returns the summary (also written to OUT/summary.json); with several SAEs,
    {"saes": {name: summary}, "tokens_per_s": the run's rate}.
    """
    device, policy = setup_runtime(cfg.runtime)
    dist = Distributed.current()
    if cfg.batch_tokens % dist.world_size:
        raise AssayError(
            f"--batch_tokens {cfg.batch_tokens} must be a multiple of the {dist.world_size} ranks"
        )
    with run_folder(
        cfg.out, "sae train", cfg, cfg.overwrite, free=("wandb", "wandb_project")
    ) as run:  # refuses a clash before any work
        model, source, eval_contexts, inputs = build_data(cfg, policy)
        check_inputs(run, inputs)  # a resumed run must read the data and model it began with
        # each rank: its own stream (another seed), its share of the global batch
        seed = cfg.runtime.seed + 1_000 * dist.rank
        batches = ShuffledBatches(source, cfg.batch_tokens // dist.world_size, cfg.buffer_batches, seed)
        lm_region = policy.autocast() if cfg.autocast_lm else None
        wandb_run = (
            start_wandb(cfg.wandb_project, Path(cfg.out).name, config_to_dict(cfg), run.path)
            if cfg.wandb and dist.is_main
            else None
        )
        names, trainees = _trainees(cfg, source, model, eval_contexts, lm_region, run.path, wandb_run, device)
        started = time.perf_counter()
        results = fit_all(trainees, batches, policy)
        seconds = time.perf_counter() - started
        summaries = {}
        for name, t, result in zip(names, trainees, results):
            summaries[name] = _summary(t.cfg, policy, t.sae, result, seconds)
            if dist.is_main:  # the ranks hold identical SAEs
                write_sae_files(t.run_dir, t.sae.folded(), _metadata(t.cfg, policy), result["log_densities"])
                shutil.rmtree(t.run_dir / CHECKPOINT, ignore_errors=True)  # .old/.tmp never outlive a write
                if len(trainees) > 1:
                    write_json(t.run_dir / "summary.json", summaries[name])
        rate = results[0]["tokens_per_s"]
        summary = summaries[""] if "" in summaries else {"saes": summaries, "tokens_per_s": rate}
        if dist.is_main:
            write_json(run.path / "summary.json", summary)
        if wandb_run is not None:
            wandb_run.summary.update({k: v for k, v in summary.items() if isinstance(v, (int, float))})
            wandb_run.finish()
    return summary


def _metadata(cfg: SaeTrainConfig, policy: PrecisionPolicy) -> dict[str, Any]:
    """cfg.json's metadata: where the SAE reads (and, a transcoder, writes) and how it trained."""
    meta: dict[str, Any] = {
        "model_name": cfg.model.model,
        "hook_name": cfg.hookpoint,
        "context_size": cfg.context_length,
        "dataset_path": cfg.data.dataset,
        "training_tokens": cfg.training_tokens,
        "precision": policy.name,
    }
    if cfg.hookpoint_out:
        meta["hook_name_out"] = cfg.hookpoint_out
    return meta


def _summary(
    cfg: SaeTrainConfig, policy: PrecisionPolicy, sae: SparseAutoencoder, result: dict, seconds: float
) -> dict:
    train = result["train"]
    return {
        "architecture": cfg.sae.architecture,
        "d_in": sae.d_in,
        "d_sae": sae.d_sae,
        "hookpoint": cfg.hookpoint,
        **({"d_out": sae.d_out, "hookpoint_out": cfg.hookpoint_out} if sae.transcoder else {}),
        "precision": policy.name,
        "steps": cfg.total_steps,
        "tokens": train.get("tokens", 0),
        "seconds": seconds,
        "tokens_per_s": result["tokens_per_s"],
        **{k: train[k] for k in ("fvu", "explained_variance", "l0", "dead_fraction", "mse") if k in train},
        **result["eval"],
    }
