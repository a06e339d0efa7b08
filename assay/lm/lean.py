"""Memory a gradient-collection pass holds without needing it, given back without changing a number.

Collecting per-example gradients runs forward and backward through a frozen model. Three things
take memory there that the results never depend on:

- **Master weights under autocast.** A frozen linear layer's fp32 weight is only ever read
  through a cast to the autocast dtype, made anew at each call and kept alive for backward.
  `keep_compute_casts` stores that cast in place of the fp32 weight: the same numbers, a quarter
  of the weight memory at the peak, and no per-call casts. (Training needs its master weights;
  this is for frozen models only.)
- **Elementwise intermediates kept for backward.** A SwiGLU MLP keeps its gate, the gate's
  activation and the up projection; an RMSNorm that upcasts keeps an fp32 copy of its input.
  `recompute_elementwise` keeps only their inputs: the same ops on the same inputs, hence the
  same numbers. A silu gate and a frozen Llama-form RMSNorm of an fp32 input get a backward
  written out (`_SiluGate`, `_FrozenRMSNorm`: autograd's own derivative ops, in place where
  it can be; with `--compile` the same formulas as fused kernels, `assay.lm.elementwise`),
  other forms PyTorch's non-reentrant checkpoint around the elementwise steps. Llama's rotary
  embedding gets one too (`_Rotary`): its autograd graph slices, negates and concatenates each
  query and key, and differentiating the slices allocates a zero-filled copy per half.
  Fewer activation-sized buffers matter on CPU: each is a fresh mapping the kernel zeroes and
  faults in (see `assay.core.memory`).
- **Repeated keys and values.** With grouped-query attention, transformers copies each key and
  value head once per query head it serves before calling SDPA (unless it can pass SDPA's own
  `enable_gqa`, which it does on CPU only without a padding mask), and SDPA keeps the copies for
  backward. `grouped_query_attention` has SDPA read the shared heads instead (CPU only, where
  its flash kernel takes a mask with them): the same forward; the key/value gradients summed
  over each group inside the kernel in fp32 rather than in the compute dtype after it. (Batches
  that go without a mask, `assay.lm.padding`, get the shared heads from transformers itself.)
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from assay.core.precision import PrecisionPolicy
from assay.lm.elementwise import EAGER, Kernels, compiled_kernels
from assay.lm.hooks import is_linear
from assay.lm.moe import exposed_fused_weights

SWIGLU_PARTS = ("gate_proj", "up_proj", "down_proj", "act_fn")
SILU_TYPES = ("SiLU", "SiLUActivation")  # torch's and transformers' silu modules
# RMSNorms whose forward is Llama's, line for line (tests/lm/test_lean.py compares the sources)
LLAMA_RMSNORM_TYPES = frozenset(
    {
        "LlamaRMSNorm",
        "MistralRMSNorm",
        "MixtralRMSNorm",
        "Qwen2RMSNorm",
        "Qwen3RMSNorm",
        "Phi3RMSNorm",
        "SmolLM3RMSNorm",
    }
)


def keep_compute_casts(model: nn.Module, policy: PrecisionPolicy) -> int:
    """Store each frozen model's linear weights (and an MoE layer's fused expert weights, where
    `expose_experts` runs its loop) in the autocast dtype; returns how many changed.

    Only for a model used for gradient collection from here on (its master weights are gone).
    Left in fp32: the output head (its fp16 gradient path reads fp32 weights), weights shared
    with any other module (a tied embedding is looked up in fp32), LoRA adapters (PEFT casts
    their input to their weight's dtype, which would change it), and everything outside
    autocast policies (fp32 and bf16-pure have nothing to gain).
    """
    dtype = policy.autocast_dtype
    if dtype is None:
        return 0
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    owners: dict[int, int] = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            owners[id(p)] = owners.get(id(p), 0) + 1
    weights = [
        module.weight
        for name, module in model.named_modules()
        # PEFT casts a LoRA layer's input to its adapter's dtype: LoRA layers keep fp32
        if is_linear(module) and module is not head and ".lora_" not in name
    ]
    changed = 0
    for weight in [*weights, *exposed_fused_weights(model)]:
        if owners[id(weight)] > 1 or weight.dtype != torch.float32:
            continue
        if type(weight.data).__name__ == "DTensor":  # sharded (--fsdp): FSDP owns the dtypes
            continue
        weight.data = weight.data.to(dtype)
        changed += 1
    _own_remaining(model, dtype)
    return changed


def _own_remaining(model: nn.Module, cast_dtype: torch.dtype) -> None:
    """Copy the parameters left as loaded into memory of their own.

    transformers loads safetensors memory-mapped: the file's pages count as the process's
    resident memory for as long as any tensor still views the mapping, so the fp32 weights just
    replaced would stay resident through the embedding and norms that keep viewing it.
    """
    for p in model.parameters():
        if p.dtype != cast_dtype and type(p.data).__name__ != "DTensor":
            p.data = p.data.clone()


def _is_swiglu_mlp(module: nn.Module) -> bool:
    return type(module).__name__.endswith("MLP") and all(hasattr(module, a) for a in SWIGLU_PARTS)


def _is_upcasting_rmsnorm(module: nn.Module) -> bool:
    return type(module).__name__.endswith("RMSNorm") and hasattr(module, "variance_epsilon")


def _recomputed(fn: Callable[..., torch.Tensor], *args: torch.Tensor) -> torch.Tensor:
    """fn(*args), with only args kept for backward (fn recomputed there) when grad is on."""
    if not torch.is_grad_enabled() or not any(a.requires_grad for a in args):
        return fn(*args)
    out = checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=False)
    assert isinstance(out, torch.Tensor)
    return out


class _SiluGate(torch.autograd.Function):
    """silu(gate) * up keeping only gate and up: autograd's own backward ops, fewer buffers.

    The forward is transformers' two ops (the product written in place); the backward applies
    the derivatives autograd would (MulBackward's two products, then `silu_backward`) to the
    recomputed silu(gate), so the numbers are the same bit for bit, and it allocates three
    activation-sized buffers where a checkpoint's recomputation plus autograd allocate five.
    """

    @staticmethod
    def forward(ctx: Any, gate: torch.Tensor, up: torch.Tensor, kernels: Kernels) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(gate, up)
        ctx.kernels = kernels
        return kernels.silu_gate(gate, up)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:  # type: ignore[override]
        gate, up = ctx.saved_tensors
        return (*ctx.kernels.silu_gate_backward(grad, gate, up), None)


class _FrozenRMSNorm(torch.autograd.Function):
    """Llama's RMSNorm of an fp32 input with a frozen weight, w ⊙ (x ⊙ rsqrt(mean(x²) + ε)),
    keeping only x and the per-row rsqrt.

    The forward runs transformers' ops in its order; the backward is the chain rule autograd
    applies to them, op for op (Mul, Rsqrt, Mean and Pow backward), written with in-place
    steps: two activation-sized buffers where recomputing the forward under a checkpoint and
    differentiating it allocate nine. x comes in twice so that its two gradient terms (through
    x ⊙ rstd and through x²) reach autograd separately and are summed with the residual
    stream's in the plain graph's order: the same numbers bit for bit.
    """

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, x_again: torch.Tensor, weight: torch.Tensor, eps: float, kernels: Kernels
    ) -> torch.Tensor:  # type: ignore[override]
        out, rstd = kernels.rms_norm(x, weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        ctx.kernels = kernels
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None, None, None]:  # type: ignore[override]
        x, weight, rstd = ctx.saved_tensors
        return (*ctx.kernels.rms_norm_backward(grad, x, weight, rstd), None, None, None)


class _Rotary(torch.autograd.Function):
    """Llama's rotary embedding of one query or key, `x * cos + rotate_half(x) * sin`, with a
    written-out backward.

    The forward is transformers' ops in its order (the rotated copy written in place of a
    negation and a concatenation); the backward applies the derivatives autograd would: each
    product's gradient cast to x's dtype, the rotated one rotated back and added in x's dtype,
    which is the same sum of the same terms (autograd adds two zero-padded halves, exact), so
    the numbers are the same bit for bit, without the zero-filled copies slicing's backward makes.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        half = x.shape[-1] // 2
        rotated = torch.empty_like(x, memory_format=torch.contiguous_format)
        torch.neg(x[..., half:], out=rotated[..., :half])
        rotated[..., half:] = x[..., :half]
        out = x * cos
        out += rotated * sin
        ctx.save_for_backward(cos, sin)
        ctx.dtype = x.dtype
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        cos, sin = ctx.saved_tensors
        half = grad.shape[-1] // 2
        through_cos = (grad * cos).to(ctx.dtype)
        through_sin = (grad * sin).to(ctx.dtype)
        through_cos[..., :half] += through_sin[..., half:]
        through_cos[..., half:] -= through_sin[..., :half]
        return through_cos, None, None


def _rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' `apply_rotary_pos_emb`, each of q and k through `_Rotary` when it needs a
    gradient and its embedding does not."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)

    def embed(x: torch.Tensor) -> torch.Tensor:
        written = torch.is_grad_enabled() and x.requires_grad and not (cos.requires_grad or sin.requires_grad)
        if written and x.shape[-1] % 2 == 0:
            return _Rotary.apply(x, cos, sin)
        half = x.shape[-1] // 2
        return (x * cos) + (torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin)

    return embed(q), embed(k)


def _plain_function(fn: Any) -> Any:
    """The function itself: transformers may wrap it in the `kernels` package's module (a hub
    kernel's stand-in, whose forward calls the original, kept in its closure as `func`)."""
    if hasattr(fn, "__code__"):
        return fn
    forward: Any = getattr(type(fn), "forward", None)
    code = getattr(forward, "__code__", None)
    closure = getattr(forward, "__closure__", None)
    if code is None or closure is None or "func" not in code.co_freevars:
        return None
    return closure[code.co_freevars.index("func")].cell_contents


def _llama_rotary_globals(model: nn.Module) -> list[dict[str, Any]]:
    """The module namespaces whose attention calls an `apply_rotary_pos_emb` that is Llama's,
    bytecode for bytecode (the docstrings may differ)."""
    from transformers.models.llama import modeling_llama  # lazy: loaded with the model, not with assay.lm

    llama = _plain_function(modeling_llama.apply_rotary_pos_emb)
    if llama is None:  # wrapped some other way: leave every model's rotary as it is
        return []
    ref = llama.__code__
    found: dict[int, dict[str, Any]] = {}
    for module in model.modules():
        namespace = getattr(type(module).forward, "__globals__", {})
        fn = namespace.get("apply_rotary_pos_emb")
        if fn is None or fn is _rotary or id(namespace) in found:
            continue
        code = getattr(_plain_function(fn), "__code__", None)
        if code is not None and (code.co_code, code.co_names) == (ref.co_code, ref.co_names):
            found[id(namespace)] = namespace
    return list(found.values())


def _swiglu_forward(mlp: Any, kernels: Kernels) -> Callable[[torch.Tensor], torch.Tensor]:
    """`down(act(gate(x)) * up(x))`, the layers called in the model's own order (hooks see them
    as before); the product is recomputed in backward from gate(x) and up(x)."""
    silu = type(mlp.act_fn).__name__ in SILU_TYPES  # forwards calling F.silu, nothing else

    def gated(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return mlp.act_fn(gate) * up

    def forward(x: torch.Tensor) -> torch.Tensor:
        gate, up = mlp.gate_proj(x), mlp.up_proj(x)
        if silu and gate.dtype == up.dtype and gate.shape == up.shape and torch.is_grad_enabled():
            return mlp.down_proj(_SiluGate.apply(gate, up, kernels))
        return mlp.down_proj(_recomputed(gated, gate, up))

    return forward


def _rmsnorm_forward(norm: nn.Module, kernels: Kernels) -> Callable[[torch.Tensor], torch.Tensor]:
    original = type(norm).forward
    llama_form = type(norm).__name__ in LLAMA_RMSNORM_TYPES

    def forward(x: torch.Tensor) -> torch.Tensor:
        weight = norm.weight
        frozen_fp32 = x.dtype == weight.dtype == torch.float32 and not weight.requires_grad
        if llama_form and frozen_fp32 and torch.is_grad_enabled() and x.requires_grad:
            return _FrozenRMSNorm.apply(x, x, weight, norm.variance_epsilon, kernels)
        return _recomputed(lambda h: original(norm, h), x)

    return forward


@contextmanager
def recompute_elementwise(model: nn.Module, compiled: bool = False) -> Iterator[int]:
    """Within the block, SwiGLU MLPs and upcasting RMSNorms keep only their inputs for backward,
    and Llama-form rotary embeddings run `_Rotary`.

    `compiled`: their written-out steps run as `torch.compile`d kernels (`assay.lm.elementwise`).
    Yields how many modules were switched (MLPs and norms); their own forwards, and the rotary
    function, are back on exit.
    """
    kernels = EAGER
    if compiled:
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        kernels = compiled_kernels(device.type)
    patched: list[nn.Module] = []
    rotary = [(ns, ns["apply_rotary_pos_emb"]) for ns in _llama_rotary_globals(model)]
    for namespace, _ in rotary:
        namespace["apply_rotary_pos_emb"] = _rotary
    for module in model.modules():
        if _is_swiglu_mlp(module):
            module.forward = _swiglu_forward(module, kernels)  # type: ignore[method-assign]
        elif _is_upcasting_rmsnorm(module):
            module.forward = _rmsnorm_forward(module, kernels)  # type: ignore[method-assign]
        else:
            continue
        patched.append(module)
    try:
        yield len(patched)
    finally:
        for module in patched:
            del module.forward
        for namespace, original in rotary:
            namespace["apply_rotary_pos_emb"] = original


FORCE_GQA = "TRANSFORMERS_SDPA_FORCE_GQA"  # transformers' switch for SDPA's enable_gqa


@contextmanager
def grouped_query_attention(device: torch.device) -> Iterator[bool]:
    """Within the block (on CPU), transformers' SDPA attention passes shared key/value heads to
    SDPA with `enable_gqa` instead of repeated copies. Yields whether it is on."""
    if device.type != "cpu" or FORCE_GQA in os.environ:  # CUDA's masked GQA falls back to slow math
        yield False
        return
    os.environ[FORCE_GQA] = "1"
    try:
        yield True
    finally:
        os.environ.pop(FORCE_GQA, None)
