"""The padding mask a forward pass can leave out, exactly.

assay's batches are right-padded (`assay.lm.data.collate`). In a causal language model a token
attends only to itself and the tokens before it, so a real token never sees the padding to its
right: its output, its loss and every gradient reaching it are the same with or without the
padding mask. Padded positions then attend to the real tokens before them, which changes only
their own outputs, and those carry no loss (labels -100) and feed no real token.

Given no mask, transformers builds none and calls SDPA with `is_causal` (its flash kernel on CPU
and CUDA; shared key/value heads passed as they are, `enable_gqa`); given one it first builds a
[B, 1, T, T] boolean mask and SDPA takes its masked path. On a 2-core AMD EPYC that was the
largest part of the gap between `assay build`'s loop and bergson's, which passes no mask
(docs/BENCHMARKS.md, "AMD EPYC").

Only model types known to use the mask for nothing else qualify (`MASK_FREE_MODEL_TYPES`: a
model that derives positions from the mask, routes tokens with capacity limits, or attends
bidirectionally somewhere would differ); anything else, and any batch not right-padded, keeps it.

The same forward needs no key/value cache, which transformers builds by default (`use_cache` in
the config): every layer's keys and values copied into it, held to the end of the forward.
"""

from __future__ import annotations

from typing import Any

import torch

# Causal text decoders whose forward reads attention_mask only to hide padding: positions come
# from cache_position (0..T-1, what right padding gives real tokens with the mask too).
MASK_FREE_MODEL_TYPES = frozenset(
    {
        "llama",
        "mistral",
        "mixtral",
        "qwen2",
        "qwen3",
        "gpt2",
        "gpt_neox",
        "olmo",
        "olmo2",
        "phi3",
        "gemma",
        "smollm3",
    }
)


def right_padded(attention_mask: torch.Tensor) -> bool:
    """Whether every row of a [B, T] 0/1 mask is ones then zeros (no real token after padding)."""
    return attention_mask.dim() == 2 and bool((attention_mask[:, 1:] <= attention_mask[:, :-1]).all())


def mask_needed(model: Any, attention_mask: torch.Tensor | None) -> bool:
    """False when leaving `attention_mask` out changes no real token's output (see the module)."""
    if attention_mask is None:
        return False
    config = getattr(model, "config", None)
    if getattr(config, "model_type", None) not in MASK_FREE_MODEL_TYPES:
        return True
    if getattr(config, "is_encoder_decoder", False) or not getattr(config, "is_causal", True):
        return True
    return not right_padded(attention_mask)


def forward_inputs(
    model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor | None
) -> dict[str, Any]:
    """Keyword inputs of one forward over a padded batch: input_ids, the mask where it is needed,
    and no key/value cache where the model keeps one by default (transformers would copy every
    layer's keys and values into it, for a forward that never decodes)."""
    inputs: dict[str, Any] = {"input_ids": input_ids}
    if mask_needed(model, attention_mask):
        inputs["attention_mask"] = attention_mask
    if getattr(getattr(model, "config", None), "use_cache", False):
        inputs["use_cache"] = False
    return inputs
