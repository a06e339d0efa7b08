"""Training state on disk: resumable checkpoints and the exported optimizer state.

Everything is safetensors + JSON (no pickles). A checkpoint is written into a temporary
folder and renamed, so a crash mid-write leaves the previous checkpoint intact.

`optimizer_state.safetensors` (the file `assay build --optimizer_state` reads) holds, for
every trainable parameter NAME as `model.named_parameters()` spells it:

    "NAME.exp_avg_sq"  fp32, the parameter's shape: Adam's second moment v (NOT bias-corrected)
    "NAME.exp_avg"     fp32, the parameter's shape: Adam's first moment m

and string metadata {"format": "assay-adam-v1", "optimizer": "adamw", "step", "beta1",
"beta2", "eps", "lr", "precision"}. The bias-corrected second moment is
v / (1 - beta2**step). For a Linear module M the weight's name is "M.weight".
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from assay.core.distributed import Distributed
from assay.core.errors import AssayError
from assay.core.fsdp import full_tensor, like
from assay.core.precision import STATS_DTYPE
from assay.core.runs import read_json, write_json

OPTIMIZER_STATE_FILE = "optimizer_state.safetensors"
OPTIMIZER_STATE_FORMAT = "assay-adam-v1"
CHECKPOINT_DIR = "checkpoint"


def write_checkpoint_folder(folder: Path, write: Callable[[Path], None]) -> None:
    """Write a checkpoint through `write(tmp)` into FOLDER.tmp, then swap it in for FOLDER.

    The previous checkpoint moves to FOLDER.old for the moment between the two renames; a
    process killed there leaves FOLDER.old, which `find_checkpoint` then resumes from."""
    tmp, old = folder.with_name(folder.name + ".tmp"), folder.with_name(folder.name + ".old")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    write(tmp)
    if folder.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(folder, old)
    os.replace(tmp, folder)
    shutil.rmtree(old, ignore_errors=True)


def find_checkpoint(folder: Path) -> Path | None:
    """FOLDER if a whole checkpoint is there, else FOLDER.old (killed between the renames of
    `write_checkpoint_folder`), else None. FOLDER.tmp is never whole and never used."""
    old = folder.with_name(folder.name + ".old")
    for candidate in (folder, old):
        if (candidate / "state.json").exists():
            return candidate
    return None


def trainable_parameters(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """Trainable parameters by name, in a fixed order (the optimizer's order)."""
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def _moments(
    optimizer: torch.optim.Optimizer, params: dict[str, torch.nn.Parameter]
) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in params.items():
        state = optimizer.state.get(p, {})
        for key in ("exp_avg", "exp_avg_sq"):
            if key in state:
                whole = full_tensor(state[key])  # --fsdp: gathered (every rank calls)
                out[f"{name}.{key}"] = whole.detach().to(STATS_DTYPE).contiguous().cpu()
    return out


def _adam_hparams(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    group = optimizer.param_groups[0]
    return {"beta1": group["betas"][0], "beta2": group["betas"][1], "eps": group["eps"], "lr": group["lr"]}


def export_optimizer_state(
    path: Path,
    optimizer: torch.optim.Optimizer,
    params: dict[str, torch.nn.Parameter],
    step: int,
    precision: str,
) -> None:
    """Write the Adam moments per parameter name (fp32) for attribution normalizers.
    Every rank calls it (sharded moments are gathered); rank 0 writes."""
    moments = _moments(optimizer, params)
    if not Distributed.current().is_main:
        return
    meta = {"format": OPTIMIZER_STATE_FORMAT, "optimizer": "adamw", "step": step, "precision": precision}
    meta |= _adam_hparams(optimizer)
    tmp = path.with_name(path.name + ".tmp")
    save_file(moments, str(tmp), metadata={k: str(v) for k, v in meta.items()})
    os.replace(tmp, path)


def load_second_moments(path: str | Path, bias_correct: bool = True) -> dict[str, torch.Tensor]:
    """{parameter name: fp32 v} from an exported optimizer state (bias-corrected by default)."""
    path = Path(path)
    if path.is_dir():
        path = path / OPTIMIZER_STATE_FILE
    if not path.exists():
        raise AssayError(f"no optimizer state at {path}; it is written by `assay finetune`")
    with safe_open(str(path), "pt") as f:
        meta = f.metadata() or {}
        if meta.get("format") != OPTIMIZER_STATE_FORMAT:
            raise AssayError(f"{path} is not an assay optimizer state (format {meta.get('format')!r})")
        scale = 1.0 / (1.0 - float(meta["beta2"]) ** int(meta["step"])) if bias_correct else 1.0
        suffix = ".exp_avg_sq"
        return {k[: -len(suffix)]: f.get_tensor(k) * scale for k in f.keys() if k.endswith(suffix)}


def save_checkpoint(
    folder: Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: Any,
    state: dict[str, Any],
) -> None:
    """Trainable weights, optimizer moments and step counters, RNG state: enough to resume.
    Every rank calls it (sharded weights and moments are gathered whole); rank 0 writes."""
    params = trainable_parameters(model)
    weights = {n: full_tensor(p).detach().contiguous().cpu() for n, p in params.items()}
    moments = _moments(optimizer, params)
    if not Distributed.current().is_main:
        return
    opt_steps = {n: float(optimizer.state[p]["step"]) for n, p in params.items() if p in optimizer.state}
    extra = {"optimizer_steps": opt_steps, "scaler": scaler.state_dict() if scaler is not None else None}

    def write(tmp: Path) -> None:
        save_file(weights, str(tmp / "trainable.safetensors"))
        save_file(moments, str(tmp / "optimizer.safetensors"))
        save_file({"torch_rng": torch.get_rng_state()}, str(tmp / "rng.safetensors"))
        write_json(tmp / "state.json", {**state, **extra})  # last: its presence marks a whole checkpoint

    write_checkpoint_folder(folder, write)


def load_checkpoint(
    folder: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scaler: Any
) -> dict:
    """Restore what `save_checkpoint` wrote; returns its state dict (step, metrics lines...).
    Every rank reads the whole tensors and keeps its shard of them (`like`) under --fsdp."""
    params = trainable_parameters(model)
    weights = load_file(str(folder / "trainable.safetensors"))
    if set(weights) != set(params):
        raise AssayError(f"checkpoint in {folder} does not match this model's trainable parameters")
    moments = load_file(str(folder / "optimizer.safetensors"))
    state = read_json(folder / "state.json")
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(like(p, weights[name]))
            if name in state["optimizer_steps"]:
                optimizer.state[p] = {
                    "step": torch.tensor(state["optimizer_steps"][name], dtype=torch.float32),
                    "exp_avg": like(p, moments[f"{name}.exp_avg"]).clone(),
                    "exp_avg_sq": like(p, moments[f"{name}.exp_avg_sq"]).clone(),
                }
    if scaler is not None and state.get("scaler"):
        scaler.load_state_dict(state["scaler"])
    torch.set_rng_state(load_file(str(folder / "rng.safetensors"))["torch_rng"])
    return state
