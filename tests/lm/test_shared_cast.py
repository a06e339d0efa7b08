"""One cast per shared input changes no number: rows and losses bit for bit against the plain
path, on the model forms whose backward orders differ (rotary, biases, per-head norms)."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch

import assay.attribution.collector as collector_module
from assay.attribution.projection import Projector
from assay.core.precision import PrecisionPolicy
from assay.lm import shared_cast
from assay.lm.lean import keep_compute_casts
from assay.lm.shared_cast import shared_input_casts
from tests.helpers import LLAMA_DEFAULTS, collect_all, random_examples, tiny_llama


def tiny_qwen(family: str):
    """A 2-layer random Qwen2 (biased q/k/v) or Qwen3 (per-head q/k norms) in eval mode."""
    import transformers

    config = getattr(transformers, f"{family}Config")(**LLAMA_DEFAULTS, head_dim=8)
    torch.manual_seed(0)
    return getattr(transformers, f"{family}ForCausalLM")(config).eval()


MODELS = {"llama": tiny_llama, "qwen2": lambda: tiny_qwen("Qwen2"), "qwen3": lambda: tiny_qwen("Qwen3")}


def _rows(model, policy: PrecisionPolicy) -> tuple[torch.Tensor, torch.Tensor]:
    examples = random_examples([9, 5, 12], seed=1)
    _, grads, losses = collect_all(model, examples, np.arange(3), Projector(4, 0), policy)
    return grads, losses


@pytest.mark.parametrize("family", sorted(MODELS))
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("compute_casts", [False, True], ids=["fp32-weights", "kept-casts"])
def test_shared_casts_give_identical_gradients(family, precision, compute_casts, monkeypatch):
    model = MODELS[family]()
    policy = PrecisionPolicy.resolve(precision, "cpu")
    if compute_casts:
        keep_compute_casts(model, policy)
    calls = []
    real_apply = shared_cast._SharedCast.apply
    monkeypatch.setattr(shared_cast._SharedCast, "apply", lambda *a: calls.append(1) or real_apply(*a))
    shared = _rows(model, policy)
    # q, k, v, gate and up went through it, but for the first q, k, v: frozen embeddings, no grad
    assert len(calls) == 2 * 5 - 3
    monkeypatch.setattr(collector_module, "shared_input_casts", lambda *a: contextlib.nullcontext())
    plain = _rows(model, policy)
    assert torch.equal(shared[0], plain[0]) and torch.equal(shared[1], plain[1])


def test_the_cast_is_made_once_per_shared_input(monkeypatch):
    model = tiny_llama()
    made = []
    real_of = shared_cast._LastCast.of

    def spied(self, x, dtype):
        before = self.low
        out = real_of(self, x, dtype)
        made.append(out is not before)
        return out

    monkeypatch.setattr(shared_cast._LastCast, "of", spied)
    _rows(model, PrecisionPolicy.resolve("bf16", "cpu"))
    # per layer: q, k, v read one input (one cast), gate and up another (one cast)
    assert len(made) == 2 * 5 and sum(made) == 2 * 2


def test_an_input_changed_in_place_is_cast_again():
    layer = torch.nn.Linear(4, 3)
    x = torch.randn(2, 4)
    with shared_input_casts(layer), torch.autocast("cpu", dtype=torch.bfloat16):
        first = layer(x)
        x.mul_(2)
        second = layer(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(first, torch.nn.Linear.forward(layer, x / 2))
        assert torch.equal(second, torch.nn.Linear.forward(layer, x))


def test_shared_input_casts_leave_the_head_alone_and_restore_the_forwards():
    model = tiny_llama()
    with shared_input_casts(model) as switched:
        assert switched == 2 * 7  # q, k, v, o, gate, up, down per layer; not lm_head
        assert "forward" not in vars(model.lm_head)
        assert "forward" in vars(model.model.layers[0].self_attn.q_proj)
    assert "forward" not in vars(model.model.layers[0].self_attn.q_proj)
