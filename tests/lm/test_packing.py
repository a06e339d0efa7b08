"""Packed, padding-free batches (assay.lm.packing): the same losses and gradients as padded ones."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from assay.attribution.collector import GradientCollector, linear_modules
from assay.attribution.projection import Projector
from assay.core.precision import PrecisionPolicy
from assay.lm import packing
from assay.lm.data import collate
from assay.lm.losses import example_losses
from tests.helpers import (
    FP32,
    LLAMA_DEFAULTS,
    autograd_grads,
    random_examples,
    rel_err,
    tiny_gpt2,
    tiny_llama,
)

LENGTHS = [7, 19, 12, 3, 16]
LOSS_START = [1, 5, 1, 2, 3]


def tiny_qwen(kind: str, seed: int = 0):
    import transformers

    torch.manual_seed(seed)
    name = {"qwen2": "Qwen2", "qwen3": "Qwen3"}[kind]
    config = getattr(transformers, f"{name}Config")(**LLAMA_DEFAULTS, head_dim=8)
    return getattr(transformers, f"{name}ForCausalLM")(config).eval()


MODELS = {
    "llama-gqa": tiny_llama,
    "qwen2": lambda seed=0: tiny_qwen("qwen2", seed),
    "qwen3": lambda seed=0: tiny_qwen("qwen3", seed),
}


def both_layouts(examples, positions=None):
    positions = np.arange(len(examples)) if positions is None else positions
    return collate(examples, positions, pad_id=0), packing.pack(examples, positions)


def test_pack_layout():
    examples = random_examples([3, 4], loss_start=[1, 2])
    batch = packing.pack(examples, np.array([1, 0]))
    row = packing.ROW_MULTIPLE  # 7 example tokens, then filler
    assert batch["input_ids"].shape == (1, row)
    assert batch["position_ids"][0, :7].tolist() == [0, 1, 2, 3, 0, 1, 2]
    assert batch["position_ids"][0, 7:].tolist() == list(range(row - 7))
    assert batch["attention_mask"].sum() == 7 and batch["attention_mask"][0, :7].all()
    assert batch["segment_lengths"].tolist() == [4, 3]
    labels = batch["labels"][0].tolist()
    assert labels[:2] == [-100, -100] and labels[4] == -100  # before loss_start; each first token
    assert labels[2:4] == examples.tokens_of(1)[2:].tolist()
    assert labels[5:7] == examples.tokens_of(0)[1:].tolist() and set(labels[7:]) == {-100}
    assert packing.token_examples(batch)[0, :7].tolist() == [0, 0, 0, 0, 1, 1, 1]
    repad = packing.Repadding.of(batch["segment_lengths"])
    x = torch.arange(float(row))[None, :, None]
    assert repad(x)[:, :4, 0].tolist() == [[0, 1, 2, 3], [4, 5, 6, 0]] and not repad(x)[:, 4:].any()
    heads = repad.heads(x[:, None].expand(1, 2, row, 1))  # [B, heads, width, 1]
    back = repad.unpad_heads(heads, row)
    assert back[:7, 0, 0].tolist() == list(range(7)) and not back[7:].any()


def test_repadding_keeps_only_indices_for_backward():
    """Attention's copies into the padded layout keep no queries, keys or values alive until
    backward (SDPA keeps its own padded inputs): only integer indices are saved, and the
    gradient still reaches every packed token."""
    repad = packing.Repadding.of(torch.tensor([4, 3]))
    x = torch.randn(1, 2, packing.ROW_MULTIPLE, 8, requires_grad=True)
    saved: list[torch.dtype] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.dtype) or t, lambda t: t):
        padded = repad.heads(x * 1)
    assert saved and all(not dtype.is_floating_point for dtype in saved)
    padded.sum().backward()
    assert x.grad is not None
    assert (x.grad[0, :, :7] == 1).all() and not x.grad[0, :, 7:].any()


def test_only_full_attention_models_of_known_types_pack():
    assert packing.packable(tiny_llama()) and packing.packable(MODELS["qwen3"]())
    assert not packing.packable(tiny_gpt2())  # positions are not read from position_ids there
    model = tiny_llama()
    model.config._attn_implementation = "flex_attention"
    assert not packing.packable(model)
    sliding = MODELS["qwen2"]()
    sliding.config.use_sliding_window = True
    assert not packing.packable(sliding)


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_packed_losses_equal_padded_ones(name, attention):
    model = MODELS[name]()
    model.config._attn_implementation = attention
    padded, packed = both_layouts(random_examples(LENGTHS, loss_start=LOSS_START))
    with torch.no_grad():
        got, ref = example_losses(model, packed), example_losses(model, padded)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    assert model.config._attn_implementation == attention  # restored after the forward


@pytest.mark.parametrize("name", list(MODELS))
def test_packed_gradients_equal_autograd_on_each_example_alone(name):
    """Raw (p = 0) per-example gradients from one packed row against `.grad` of each example
    alone, grouped-query attention included; the head too (its loss then takes the plain path)."""
    model = MODELS[name](3)
    examples = random_examples(LENGTHS, seed=3, loss_start=LOSS_START)
    modules = linear_modules(model, ("*",))
    with GradientCollector(model, modules, Projector(0), FP32) as col:
        grads, losses = col.gradients(packing.pack(examples, np.arange(5)), example_losses)
    refs = autograd_grads(model, examples, list(modules))
    for i, ref in enumerate(refs):
        for s in col.slots:
            assert rel_err(grads[i, s.start : s.stop], ref[s.name].flatten()) <= 1e-5, (i, s.name)


def test_packed_lora_adapter_gradients_equal_autograd_alone():
    """A PEFT-wrapped model passes position_ids and the layout through to its base model."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny_llama(4), LoraConfig(r=4, target_modules=["q_proj", "v_proj", "down_proj"]))
    for n, p in model.named_parameters():  # non-zero lora_B: both sides carry gradient
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.1)
    assert packing.packable(model)
    examples = random_examples(LENGTHS, seed=4, loss_start=LOSS_START)
    modules = linear_modules(model)
    with GradientCollector(model, modules, Projector(0), FP32) as col:
        grads, _ = col.gradients(packing.pack(examples, np.arange(5)), example_losses)
    for i, ref in enumerate(autograd_grads(model, examples, list(modules))):
        for s in col.slots:
            assert rel_err(grads[i, s.start : s.stop], ref[s.name].flatten()) <= 1e-5, (i, s.name)


