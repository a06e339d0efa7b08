"""Checkpoints of `assay sae train`: weights, optimizer state and counters (safetensors + JSON).

Adam: its per-parameter state (step, exp_avg, exp_avg_sq). Signum: the parameters hold y and
the state holds z and x; the averaging counters (lr_max, weight_sum, k) go to state.json.
A resumed run continues bit for bit (tests/sae/test_sae_train.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from assay.core.errors import AssayError
from assay.core.runs import read_json, write_json
from assay.sae.metrics import DeadLatents
from assay.sae.model import SparseAutoencoder
from assay.sae.optim import ScheduleFreeSignSGD
from assay.training.checkpoint import find_checkpoint, write_checkpoint_folder

CHECKPOINT = "checkpoint"


@dataclass
class TrainState:
    """Counters that a checkpoint restores along with the weights."""

    step: int = 0
    tokens: int = 0


def save_checkpoint(
    run_dir: Path, sae: SparseAutoencoder, opt: torch.optim.Optimizer, dead: DeadLatents, state: TrainState
) -> None:
    """Weights (signum: y), optimizer state and counters as safetensors + JSON, replaced atomically."""
    tensors: dict[str, torch.Tensor] = {}
    for i, p in enumerate(sae.parameters()):
        for key, value in opt.state.get(p, {}).items():
            tensors[f"{i}.{key}"] = torch.as_tensor(value).detach().clone().contiguous()
    saved: dict[str, Any] = {"step": state.step, "tokens": state.tokens, "optimizer": _kind(opt)}
    if isinstance(opt, ScheduleFreeSignSGD):
        saved["optimizer_groups"] = opt.scalars()  # averaging weights (exact: JSON floats round-trip)

    def write(tmp: Path) -> None:
        weights = {k: v.detach().contiguous() for k, v in sae.state_dict().items()}
        save_file(weights, str(tmp / "sae.safetensors"))
        save_file(tensors, str(tmp / "optimizer.safetensors"))
        save_file({"since": dead.since.contiguous()}, str(tmp / "counters.safetensors"))
        write_json(tmp / "state.json", saved)  # last: its presence marks a whole checkpoint

    write_checkpoint_folder(run_dir / CHECKPOINT, write)


def load_checkpoint(
    run_dir: Path, sae: SparseAutoencoder, opt: torch.optim.Optimizer, dead: DeadLatents
) -> TrainState:
    folder = find_checkpoint(run_dir / CHECKPOINT)
    if folder is None:
        raise AssayError(f"{run_dir} holds no whole checkpoint to resume from")
    saved = read_json(folder / "state.json")
    if saved.get("optimizer", "adam") != _kind(opt):
        raise AssayError(
            f"{folder} holds {saved.get('optimizer', 'adam')} state but this run uses {_kind(opt)}; "
            "rerun with the same --optimizer or delete the checkpoint"
        )
    state = load_file(str(folder / "sae.safetensors"))
    if "log_threshold" in state:  # a checkpoint from before JumpReLU learned its threshold directly
        state["jumprelu_threshold"] = state.pop("log_threshold").exp()
    sae.load_state_dict(state)
    tensors = load_file(str(folder / "optimizer.safetensors"))
    for i, p in enumerate(sae.parameters()):
        entries = {k.split(".", 1)[1]: v for k, v in tensors.items() if k.split(".", 1)[0] == str(i)}
        if entries:
            opt.state[p] = entries
    dead.since.copy_(load_file(str(folder / "counters.safetensors"))["since"])
    if isinstance(opt, ScheduleFreeSignSGD):
        if len(saved["optimizer_groups"]) != len(opt.param_groups):  # an older layout of groups
            raise AssayError(
                f"{folder} was written by an older assay ({len(saved['optimizer_groups'])} signum parameter "
                f"groups, not {len(opt.param_groups)}); delete the checkpoint to train from the start"
            )
        opt.load_scalars(saved["optimizer_groups"])
    return TrainState(step=int(saved["step"]), tokens=int(saved["tokens"]))


def _kind(opt: torch.optim.Optimizer) -> str:
    return "signum" if isinstance(opt, ScheduleFreeSignSGD) else "adam"
