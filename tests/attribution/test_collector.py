"""The hook collector against independent references: autograd and the explicit projection."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from assay.attribution.collector import GradientCollector, linear_modules
from assay.attribution.projection import Projector, projection_matrix
from assay.lm.data import collate
from assay.lm.losses import example_losses
from tests.helpers import FP32, autograd_grads, collect_all, random_examples, rel_err, tiny_gpt2, tiny_llama


@pytest.mark.parametrize("make", [tiny_llama, tiny_gpt2])
def test_raw_hook_gradients_equal_autograd(make):
    model = make()
    examples = random_examples([7, 19, 12, 3], loss_start=[1, 5, 1, 2])
    col, grads, _ = collect_all(model, examples, np.arange(4), Projector(0))
    refs = autograd_grads(model, examples, [s.name for s in col.slots])
    assert any(s.conv1d for s in col.slots) == (make is tiny_gpt2)
    for i, ref in enumerate(refs):
        for s in col.slots:
            # raw slices are the weight's own layout flattened row-major, as `.grad` is
            got = grads[i, s.start : s.stop]
            assert rel_err(got, ref[s.name].flatten()) <= 1e-5, (i, s.name)
    assert all(p.requires_grad for p in model.parameters()), "requires_grad restored on exit"
    assert all(p.grad is not None for p in model.parameters() if p.ndim == 2)


def test_factored_projection_equals_explicit_projection():
    model = tiny_gpt2(1)
    examples = random_examples([9, 14, 5], seed=1)
    projector = Projector(8, seed=3)
    col, grads, _ = collect_all(model, examples, np.arange(3), projector)
    refs = autograd_grads(model, examples, [s.name for s in col.slots])
    for i, ref in enumerate(refs):
        for s in col.slots:
            full = ref[s.name].T if s.conv1d else ref[s.name]  # (out, in) orientation
            explicit = projection_matrix(s.name, "out", 8, s.out_features, 3) @ full
            explicit = explicit @ projection_matrix(s.name, "in", 8, s.in_features, 3).T
            assert rel_err(grads[i, s.start : s.stop], explicit.flatten()) <= 1e-5


def test_batch_size_and_padding_invariance():
    model = tiny_llama(2)
    examples = random_examples([4, 17, 9, 30, 11], seed=2)
    projector = Projector(4, seed=0)
    _, together, _ = collect_all(model, examples, np.arange(5), projector, pad_to=48)
    for i in range(5):
        _, alone, _ = collect_all(model, examples, np.array([i]), projector, pad_to=int(examples.lengths[i]))
        assert rel_err(together[i], alone[0]) <= 1e-5


def test_projection_is_deterministic_and_scaled():
    a = projection_matrix("layers.0.q_proj", "in", 16, 64, seed=5)
    assert torch.equal(a, projection_matrix("layers.0.q_proj", "in", 16, 64, seed=5))
    assert not torch.equal(a, projection_matrix("layers.0.k_proj", "in", 16, 64, seed=5))
    assert not torch.equal(a, projection_matrix("layers.0.q_proj", "out", 16, 64, seed=5))
    assert not torch.equal(a, projection_matrix("layers.0.q_proj", "in", 16, 64, seed=6))
    assert a.dtype == torch.float32 and torch.allclose(a.abs(), torch.full_like(a, 0.25))


def test_lora_only_adapter_gradients():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny_llama(3), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    for n, p in model.named_parameters():  # make lora_B non-zero so both sides carry gradient
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.1)
    modules = linear_modules(model)
    assert modules and all(".lora_A." in n or ".lora_B." in n for n in modules)
    examples = random_examples([6, 13], seed=3)
    col, grads, _ = collect_all(model, examples, np.arange(2), Projector(0))
    refs = autograd_grads(model, examples, list(modules))
    for i, ref in enumerate(refs):
        for s in col.slots:
            assert rel_err(grads[i, s.start : s.stop], ref[s.name].flatten()) <= 1e-5
    frozen = [p for n, p in model.named_parameters() if "lora_" not in n]
    assert frozen and not any(p.requires_grad for p in frozen)


def test_model_agnostic_mlp_with_custom_objective():
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
    x, y = torch.randn(6, 5), torch.randint(0, 3, (6,))

    def objective(model, batch):
        return nn.functional.cross_entropy(model(batch["x"]), batch["y"], reduction="none")

    modules = linear_modules(mlp, ())
    with GradientCollector(mlp, modules, Projector(0), FP32) as col:
        grads, _ = col.gradients({"x": x, "y": y}, objective)
    for i in range(6):
        mlp.zero_grad()
        objective(mlp, {"x": x[i : i + 1], "y": y[i : i + 1]}).sum().backward()
        ref = torch.cat([mlp[0].weight.grad.flatten(), mlp[2].weight.grad.flatten()])
        assert rel_err(grads[i], ref) <= 1e-5


def test_layers_sharing_an_input_are_projected_in_one_gemm():
    model = tiny_llama(4)
    examples = random_examples([5, 9], seed=5)
    batch = collate(examples, np.arange(2), pad_id=0)
    with GradientCollector(model, linear_modules(model), Projector(4), FP32) as col:
        col.gradients(batch, example_losses)
        groups = sorted(tuple(n.rsplit(".", 1)[-1] for n in key) for key in col._group_mats)
    assert groups == [("gate_proj", "up_proj")] * 2 + [("q_proj", "k_proj", "v_proj")] * 2
