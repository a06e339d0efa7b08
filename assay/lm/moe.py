"""Mixture-of-experts layers as linear layers that gradient hooks can see.

transformers 5 keeps every expert of an MoE layer in two fused 3-D parameters (`gate_up_proj`
[E, 2I, H] and `down_proj` [E, H, I]) used through `F.linear` in one loop, so no `nn.Linear`
holds an expert and per-layer hooks skip the experts, most of such a model's weights.
`expose_experts` gives each expert's two projections an `ExpertLinear` (weight: a view of the
fused parameter's slice, so parameters and state dict are unchanged) and runs the experts'
loop through them. Each is called on a [B, T, ·] tensor that holds its routed tokens' inputs
and zeros elsewhere, and its output rows for the other tokens are constant zeros, so a hook's
per-example Σ_t g_t a_tᵀ counts exactly the tokens the router sent to that expert.

Only the experts' loop that 58 of transformers' MoE families share (Mixtral, Qwen2/3-MoE,
OLMoE, DeepSeek-V2/V3, GLM-4-MoE, Granite-MoE, Phi-MoE, ...) is rewritten, and each rewrite is
checked against the module's own forward on random tokens before it is used; other expert
layouts (transposed, with biases, custom activations: gpt-oss, Llama 4) are left as they are
and reported by `uncovered_experts`. Routers stay uncollected, like biases and norms.
"""

from __future__ import annotations

import types
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from assay.lm.shapes import compute_dtype, kernel_rows

FUSED = ("gate_up_proj", "down_proj")
VIEWS = {"gate_up_proj": "gate_up", "down_proj": "down"}  # the views' module names, per expert
BATCH_SHAPE = "_assay_batch_shape"  # set on the experts module by its parent's pre-hook


