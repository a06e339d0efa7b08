"""The collector variants the loop benchmark times beside the default (bench/variants.py) do what
their names say inside their block, and nothing after it."""

from __future__ import annotations

import torch

from assay.lm import lean
from bench.variants import norm_output_cast
from tests.helpers import tiny_llama


def _q_proj_input_dtypes(model: torch.nn.Module, on: bool) -> list[torch.dtype]:
    seen: list[torch.dtype] = []
    q_proj = model.model.layers[0].self_attn.q_proj
    handle = q_proj.register_forward_pre_hook(lambda module, args: seen.append(args[0].dtype))
    ids = torch.randint(0, 64, (2, 8))
    try:
        with lean.recompute_elementwise(model), norm_output_cast(on):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                model(ids).logits.float().sum().backward()
    finally:
        handle.remove()
    return seen


def test_norm_output_cast_hands_the_layers_one_bf16_copy_and_is_undone_after():
    model = tiny_llama(vocab_size=64)
    for p in model.parameters():
        p.requires_grad_(False)
    model.model.embed_tokens.weight.requires_grad_(True)  # so backward reaches the norms
    assert _q_proj_input_dtypes(model, on=True) == [torch.bfloat16]
    assert "apply" not in vars(lean._FrozenRMSNorm)  # the inherited apply is back
    assert _q_proj_input_dtypes(model, on=False) == [torch.float32]
