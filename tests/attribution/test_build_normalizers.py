"""Normalizers: factored Adafactor and full Adam against explicit g ⊘ sqrt(V); loading; fp32 always."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from assay.attribution.collector import GradientCollector, linear_modules
from assay.attribution.normalizers import (
    ADAM_EPS,
    Normalizer,
    estimate_normalizer,
    load_optimizer_state,
)
from assay.attribution.projection import Projector
from assay.core.precision import PrecisionPolicy
from assay.lm.data import collate
from assay.lm.losses import example_losses, token_losses
from tests.helpers import FP32, autograd_grads, random_examples, rel_err, tiny_gpt2, tiny_llama

BF16 = PrecisionPolicy.resolve("bf16", "cpu")


def _random_normalizer(kind, modules, seed=0) -> Normalizer:
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, m in modules.items():
        out_f, in_f = (
            (m.weight.shape[1], m.weight.shape[0]) if "Conv1D" in type(m).__name__ else m.weight.shape
        )
        if kind == "adam":
            tensors[name] = torch.rand(out_f, in_f, generator=gen) + 0.1
        else:
            tensors[f"{name}.row"] = torch.rand(out_f, generator=gen) + 0.1
            tensors[f"{name}.col"] = torch.rand(in_f, generator=gen) + 0.1
    return Normalizer(kind, tensors)


def _explicit_v(norm: Normalizer, name: str) -> torch.Tensor:
    """V [out, in] as the optimizer defines it (Adafactor: row ⊗ col / mean(row))."""
    if norm.kind == "adam":
        return norm.tensors[name]
    row, col = norm.tensors[f"{name}.row"], norm.tensors[f"{name}.col"]
    return torch.outer(row, col) / row.mean()


@pytest.mark.parametrize("kind", ["adafactor", "adam"])
@pytest.mark.parametrize("make", [tiny_llama, tiny_gpt2])
@pytest.mark.parametrize("p", [0, 4])
def test_normalized_gradients_equal_explicit_division(kind, make, p):
    model = make(4)
    modules = linear_modules(model)
    norm = _random_normalizer(kind, modules)
    examples = random_examples([8, 15, 4], seed=4)
    projector = Projector(p, seed=1)
    batch = collate(examples, np.arange(3), pad_id=0)
    with GradientCollector(model, modules, projector, FP32, norm) as col:
        grads, _ = col.gradients(batch, example_losses)
    refs = autograd_grads(model, examples, list(modules))
    for i, ref in enumerate(refs):
        for s in col.slots:
            g = ref[s.name].T if s.conv1d else ref[s.name]  # [out, in]
            v = _explicit_v(norm, s.name)
            g = g / (v.sqrt() + ADAM_EPS) if kind == "adam" else g / v.sqrt()
            if p:
                g = projector.project_full(s.name, g)
            elif s.conv1d:
                g = g.T  # raw slices keep Conv1D's own (in, out) layout
            assert rel_err(grads[i, s.start : s.stop], g.flatten()) <= 1e-5, (i, s.name)


def _train_adam(model, steps=3, hf_groups=False):
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if hf_groups:  # the Hugging Face Trainer's split: decayed matrices first, then the rest
        decay = [p for n, p in params if p.ndim >= 2 and "norm" not in n]
        rest = [p for n, p in params if not (p.ndim >= 2 and "norm" not in n)]
        groups = [{"params": decay, "weight_decay": 0.01}, {"params": rest, "weight_decay": 0.0}]
    else:
        groups = [{"params": [p for _, p in params]}]
    opt = torch.optim.AdamW(groups, lr=1e-3, betas=(0.9, 0.99))
    batch = collate(random_examples([10, 7], seed=9), np.arange(2), pad_id=0)
    for _ in range(steps):
        opt.zero_grad()
        example_losses(model, batch).sum().backward()
        opt.step()
    return opt


@pytest.mark.parametrize("hf_groups", [False, True])
def test_loads_torch_optimizer_pt_safely(tmp_path, hf_groups):
    model = tiny_llama(5)
    opt = _train_adam(model, hf_groups=hf_groups)
    path = tmp_path / "optimizer.pt"
    torch.save(opt.state_dict(), path)
    modules = linear_modules(model)
    adam = load_optimizer_state(path, "adam", model, modules)
    factored = load_optimizer_state(path, "adafactor", model, modules)
    for name, m in modules.items():
        v = opt.state[m.weight]["exp_avg_sq"] / (1 - 0.99**3)  # bias-corrected, as Adam divides by
        torch.testing.assert_close(adam.tensors[name], v)
        torch.testing.assert_close(factored.tensors[f"{name}.row"], v.mean(dim=1))
        assert adam.tensors[name].dtype == torch.float32


def test_loads_assay_finetune_state(tmp_path):
    model = tiny_llama(6)
    modules = linear_modules(model)
    v = {f"{n}.weight.exp_avg_sq": torch.rand_like(m.weight) for n, m in modules.items()}
    meta = {"format": "assay-adam-v1", "step": "10", "beta2": "0.999"}
    save_file(v, str(tmp_path / "optimizer_state.safetensors"), metadata=meta)
    norm = load_optimizer_state(tmp_path, "adam", model, modules)  # the finetune run folder
    name = next(iter(modules))
    torch.testing.assert_close(norm.tensors[name], v[f"{name}.weight.exp_avg_sq"] / (1 - 0.999**10))


def test_mismatched_optimizer_state_is_a_clear_error(tmp_path):
    opt = _train_adam(tiny_llama(5))
    torch.save(opt.state_dict(), tmp_path / "o.pt")
    gpt = tiny_gpt2()
    with pytest.raises(Exception, match="do not line up"):
        load_optimizer_state(tmp_path / "o.pt", "adam", gpt, linear_modules(gpt))


def test_estimate_is_the_optimizer_update_and_stays_fp32():
    model = tiny_llama(7)
    modules = linear_modules(model)
    examples = random_examples([9, 12], seed=7)
    est = estimate_normalizer("adam", model, modules, examples, FP32, pad_id=0, token_batch_size=4096)
    # one step: bias-corrected v̂ = g² of the token-mean loss over the batch
    batch = collate(examples, np.arange(2), pad_id=0)
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    loss = token_losses(logits, batch["labels"]).sum() / (batch["labels"][:, 1:] != -100).sum()
    model.zero_grad()
    loss.backward()
    for name, m in modules.items():
        ref = m.weight.grad.square()
        assert float((est.tensors[name] - ref).norm() / ref.norm()) < 1e-5, name  # fp32 rounding
    bf = estimate_normalizer("adafactor", model, modules, examples, BF16, pad_id=0, token_batch_size=4096)
    assert all(t.dtype == torch.float32 for t in bf.tensors.values())
    assert all(p.grad is None for p in model.parameters())


def test_tensors_stay_fp32_inside_and_after_autocast():
    model = tiny_llama(8)
    modules = linear_modules(model)
    norm = _random_normalizer("adafactor", modules)
    batch = collate(random_examples([6, 11], seed=8), np.arange(2), pad_id=0)
    seen = []

    def objective(m, b):
        seen.append(torch.is_autocast_enabled("cpu"))  # the forward does run under autocast
        return example_losses(m, b)

    with GradientCollector(model, modules, Projector(4), BF16, norm) as col:
        grads, losses = col.gradients(batch, objective)
        assert all(t is None or t.dtype == torch.float32 for t in col._mats.values())
    assert seen == [True] and grads.dtype == torch.float32 and losses.dtype == torch.float32
    assert all(t.dtype == torch.float32 for t in norm.tensors.values())
    assert all(p.dtype == torch.float32 for p in model.parameters())  # fp32 master weights kept