class ExpertLinear(nn.Module):
    """One expert's projection, a slice of a fused [E, out, in] parameter, as a linear layer."""

    def __init__(self, experts: nn.Module, fused: str, index: int):
        super().__init__()
        self.__dict__["_experts"] = experts  # not a child: named_modules() must not loop back
        self.fused, self.index = fused, index

    @property
    def weight(self) -> torch.Tensor:
        """[out, in]: a view of the fused parameter's slice (gradients reach the parameter)."""
        return getattr(self._experts, self.fused)[self.index]

    @property
    def trainable(self) -> bool:
        """Whether the fused parameter is trained (a view made under no_grad never requires grad)."""
        return bool(getattr(self._experts, self.fused).requires_grad)

    def forward(self, x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """[B, T, in] (zeros outside `rows`, the flat indices of the routed tokens) -> [B, T, out],
        computed for the routed rows only and zero elsewhere."""
        flat = x.reshape(-1, x.shape[-1])
        picked = F.linear(flat[_bucketed(rows, x)], self.weight)[: len(rows)]
        return _only_rows(picked, rows, flat.shape[0]).view(*x.shape[:-1], -1)


def _bucketed(rows: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """`rows`, padded with copies of its first row to a count of few distinct sizes
    (`assay.lm.shapes`; the padded rows' outputs are dropped): each expert's routed-token count
    differs in every layer and batch, and unpadded, bf16 collection of a random Mixtral kept
    hundreds of MB of oneDNN kernels and compiled one on most calls."""
    padded = kernel_rows(len(rows), compute_dtype(x), x.device)
    return torch.cat([rows, rows[:1].expand(padded - len(rows))]) if padded > len(rows) else rows


def expose_experts(model: nn.Module) -> int:
    """Give every shared-layout experts module of `model` its ExpertLinear views (children named
    `gate_up.E` and `down.E`, E the expert) and the loop that uses them; returns how many modules
    it rewrote. Idempotent; a module whose rewrite does not reproduce its output is left alone."""
    done = 0
    for name, module in list(model.named_modules()):
        if getattr(module, "_assay_views", False):
            done += 1
        elif _shared_layout(module) and _reproduces(module):
            _rewrite(module, _parent(model, name))
            done += 1
    return done


def uncovered_experts(model: nn.Module) -> list[str]:
    """Trainable fused 3-D parameters (experts) that no ExpertLinear covers."""
    covered = {id(m) for m in model.modules() if getattr(m, "_assay_views", False)}
    owners = {id(m): n for n, m in model.named_modules()}
    found = []
    for module in model.modules():
        for pname, p in module.named_parameters(recurse=False):
            if p.dim() == 3 and p.requires_grad and id(module) not in covered:
                found.append(f"{owners[id(module)]}.{pname}")
    return found


def exposed_fused_weights(model: nn.Module) -> list[nn.Parameter]:
    """The fused parameters of every experts module `expose_experts` rewrote: their loop is ours
    (F.linear per expert), so autocast treats them as it treats a linear layer's weight."""
    return [
        getattr(module, fused)
        for module in model.modules()
        if getattr(module, "_assay_views", False)
        for fused in FUSED
    ]


def _shared_layout(module: nn.Module) -> bool:
    """Experts in the Mixtral layout: gate_up [E, 2I, H], down [E, H, I], an act_fn, no biases."""
    gate_up, down = (getattr(module, n, None) for n in FUSED)
    if not (isinstance(gate_up, nn.Parameter) and isinstance(down, nn.Parameter)):
        return False
    if gate_up.dim() != 3 or down.dim() != 3 or getattr(module, "is_transposed", False):
        return False
    e, two_i, h = gate_up.shape
    biased = any(isinstance(getattr(module, f"{n}_bias", None), torch.Tensor) for n in FUSED)
    return not biased and hasattr(module, "act_fn") and tuple(down.shape) == (e, h, two_i // 2)


def _reproduces(module: nn.Module) -> bool:
    """Whether the rewritten loop gives the module's own output on random tokens and routes."""
    param: torch.Tensor = getattr(module, FUSED[0])
    e, _, h = (int(d) for d in param.shape)
    gen = torch.Generator().manual_seed(0)
    index = torch.stack([torch.randperm(e, generator=gen)[: min(2, e)] for _ in range(6)])
    views = [[ExpertLinear(module, f, i) for i in range(e)] for f in FUSED]
    tol = 1e-4 if param.dtype == torch.float32 else 2e-2
    try:
        x = torch.randn(6, h, generator=gen).to(param.device, param.dtype)
        weights = torch.rand(*index.shape, generator=gen).to(param.device, param.dtype)
        index = index.to(param.device)
        with torch.no_grad():
            own = module(x, index, weights)
            ours = _experts_forward(module, views, (1, 6), x, index, weights)
        return bool(torch.allclose(own, ours, rtol=tol, atol=tol * 0.1))
    except Exception:  # another forward (signature, sharded weights): not rewritten, reported
        return False


def _rewrite(module: nn.Module, parent: nn.Module) -> None:
    e = int(getattr(module, FUSED[0]).shape[0])
    views = []
    for fused in FUSED:
        group = nn.Module()
        for i in range(e):
            group.add_module(str(i), ExpertLinear(module, fused, i))
        module.add_module(VIEWS[fused], group)
        views.append([getattr(group, str(i)) for i in range(e)])

    def record_shape(_: nn.Module, args: tuple, kwargs: dict) -> None:
        hidden = args[0] if args else kwargs.get("hidden_states")
        if isinstance(hidden, torch.Tensor):
            setattr(module, BATCH_SHAPE, tuple(hidden.shape[:-1]))

    parent.register_forward_pre_hook(record_shape, with_kwargs=True)

    def forward(
        self: nn.Module, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        shape = getattr(self, BATCH_SHAPE, (1, hidden.shape[0]))
        if shape[0] * shape[-1] != hidden.shape[0] or len(shape) != 2:
            shape = (1, hidden.shape[0])  # called on its own, not from its block: one row
        return _experts_forward(self, views, shape, hidden, top_k_index, top_k_weights)

    module.forward = types.MethodType(forward, module)  # type: ignore[method-assign]
    module._assay_views = True  # type: ignore[assignment]


def _experts_forward(
    experts: nn.Module,
    views: list[list[ExpertLinear]],
    shape: tuple[int, ...],
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    """The experts' loop (transformers' eager one) through the views: hidden [N, H] with N = B·T,
    each expert's inputs laid out as [B, T, ·] with zeros on the tokens it was not sent."""
    b, t = int(shape[0]), int(shape[-1])
    final = torch.zeros_like(hidden)
    act: Any = experts.act_fn
    for e, (gate_up, down) in enumerate(zip(*views)):
        token_idx, pos = torch.where(top_k_index == e)
        if len(token_idx) == 0:
            continue
        x = _only(hidden, token_idx).view(b, t, -1)
        gate, up = gate_up(x, token_idx).view(b * t, -1)[token_idx].chunk(2, dim=-1)
        inner = _only_rows(act(gate) * up, token_idx, b * t).view(b, t, -1)
        out = down(inner, token_idx).view(b * t, -1)[token_idx]
        out = out * top_k_weights[token_idx, pos, None]
        final.index_put_((token_idx,), out.to(final.dtype), accumulate=True)  # see _only_rows
    return final


def _only(flat: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """[N, f] with the rows outside `rows` zeroed (differentiable in the kept rows)."""
    return _only_rows(flat[rows], rows, flat.shape[0])


def _only_rows(values: torch.Tensor, rows: torch.Tensor, n: int) -> torch.Tensor:
    """[n, f]: `values` at `rows` (distinct), zeros elsewhere. index_put_, not index_copy:
    autograd keeps only the indices, where index_copy (and index_add) keep the rows themselves,
    copies of every expert's routed rows until backward."""
    return values.new_zeros(n, values.shape[-1]).index_put_((rows,), values)


def _parent(model: nn.Module, name: str) -> nn.Module:
    return model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