@pytest.mark.parametrize("precision,tol", [("fp32", 1e-5), ("bf16", 1e-2)])
def test_packed_rows_equal_padded_rows(precision, tol):
    """Projected rows through the chunked head loss, with the batch in a shuffled order."""
    model = tiny_llama(2)
    policy = FP32 if precision == "fp32" else PrecisionPolicy.resolve("bf16", "cpu")
    examples = random_examples(LENGTHS, seed=2, loss_start=LOSS_START)
    padded, packed = both_layouts(examples, np.array([3, 0, 4, 1, 2]))
    modules = linear_modules(model)
    with GradientCollector(model, modules, Projector(8, seed=1), policy) as col:
        ref, ref_losses = col.gradients(padded, example_losses)
        got, losses = col.gradients(packed, example_losses)
    torch.testing.assert_close(losses, ref_losses, rtol=tol, atol=tol)
    for i in range(len(LENGTHS)):
        assert rel_err(got[i], ref[i]) <= tol, i


def test_a_batch_is_packed_when_that_saves_enough_padding(monkeypatch):
    examples = random_examples([100, 100, 20, 300])
    monkeypatch.setattr(packing, "ROW_MULTIPLE", 64)
    assert packing.saves_padding(examples, np.array([0, 2]))  # a row of 128 for 2 x 112 padded
    assert not packing.saves_padding(examples, np.array([0, 1]))  # 256 for 2 x 112
    assert not packing.saves_padding(examples, np.array([3]))  # 320 for 320: nothing saved


def test_the_collection_loop_packs_only_the_language_model_loss_of_packable_models(monkeypatch):
    """`iter_gradients` packs Llama batches for the default loss and yields the padded batch's
    rows; a custom objective, `packed=False` and a GPT-2 keep right-padded batches."""
    from dataclasses import replace

    from assay.attribution.build import GradientSetup, iter_gradients

    monkeypatch.setattr(packing, "ROW_MULTIPLE", 8)  # rows this short pack only with little filler
    examples = random_examples(LENGTHS, seed=7, loss_start=LOSS_START)
    batches = [np.array([0, 2, 4]), np.array([1, 3])]

    def run(setup, objective=None):
        out = list(iter_gradients(setup, examples, batches, objective))
        return [packing.is_packed(b) for *_, b in out], torch.cat([g for _, g, _, _ in out])

    def setup_of(model):
        return GradientSetup(model, None, FP32, linear_modules(model), Projector(8, seed=3), None, 0)

    llama = setup_of(tiny_llama(7))
    layouts, packed_rows = run(llama)
    assert layouts == [True, True]
    layouts, padded_rows = run(replace(llama, packed=False))
    assert layouts == [False, False]
    torch.testing.assert_close(packed_rows, padded_rows, rtol=1e-5, atol=1e-6)
    assert run(llama, example_losses)[0] == [False, False]  # an objective reads [B, T] batches
    assert run(setup_of(tiny_gpt2(7)))[0] == [False, False]
