"""Optimizer second-moment normalizers: g ⊘ sqrt(V), with V from Adam or Adafactor. Always fp32.

- Adafactor keeps V rank one per matrix: V ≈ row ⊗ col / mean(row), with row [out] the mean
  of g² over columns and col [in] its mean over rows. Then g_ij / sqrt(V_ij) =
  (g_i · sqrt(mean(row) / row_i)) (a_j / sqrt(col_j)), so the correction is a scale of the
  output gradient and of the layer input: folded into the projection matrices, it is free.
- Adam keeps a full V [out, in]. It does not factor, so the collector forms each example's
  full weight gradient (B × out × in floats per module per batch) before dividing and
  projecting: fine for LoRA adapters, costly for full models (see docs/index-format.md).

V comes from a real optimizer state (`optimizer.pt` of torch / Hugging Face Trainer, read with
`torch.load(weights_only=True)`), or is estimated by running the optimizer's own second-moment
update (bias-corrected EMA of the mean-loss minibatch gradient squared) over a data sample.
Tensors are stored per module in the (out, in) orientation, whatever the layer's own layout.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from assay.core.distributed import Distributed
from assay.core.errors import AssayError, first_line
from assay.core.fsdp import full_tensor
from assay.core.precision import STATS_DTYPE, PrecisionPolicy, full_precision
from assay.core.progress import Progress
from assay.lm.data import Examples, collate, token_batches
from assay.lm.hooks import is_conv1d
from assay.lm.losses import example_losses

ADAM_EPS = 1e-8
ASSAY_STATE_FILE = "optimizer_state.safetensors"  # written by `assay finetune`
ASSAY_STATE_FORMAT = "assay-adam-v1"
TINY = 1e-30  # Adafactor's eps1: keeps every factor strictly positive


@dataclass
class Normalizer:
    """fp32 second moments per module. adafactor: "<m>.row" [out], "<m>.col" [in]; adam: "<m>" [out, in]."""

    kind: Literal["adafactor", "adam"]
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.tensors = {k: v.detach().to("cpu", STATS_DTYPE) for k, v in self.tensors.items()}

    def scales(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Adafactor: (s_out [out], s_in [in]) with g/sqrt(V) = (s_out ⊙ g)(s_in ⊙ a)ᵀ."""
        row = self.tensors[f"{name}.row"].clamp_min(TINY)
        col = self.tensors[f"{name}.col"].clamp_min(TINY)
        return (row.mean() / row).sqrt(), col.rsqrt()

    def full(self, name: str) -> torch.Tensor:
        """Adam: [out, in] elementwise 1 / (sqrt(v) + eps)."""
        return 1.0 / (self.tensors[name].clamp_min(0).sqrt() + ADAM_EPS)

    def save(self, path: Path) -> None:
        tmp = path.with_name(path.name + ".tmp")  # atomic: a killed build never leaves half a file
        tensors = {k: v.contiguous() for k, v in self.tensors.items()}
        save_file(tensors, str(tmp), metadata={"kind": self.kind})
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: Path) -> Normalizer:
        try:
            with safe_open(str(path), framework="pt") as f:
                kind = (f.metadata() or {}).get("kind", "")
                tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
        except Exception as e:  # SafetensorError for a torn or garbled file
            raise AssayError(f"{path} is damaged ({first_line(e)})") from None
        if kind not in ("adafactor", "adam"):
            raise AssayError(f"{path} is not an assay normalizer file")
        return cls(kind, tensors)  # type: ignore[arg-type]


def _weight_shape_out_in(module: nn.Module) -> tuple[int, int]:

    rows, cols = (int(d) for d in module.weight.shape)  # type: ignore[union-attr]
    return (cols, rows) if is_conv1d(module) else (rows, cols)


def _from_second_moment(kind: str, name: str, v: torch.Tensor) -> dict[str, torch.Tensor]:
    """A full V [out, in] as the normalizer's tensors (factored for adafactor)."""
    if kind == "adam":
        return {name: v}
    return {f"{name}.row": v.mean(dim=1), f"{name}.col": v.mean(dim=0)}


def _from_factors(kind: str, name: str, row: torch.Tensor, col: torch.Tensor) -> dict[str, torch.Tensor]:
    if kind == "adafactor":
        return {f"{name}.row": row, f"{name}.col": col}
    return {name: torch.outer(row, col) / row.mean().clamp_min(TINY)}


