"""Per-example projected gradients of linear layers, without ever forming `.grad`.

For a linear layer y = W a (+ b), the per-example weight gradient is ∇W = Σ_t g_t a_tᵀ with
a_t the layer input and g_t = ∂L/∂y_t at token t. A forward hook records a_t (projected at
once: A P_inᵀ, [B, T, p]); a tensor hook on the output receives g_t in the backward and
finishes the block (G P_outᵀ)ᵀ (A P_inᵀ) = P_out ∇W P_inᵀ with one batched matmul.

Why this is cheaper than a training step: every weight has `requires_grad=False` while
collecting, so autograd never runs the weight-gradient GEMM nor materialises `.grad`; the
backward still reaches the hooked layers because a hooked output that does not require
grad (the first layer's, whose inputs are constants) is turned into a leaf that does.

Precision: under autocast a forward hook sees fp32 or bf16 inputs and the backward hook
sees bf16 gradients. Inside an autocast-off region, a bf16 one is projected by a bf16 GEMM
against the exact ±1 signs (fp32 accumulation, the p-wide result rounded once) and any other
is cast to fp32 first; the projected values are fp32 either way, so the per-example products
and sums accumulate in fp32 whatever the compute dtype (see `_project`).

Memory: while collecting, SwiGLU MLPs and RMSNorms keep only their inputs for backward and
grouped-query attention keeps no repeated key/value heads (`assay.lm.lean`: the same numbers
up to the order of the key/value gradient sums; docs/index-format.md).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from assay.attribution.batches import check_losses
from assay.attribution.projection import Projector
from assay.core.console import warn
from assay.core.errors import AssayError
from assay.core.precision import STATS_DTYPE, PrecisionPolicy, check_finite, full_precision
from assay.lm.hooks import is_conv1d, is_linear, match_modules
from assay.lm.lean import grouped_query_attention, recompute_elementwise
from assay.lm.moe import ExpertLinear, expose_experts, uncovered_experts
from assay.lm.packing import SEGMENTS, Repadding, is_packed

Objective = Callable[[nn.Module, dict[str, torch.Tensor]], torch.Tensor]
"""(model, batch) -> [B] per-example scalars whose gradients are collected."""

DEFAULT_MODULES: tuple[str, ...] = ("!*lm_head",)
FP16_INITIAL_SCALE = 2.0**12
FP16_MAX_RETRIES = 12


def linear_modules(model: nn.Module, patterns: str | Sequence[str] = DEFAULT_MODULES) -> dict[str, nn.Module]:
    """Trainable linear layers (nn.Linear, Conv1D, and each expert's projections of an MoE
    layer, `assay.lm.moe`) matching the glob patterns (`!` excludes; one str is one pattern).

    "Trainable" means weight.requires_grad: with a LoRA adapter only its A/B layers qualify.
    """
    patterns = module_patterns(patterns)
    expose_experts(model)
    linear = {n: m for n, m in model.named_modules() if isinstance(m, ExpertLinear) or is_linear(m)}
    found = {n: m for n, m in linear.items() if _trainable(m)}
    _warn_uncovered_experts(model)
    chosen = match_modules(list(found), patterns)
    if not chosen:
        given = " ".join(patterns)
        frozen = match_modules([n for n in linear if n not in found], patterns)
        if frozen:
            raise AssayError(
                f"the {len(frozen)} linear modules matching --modules {given} (e.g. {frozen[0]}) are all "
                "frozen (requires_grad=False): unfreeze those to attribute, e.g. model.requires_grad_(True)"
            )
        sample = ", ".join(list(found)[:6]) or "none"
        raise AssayError(f"no trainable linear module matches --modules {given}; some: {sample}")
    return {n: found[n] for n in chosen}


def module_patterns(patterns: Any) -> tuple[str, ...]:
    """Glob patterns as a tuple: one str is one pattern (not one per character)."""
    if isinstance(patterns, str):
        return (patterns,)
    if isinstance(patterns, Iterable) and all(isinstance(p, str) for p in patterns):
        return tuple(patterns)
    raise AssayError(
        f"modules must be glob patterns over module names (a str or a tuple of str), not {patterns!r}"
    )


def _trainable(module: nn.Module) -> bool:
    if isinstance(module, ExpertLinear):
        return module.trainable
    return bool(module.weight.requires_grad)  # type: ignore[union-attr]


def _warn_uncovered_experts(model: nn.Module) -> None:
    """One line when an MoE's experts are in a layout `assay.lm.moe` does not rewrite: their
    fused weights (most of such a model's) would otherwise be left out without a word."""
    uncovered = uncovered_experts(model)
    if uncovered:
        warn(
            f"{len(uncovered)} fused expert weights of this mixture of experts (e.g. {uncovered[0]}) are in "
            "a layout assay does not collect: the gradients cover the model's other linear layers only"
        )


def warn_silent_lora(model: nn.Module, modules: dict[str, nn.Module]) -> None:
    """One line when collected layers are LoRA A layers whose B is all zero (PEFT's initialisation
    of a fresh adapter): A's gradient, Bᵀ g aᵀ, is then exactly 0 until the adapter is trained, so
    those layers only widen every row (scoring leaves them out: `precondition.silent`)."""
    found = dict(model.named_modules())
    silent = []
    for name in modules:
        partner = found.get(name.replace(".lora_A.", ".lora_B.")) if ".lora_A." in name else None
        weight = getattr(partner, "weight", None)
        sharded = type(getattr(weight, "data", None)).__name__ == "DTensor"  # --fsdp: left unchecked
        if isinstance(weight, torch.Tensor) and not sharded and not bool(weight.any()):
            silent.append(name)
    if silent:
        warn(
            f"{len(silent)} of the {len(modules)} collected layers are LoRA A layers whose B is all zero "
            f"(a fresh adapter; e.g. {silent[0]}): their gradients are 0 until it is trained. Collect "
            "the others alone with --modules '!*lora_A*', or start from a trained adapter"
        )


@dataclass
class ModuleSlot:
    """Where one module's block lives in a gradient row."""

    name: str
    in_features: int
    out_features: int
    conv1d: bool
    start: int
    stop: int
    shape: tuple[int, int]  # stored block shape: (p, p); raw: weight's own layout


def layout(modules: dict[str, nn.Module], projection_dim: int) -> list[ModuleSlot]:
    """Column slices of each module, in model order."""
    slots, start = [], 0
    for name, m in modules.items():
        conv = is_conv1d(m)
        rows, cols = (int(d) for d in m.weight.shape)  # type: ignore[union-attr]
        in_f, out_f = (rows, cols) if conv else (cols, rows)
        shape = (projection_dim, projection_dim) if projection_dim > 0 else (rows, cols)
        size = shape[0] * shape[1]
        slots.append(ModuleSlot(name, in_f, out_f, conv, start, start + size, shape))
        start += size
    return slots


class GradientCollector:
    """Context manager: hooks on enter, hooks removed and `requires_grad` restored on exit.

    `normalizer` (see normalizers.py) supplies per-module fp32 `scales(name)` -> (s_out, s_in)
    vectors (Adafactor: applied to g and a before projection) or `full(name)` -> [out, in]
    inverse-root second moments (Adam: needs the full per-example gradient).
    """

    def __init__(
        self,
        model: nn.Module,
        modules: dict[str, nn.Module],
        projector: Projector,
        policy: PrecisionPolicy,
        normalizer: Any = None,
        project_in_compute_dtype: bool = True,
        compiled: bool = False,
    ):
        self.model, self.modules, self.projector, self.policy = model, modules, projector, policy
        # True (default): a bf16 a or g is projected as it is, by a bf16 GEMM against the exact
        # ±1 signs (fp32 accumulation inside, the p-wide result rounded once to bf16, then fp32
        # and the 1/√p scale): no full-width fp32 cast of the layer's activations. fp16 is cast
        # first (loss-scaled values could overflow a p-wide fp16 result), and so is everything
        # under Adafactor (its scales, folded into P, are not exact in bf16). False: always
        # cast to fp32, then project. See docs/index-format.md for what each costs.
        adafactor = normalizer is not None and normalizer.kind == "adafactor"
        self._bf16_projection = project_in_compute_dtype and not adafactor
        self._compiled = compiled  # the elementwise steps as compiled kernels (assay.lm.elementwise)
        self.normalizer = normalizer
        self.slots = layout(modules, projector.dim)
        self.dim = self.slots[-1].stop
        self._device = policy.device
        self._mats: dict[tuple[str, str], torch.Tensor | None] = {}
        self._saved: dict[str, list[torch.Tensor | None]] = {}
        self._mask: torch.Tensor | None = None
        self._repad: Repadding | None = None  # a packed batch's way back to [B, T]
        self._blocks: dict[str, torch.Tensor] = {}  # module -> [B, block size] fp32
        self._pending: tuple[torch.Tensor, list[tuple[ModuleSlot, int]]] | None = None
        self._group_mats: dict[tuple[str, ...], torch.Tensor] = {}
        self._signs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(P) -> (P, √p·P bf16)
        self._handles: list[Any] = []
        self._lean = contextlib.ExitStack()
        self._requires_grad: dict[str, bool] = {}
        self._inv_sqrt_v: dict[str, torch.Tensor] = {}  # Adam: [out, in] fp32 1 / (sqrt(v) + eps)

    # --- set-up -----------------------------------------------------------------------------
    def __enter__(self) -> GradientCollector:
        self._requires_grad = {n: p.requires_grad for n, p in self.model.named_parameters()}
        for p in self.model.parameters():
            p.requires_grad_(False)  # no weight-gradient GEMMs, no .grad
        try:
            self.attach()
            self._lean.enter_context(recompute_elementwise(self.model, self._compiled))
            self._lean.enter_context(grouped_query_attention(self._device))
        except BaseException:
            self.__exit__()  # `with` calls no __exit__ when entering fails: never leave the model frozen
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self._lean.close()
        self.detach()
        for n, p in self.model.named_parameters():
            p.requires_grad_(self._requires_grad.get(n, p.requires_grad))

    def attach(self) -> None:
        """Prepare each module's projection sides and hook the modules (nothing else changes: a
        training loop's own backward runs the hooks too, see live.py)."""
        for slot in self.slots:
            if self._uses_full(slot.name):
                self._inv_sqrt_v[slot.name] = self.normalizer.full(slot.name).to(self._device)
            self._prepare_side(slot, "in", slot.in_features)
            self._prepare_side(slot, "out", slot.out_features)
            hook = partial(self._forward_hook, slot)
            self._handles.append(self.modules[slot.name].register_forward_hook(hook))

    def detach(self) -> None:
        """Remove the hooks and what they kept."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._saved.clear()
        self._group_mats.clear()
        self._signs.clear()

    def _uses_full(self, name: str) -> bool:
        return self.normalizer is not None and self.normalizer.kind == "adam"

    def _prepare_side(self, slot: ModuleSlot, side: str, size: int) -> None:
        """The fp32 matrix a side is multiplied by: P (p × size), P·diag(s), diag(s) or None."""
        mat: torch.Tensor | None = None
        scale = None
        if self.normalizer is not None and self.normalizer.kind == "adafactor":
            s_out, s_in = self.normalizer.scales(slot.name)
            scale = (s_in if side == "in" else s_out).to(self._device, STATS_DTYPE)
        if self.projector.dim > 0 and not self._uses_full(slot.name):
            mat = self.projector.matrix(slot.name, side, size, self._device)
            if scale is not None:
                mat = mat * scale[None, :]  # Adafactor folded into the projection: free
        elif scale is not None:
            mat = scale  # raw gradients: a diagonal scale only
        self._mats[(slot.name, side)] = mat

    # --- hooks ------------------------------------------------------------------------------
    def _side(self, slot: ModuleSlot, side: str, x: torch.Tensor) -> torch.Tensor:
        """[B, ..., f] -> [B, T, p] (or [B, T, f] raw), fp32."""
        x = x.reshape(x.shape[0], -1, x.shape[-1])
        mat = self._mats[(slot.name, side)]
        if mat is not None and mat.dim() == 2:
            return self._project(x, mat)
        x = x.to(STATS_DTYPE)  # explicit cast: never promotion
        return x if mat is None else x * mat

    def _project(self, x: torch.Tensor, mat: torch.Tensor) -> torch.Tensor:
        """[B, T, f] @ [k, f]ᵀ -> [B, T, k] fp32."""
        if self._bf16_projection and x.dtype == torch.bfloat16:
            root = self.projector.dim**0.5  # P = signs / √p: the signs are exact in bf16
            return F.linear(x, self._bf16_signs(mat, root)).to(STATS_DTYPE) / root
        return F.linear(x.to(STATS_DTYPE), mat)

    def _bf16_signs(self, mat: torch.Tensor, root: float) -> torch.Tensor:
        """√p·P in bf16 (the ±1 signs), made once per matrix: not two kernels per layer and batch."""
        mat_and_signs = self._signs.get(id(mat))
        if mat_and_signs is None or mat_and_signs[0] is not mat:
            mat_and_signs = self._signs[id(mat)] = (mat, (mat * root).to(torch.bfloat16))
        return mat_and_signs[1]

    def _use_mask(self, mask: torch.Tensor | None) -> None:
        """The batch's [B, T] padding mask, kept as [B, T, 1] fp32: cast once, not once a layer
        (any other mask, e.g. a 4-D one, masks nothing here)."""
        self._mask = mask[:, :, None].to(STATS_DTYPE) if mask is not None and mask.dim() == 2 else None

    def _masked(self, x: torch.Tensor) -> torch.Tensor:
        """Zero padded tokens of [B, T, k]. Masking g alone makes g_t a_tᵀ exactly 0 there."""
        mask = self._mask  # [B, T, 1] fp32
        if mask is not None and mask.shape[:2] == x.shape[:2]:
            x = x * mask
        return x

    def _forward_hook(self, slot: ModuleSlot, module: nn.Module, inputs: Any, output: Any) -> Any:
        if not torch.is_grad_enabled():
            return None
        saved = self._saved.setdefault(slot.name, [])
        saved.append(None)
        x = inputs[0]
        groupable = self._groupable(slot)
        if groupable and self._pending is not None and self._pending[0] is x:
            self._pending[1].append((slot, len(saved) - 1))  # same input as the previous layer (q/k/v)
        else:
            self._flush()
            self._pending = (x, [(slot, len(saved) - 1)])
            if not groupable:
                self._flush()
        out = output
        if not out.requires_grad:
            out = out.detach().requires_grad_(True)  # a leaf, so backward reaches this layer
        out.register_hook(partial(self._backward_hook, slot, len(saved) - 1))
        return out if out is not output else None

    def _groupable(self, slot: ModuleSlot) -> bool:
        mat = self._mats[(slot.name, "in")]
        return mat is not None and mat.dim() == 2

    def _flush(self) -> None:
        """Project the pending input once for every layer that read it: one GEMM, not three."""
        if self._pending is None:
            return
        x, members = self._pending
        self._pending = None
        with full_precision(self._device):
            if len(members) == 1:
                slot, call = members[0]
                self._saved[slot.name][call] = self._side(slot, "in", x)
                return
            key = tuple(slot.name for slot, _ in members)
            if key not in self._group_mats:
                self._group_mats[key] = torch.cat([self._mats[(n, "in")] for n in key])  # type: ignore[misc]
            x = x.reshape(x.shape[0], -1, x.shape[-1])
            parts = self._project(x, self._group_mats[key]).split(self.projector.dim, dim=-1)
            for (slot, call), part in zip(members, parts):
                self._saved[slot.name][call] = part  # [B, T, p]

    def _backward_hook(self, slot: ModuleSlot, call: int, grad: torch.Tensor) -> None:
        self._flush()
        with full_precision(self._device):
            a = self._saved[slot.name][call]  # [B, T, p_in] fp32
            self._saved[slot.name][call] = None
            g = self._masked(self._side(slot, "out", grad))  # [B, T, p_out] fp32
            assert a is not None
            if self._repad is not None:  # one packed row -> [B, T, p], zeros after each example
                a, g = self._repad(a), self._repad(g)
            if self._uses_full(slot.name):
                block = self._normalized_full(slot, g, a)
            elif slot.conv1d and self.projector.dim == 0:
                block = torch.bmm(a.transpose(1, 2), g)  # [B, in, out]: Conv1D's own layout
            else:
                block = torch.bmm(g.transpose(1, 2), a)  # [B, p_out, p_in] (raw: [B, out, in])
            block = block.reshape(block.shape[0], -1)
            prev = self._blocks.get(slot.name)
            self._blocks[slot.name] = block if prev is None else prev + block  # layers called twice

    def _normalized_full(self, slot: ModuleSlot, g: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        """Adam: the full per-example gradient [B, out, in] divided by sqrt(v) + eps, then projected."""
        full = torch.bmm(g.transpose(1, 2), a) * self._inv_sqrt_v[slot.name]  # [B, out, in]
        if self.projector.dim > 0:
            return self.projector.project_full(slot.name, full)
        return full.transpose(1, 2) if slot.conv1d else full

    # --- one batch --------------------------------------------------------------------------
    def gradients(
        self, batch: dict[str, torch.Tensor], objective: Objective
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """([B, D] fp32 per-example gradients, [B] fp32 objective values) for one batch.

        fp16: the objective is multiplied by a loss scale before backward and the results
        divided by it in fp32; on overflow the batch is retried at half the scale.
        """
        scale = FP16_INITIAL_SCALE if self.policy.uses_loss_scaling else 1.0
        for _ in range(FP16_MAX_RETRIES):
            grads, values = self._attempt(batch, objective, scale)
            finite = bool(torch.isfinite(grads).all())
            if finite or not self.policy.uses_loss_scaling:
                break
            scale /= 16.0
        check_finite(values, "per-example losses", self.policy)
        check_finite(grads, "per-example gradients", self.policy)
        return grads, values

    def _attempt(
        self, batch: dict[str, torch.Tensor], objective: Objective, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        packed = is_packed(batch)
        self._repad = Repadding.of(batch[SEGMENTS], self._device) if packed else None
        self._use_mask(None if packed else batch.get("attention_mask"))
        self._saved, self._blocks, self._pending = {}, {}, None
        try:
            with torch.enable_grad(), self.policy.autocast():
                values = check_losses(objective(self.model, batch), batch)  # [B]
            self._flush()
            values = values.to(STATS_DTYPE)
            if not values.requires_grad:
                raise AssayError("the objective does not depend on any of the collected modules")
            (values.sum() * scale).backward()
            grads = self._assemble(values.shape[0])
            grads = grads / scale if scale != 1.0 else grads
        finally:
            self._saved, self._blocks, self._pending, self._mask, self._repad = {}, {}, None, None, None
        return grads, values.detach()

    def _assemble(self, batch_size: int) -> torch.Tensor:
        """[B, D] fp32: the blocks in column order (zeros for a layer the objective never used)."""
        parts = []
        for slot in self.slots:
            block = self._blocks.get(slot.name)
            if block is None:
                block = torch.zeros(
                    batch_size, slot.stop - slot.start, dtype=STATS_DTYPE, device=self._device
                )
            parts.append(block)
        return torch.cat(parts, dim=1)
