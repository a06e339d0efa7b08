"""Leaving the padding mask out (assay.lm.padding): the same losses and gradients as with it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from assay.attribution.collector import GradientCollector, linear_modules
from assay.attribution.projection import Projector
from assay.core.precision import PrecisionPolicy
from assay.lm import padding
from assay.lm.data import collate
from assay.lm.hooks import capture_output
from assay.lm.losses import example_losses, token_losses
from tests.helpers import FP32, autograd_grads, random_examples, rel_err, tiny_gpt2, tiny_llama

LENGTHS = [7, 19, 12, 3, 16]


def masked_losses(model, batch) -> torch.Tensor:
    """The reference: the model given its padding mask, full logits, fp32 cross-entropy."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return token_losses(logits, batch["labels"]).sum(dim=1)


def test_mask_left_out_only_for_right_padded_batches_of_known_causal_models():
    model = tiny_llama()
    batch = collate(random_examples(LENGTHS), np.arange(5), pad_id=0)
    assert not padding.mask_needed(model, batch["attention_mask"])
    inputs = padding.forward_inputs(model, batch["input_ids"], batch["attention_mask"])
    assert inputs.keys() == {"input_ids", "use_cache"} and inputs["use_cache"] is False
    left = batch["attention_mask"].flip(1)  # left padding: real tokens would see the padding
    assert padding.mask_needed(model, left)
    model.config.model_type = "some_new_model"  # unknown forwards keep their mask
    assert padding.mask_needed(model, batch["attention_mask"])
    assert not padding.mask_needed(model, None)


@pytest.mark.parametrize("make", [tiny_llama, tiny_gpt2], ids=["llama-gqa", "gpt2"])
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_losses_without_the_mask_equal_the_masked_ones(make, attention):
    model = make()
    model.config._attn_implementation = attention
    examples = random_examples(LENGTHS, loss_start=[1, 5, 1, 2, 3])
    batch = collate(examples, np.arange(5), pad_id=0, pad_to=32)
    with torch.no_grad():
        got, ref = example_losses(model, batch), masked_losses(model, batch)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_collected_gradients_of_a_padded_batch_equal_autograd_alone(precision):
    """Per-example gradients from one right-padded batch (no mask passed) against each example's
    own autograd `.grad` without any padding, raw (p = 0), grouped-query attention included."""
    model = tiny_llama(4)
    examples = random_examples(LENGTHS, seed=4)
    policy = FP32 if precision == "fp32" else PrecisionPolicy.resolve("bf16", "cpu")
    modules = linear_modules(model)
    batch = collate(examples, np.arange(5), pad_id=0, pad_to=40)
    with GradientCollector(model, modules, Projector(0), policy) as col:
        grads, _ = col.gradients(batch, example_losses)
    if precision == "bf16":  # autocast's reference: the same batch with its mask, through autograd
        refs = masked_autocast_grads(model, examples, list(modules), policy)
        tol = 2e-2
    else:
        refs, tol = autograd_grads(model, examples, list(modules)), 1e-5
    for i, ref in enumerate(refs):
        for s in col.slots:
            assert rel_err(grads[i, s.start : s.stop], ref[s.name].flatten()) <= tol, (i, s.name)


def masked_autocast_grads(model, examples, names, policy) -> list[dict[str, torch.Tensor]]:
    refs = []
    for i in range(len(examples)):
        batch = collate(examples, np.array([i]), pad_id=0, pad_to=40)
        model.zero_grad(set_to_none=True)
        with policy.autocast():
            loss = masked_losses(model, batch).sum()
        loss.backward()
        refs.append({n: model.get_submodule(n).weight.grad.detach().clone() for n in names})
    return refs


def test_no_key_value_cache_is_built_for_the_loss(monkeypatch):
    """transformers copies every layer's keys and values into a cache unless told not to."""
    import transformers.models.llama.modeling_llama as llama

    built = []

    class CountingCache(llama.DynamicCache):
        def __init__(self, *args, **kwargs):
            built.append(1)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(llama, "DynamicCache", CountingCache)
    model = tiny_llama(6)
    batch = collate(random_examples(LENGTHS, seed=6), np.arange(5), pad_id=0)
    with torch.no_grad():
        model(input_ids=batch["input_ids"])
        assert built == [1]  # the default builds one
        with_cache = masked_losses(model, batch)
        without = example_losses(model, batch)
    assert len(built) == 2  # example_losses built none
    torch.testing.assert_close(without, with_cache, rtol=1e-5, atol=1e-5)


def test_capture_output_real_tokens_unchanged_without_the_mask():
    model = tiny_llama(5)
    batch = collate(random_examples(LENGTHS, seed=5), np.arange(5), pad_id=0)
    mask = batch["attention_mask"].bool()
    with torch.no_grad():
        got = capture_output(model, "model.layers.0", batch["input_ids"], batch["attention_mask"])
        ref = model(**batch, output_hidden_states=True).hidden_states[1]  # after layer 0
    torch.testing.assert_close(got[mask], ref[mask], rtol=1e-5, atol=1e-5)