# --- estimated from data ----------------------------------------------------------------------
def estimate_normalizer(
    kind: Literal["adafactor", "adam"],
    model: nn.Module,
    modules: dict[str, nn.Module],
    examples: Examples,
    policy: PrecisionPolicy,
    pad_id: int,
    token_batch_size: int,
    beta2: float = 0.999,
) -> Normalizer:
    """Run the optimizer's second-moment update over `examples` as training would see them.

    Each step's gradient is that of the mean token loss of one token batch (as a trainer
    computes it), taken under the precision policy; moments accumulate in fp32, autocast off.
    """

    saved = {n: p.requires_grad for n, p in model.named_parameters()}
    for p in model.parameters():
        p.requires_grad_(False)
    for m in modules.values():
        m.weight.requires_grad_(True)  # type: ignore[union-attr]
    moments: dict[str, torch.Tensor] = {}
    steps = 0
    bar = Progress(len(examples), f"{kind} moments", enabled=Distributed.current().is_main)
    try:
        for positions in token_batches(examples, token_batch_size):
            batch = collate(examples, positions, pad_id, policy.device)
            with policy.autocast():
                losses = example_losses(model, batch)  # [B] fp32
            with full_precision(policy.device):
                loss = losses.sum() / (batch["labels"][:, 1:] != -100).sum().clamp_min(1)
            model.zero_grad(set_to_none=True)
            loss.backward()
            steps += 1
            with full_precision(policy.device), torch.no_grad():
                for name, m in modules.items():
                    weight: Any = m.weight
                    g = full_tensor(weight.grad).to(STATS_DTYPE)  # --fsdp: the gathered gradient
                    g = g.T if is_conv1d(m) else g  # [out, in]
                    sq = torch.square(g) + (TINY if kind == "adafactor" else 0.0)
                    prev = moments.get(name, torch.zeros_like(sq))
                    moments[name] = beta2 * prev + (1 - beta2) * sq
            bar.update(len(positions), int(batch["attention_mask"].sum()))
    finally:
        bar.close()
        model.zero_grad(set_to_none=True)
        for n, p in model.named_parameters():
            p.requires_grad_(saved[n])
    correction = 1 - beta2**steps  # Adam's bias correction: v̂ = v / (1 - β2^t)
    tensors: dict[str, torch.Tensor] = {}
    for name, v in moments.items():
        tensors.update(_from_second_moment(kind, name, v / correction))
    return Normalizer(kind, tensors)


# --- loaded from an optimizer checkpoint ------------------------------------------------------
def load_optimizer_state(
    path: str | Path, kind: Literal["adafactor", "adam"], model: nn.Module, modules: dict[str, nn.Module]
) -> Normalizer:
    """Second moments from an optimizer checkpoint: `assay finetune`'s optimizer_state.safetensors
    (or its run folder), or a torch / Hugging Face Trainer `optimizer.pt` (Adam(W) or Adafactor)."""
    path = Path(path)
    if path.is_dir():
        path = path / ASSAY_STATE_FILE
    if path.suffix == ".safetensors":
        return _load_assay_state(path, kind, modules)
    try:
        saved = torch.load(str(path), map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise AssayError(f"optimizer state {path} not found") from None
    except Exception:  # weights_only refuses anything but tensors and plain containers
        raise AssayError(
            f"{path} is not an optimizer state assay can read safely: give `assay finetune`'s "
            "optimizer_state.safetensors (or its run folder) or a torch optimizer state_dict (optimizer.pt) "
            "of tensors and plain containers"
        ) from None
    if not isinstance(saved, dict) or "state" not in saved or "param_groups" not in saved:
        raise AssayError(f"{path} is not a torch optimizer state_dict (no 'state'/'param_groups')")
    by_name = _match_parameters(saved, model, path)
    tensors: dict[str, torch.Tensor] = {}
    for name, m in modules.items():
        state = by_name.get(f"{name}.weight")
        if not state:
            raise AssayError(f"{path} holds no optimizer state for {name}.weight (was it trained?)")
        tensors.update(_tensors_from_state(kind, name, m, state, path))
    return Normalizer(kind, tensors)


def live_optimizer_state(
    optimizer: Any, kind: Literal["adafactor", "adam"], modules: dict[str, nn.Module]
) -> Normalizer:
    """Second moments of a live torch optimizer (Adam(W) or Adafactor; an Accelerate-wrapped one
    too), read now, bias-corrected as `load_optimizer_state` corrects a saved one."""
    inner = getattr(optimizer, "optimizer", optimizer)  # Accelerate wraps the torch optimizer
    betas = {id(p): g.get("betas", (0.9, 0.999))[1] for g in inner.param_groups for p in g["params"]}
    tensors: dict[str, torch.Tensor] = {}
    for name, m in modules.items():
        weight = m.weight
        state = inner.state.get(weight)
        if not state:
            raise AssayError(
                f"the optimizer holds no second moments for {name}.weight yet: collect after its first step"
            )
        held = {k: v.detach().cpu() if torch.is_tensor(v) else v for k, v in state.items()}
        held["__beta2__"] = betas.get(id(weight), 0.999)
        tensors.update(_tensors_from_state(kind, name, m, held, "the optimizer"))
    return Normalizer(kind, tensors)


def _load_assay_state(path: Path, kind: str, modules: dict[str, nn.Module]) -> Normalizer:
    """`assay finetune`'s export: "NAME.exp_avg_sq" per parameter name, metadata step and beta2."""
    if not path.exists():
        raise AssayError(f"optimizer state {path} not found")
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        if meta.get("format") != ASSAY_STATE_FORMAT:
            raise AssayError(f"{path} is not an assay optimizer state (format {meta.get('format')!r})")
        keys = set(f.keys())
        states = {}
        for name in modules:
            key = f"{name}.weight.exp_avg_sq"
            if key not in keys:
                raise AssayError(f"{path} holds no second moment for {name}.weight (was it trained?)")
            states[name] = {"exp_avg_sq": f.get_tensor(key), "step": float(meta["step"])}
            states[name]["__beta2__"] = float(meta["beta2"])
    tensors: dict[str, torch.Tensor] = {}
    for name, m in modules.items():
        tensors.update(_tensors_from_state(kind, name, m, states[name], path))
    return Normalizer(kind, tensors)  # type: ignore[arg-type]


def _tensors_from_state(
    kind: str, name: str, module: nn.Module, state: dict[str, Any], path: str | Path
) -> dict[str, torch.Tensor]:

    conv = is_conv1d(module)
    if "exp_avg_sq" in state:
        v = state["exp_avg_sq"].to(STATS_DTYPE)
        v = v.T if conv else v
        step = float(state.get("step", torch.tensor(0.0)))
        beta2 = float(state.get("__beta2__", 0.999))
        if step > 0:
            v = v / (1 - beta2**step)  # what Adam divides by
        return _from_second_moment(kind, name, v)
    if "exp_avg_sq_row" in state and "exp_avg_sq_col" in state:
        row, col = state["exp_avg_sq_row"].to(STATS_DTYPE), state["exp_avg_sq_col"].to(STATS_DTYPE)
        row, col = (col, row) if conv else (row, col)  # Conv1D stores (in, out)
        return _from_factors(kind, name, row, col)
    raise AssayError(f"{path}: state of {name}.weight has neither exp_avg_sq nor Adafactor's factors")


def _match_parameters(saved: dict[str, Any], model: nn.Module, path: str | Path) -> dict[str, dict[str, Any]]:
    """Map the state's integer parameter ids to names, checking every shape.

    torch numbers the parameters in the order the groups listed them. Two orders are tried:
    the model's trainable parameters in order (a plain optimizer), and the Hugging Face
    Trainer's split (matrices with weight decay first, then biases and norms).
    """
    ids = [i for g in saved["param_groups"] for i in g["params"]]
    betas = {i: g.get("betas", (0.9, 0.999))[1] for g in saved["param_groups"] for i in g["params"]}
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    decay = [(n, p) for n, p in trainable if p.ndim >= 2 and "norm" not in n.lower()]
    no_decay = [(n, p) for n, p in trainable if (n, p) not in decay]
    for order in (trainable, decay + no_decay):
        if len(order) != len(ids):
            continue
        if all(_shape_fits(saved["state"].get(i), p) for i, (_, p) in zip(ids, order)):
            states = {n: dict(saved["state"].get(i, {})) for i, (n, _) in zip(ids, order)}
            for i, (n, _) in zip(ids, order):
                states[n]["__beta2__"] = betas[i]
            return states
    raise AssayError(
        f"{path}: its {len(ids)} parameters do not line up with the model's {len(trainable)} trainable "
        "ones; load the same model (and adapter) the optimizer trained"
    )


def _shape_fits(state: dict[str, Any] | None, p: torch.Tensor) -> bool:
    if not state:
        return True  # parameters that never got a gradient have no state
    if "exp_avg_sq" in state:
        return tuple(state["exp_avg_sq"].shape) == tuple(p.shape)
    if "exp_avg_sq_row" in state:
        return tuple(state["exp_avg_sq_row"].shape) == tuple(p.shape[:-1])
    return True


def sample_positions(n: int, k: int, seed: int) -> np.ndarray:
    """A seeded sample of k of n positions, sorted (deterministic across reruns)."""
    rng = np.random.default_rng(seed)
    return np.sort(rng.permutation(n)[: min(k, n)])
