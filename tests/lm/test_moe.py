"""Mixture-of-experts layers (`assay.lm.moe`): the experts' fused weights collected per expert,
checked against autograd on the model's own forward, and the model left as it computes."""

from __future__ import annotations

import copy
import logging

import numpy as np
import pytest
import torch

from assay.attribution.collector import linear_modules
from assay.attribution.kfac_fit import FactorCollector
from assay.attribution.projection import Projector, projection_matrix
from assay.core.precision import PrecisionPolicy
from assay.lm.data import collate
from assay.lm.lean import keep_compute_casts
from assay.lm.losses import example_losses
from assay.lm.moe import ExpertLinear, _bucketed, expose_experts, uncovered_experts
from tests.helpers import FP32, collect_all, random_examples, rel_err, tiny_moe


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe", "olmoe"])
def test_views_leave_the_model_computing_as_before(kind):
    model = tiny_moe(kind)
    before = copy.deepcopy(model)
    assert expose_experts(model) == 2 and expose_experts(model) == 2  # once per layer, idempotent
    assert list(model.state_dict()) == list(before.state_dict())
    assert uncovered_experts(model) == [] and len(uncovered_experts(before)) == 4
    ids = torch.randint(1, 128, (3, 13))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before(ids).logits)


def reference(model: torch.nn.Module, examples, names: list[str]) -> list[dict[str, torch.Tensor]]:
    """Each example alone through the model's own experts loop: autograd's `.grad` of every
    weight, an expert's being its slice of the fused parameter."""
    params = dict(model.named_parameters())
    refs = []
    for i in range(len(examples)):
        batch = collate(examples, np.array([i]), pad_id=0, pad_to=int(examples.lengths[i]))
        model.zero_grad(set_to_none=True)
        example_losses(model, batch).sum().backward()
        grads = {}
        for name in names:
            head, _, index = name.rpartition(".")
            if ".experts." in name:  # experts.gate_up.3 -> experts.gate_up_proj[3]
                fused = head.replace(".gate_up", ".gate_up_proj").replace(".down", ".down_proj")
                grads[name] = params[fused].grad[int(index)].clone()
            else:
                grads[name] = params[f"{name}.weight"].grad.clone()
        refs.append(grads)
    return refs


@pytest.mark.parametrize("kind, p", [("mixtral", 0), ("qwen3_moe", 0), ("mixtral", 8)])
def test_expert_gradients_equal_autograd(kind, p):
    """Raw rows against autograd; projected ones (each expert's routed rows projected alone)
    against the explicit projection of autograd's gradient."""
    model = tiny_moe(kind, seed=1)
    own = copy.deepcopy(model)
    examples = random_examples([7, 19, 12], seed=1, loss_start=[1, 5, 2])
    col, grads, _ = collect_all(model, examples, np.arange(3), Projector(p, seed=3))  # padded batch
    names = [s.name for s in col.slots]
    assert sum(".experts.gate_up." in n for n in names) == sum(".experts.down." in n for n in names) == 8
    silent = 0
    for i, ref in enumerate(reference(own, examples, names)):
        for s in col.slots:
            want = ref[s.name]
            if p:
                want = projection_matrix(s.name, "out", p, s.out_features, 3) @ want
                want = want @ projection_matrix(s.name, "in", p, s.in_features, 3).T
            assert rel_err(grads[i, s.start : s.stop], want.flatten()) <= 1e-5, (i, s.name)
            silent += int(not ref[s.name].any())  # an expert none of the example's tokens reached
    assert silent < len(names)  # the comparison is not of zeros
    assert all(p.requires_grad for p in model.parameters()), "requires_grad restored on exit"


def test_an_experts_factors_are_over_its_own_tokens():
    model = tiny_moe("mixtral", seed=2)
    modules = linear_modules(model)
    examples = random_examples([9, 5], seed=2)
    batch = collate(examples, np.arange(2), pad_id=0)
    routes = []
    gate = model.model.layers[0].mlp.experts
    handle = gate.register_forward_pre_hook(lambda _, args: routes.append(args[1]))
    with FactorCollector(model, modules, FP32) as factors:
        factors.step(batch, example_losses)
    handle.remove()
    unpadded = batch["attention_mask"].reshape(-1).bool()
    for e in range(4):
        sent = int(((routes[0] == e).any(dim=1) & unpadded).sum())
        name = f"model.layers.0.mlp.experts.gate_up.{e}"
        assert factors.counts[f"{name}|a"] == factors.counts[f"{name}|g"] == sent
    assert factors.counts["model.layers.0.self_attn.q_proj|a"] == int(unpadded.sum())


def test_experts_of_another_layout_are_reported(caplog):
    model = tiny_moe("mixtral")
    for layer in model.model.layers:
        layer.mlp.experts.is_transposed = True  # e.g. gpt-oss's [E, in, out] layout: not rewritten
    caplog.set_level(logging.WARNING, logger="assay")
    modules = linear_modules(model)
    assert not any(".experts." in n for n in modules)
    assert "4 fused expert weights of this mixture of experts" in caplog.text


def test_compute_casts_store_the_experts_in_bf16_with_identical_rows():
    """Under bf16 autocast the fused expert weights, cast once and kept, give the rows their
    per-call casts gave (the linear layers' keep_compute_casts, extended to the experts)."""
    model = tiny_moe("mixtral", seed=3)
    policy = PrecisionPolicy.resolve("bf16", "cpu")
    examples = random_examples([9, 5, 12], seed=3)
    _, before, losses = collect_all(model, examples, np.arange(3), Projector(4, 0), policy)
    assert keep_compute_casts(model, policy) == 2 * (4 + 2)  # per layer q k v o and the two fused
    experts = model.model.layers[0].mlp.experts
    assert experts.gate_up_proj.dtype == experts.down_proj.dtype == torch.bfloat16
    _, after, losses_after = collect_all(model, examples, np.arange(3), Projector(4, 0), policy)
    assert before.abs().sum() > 0
    assert torch.equal(before, after) and torch.equal(losses, losses_after)


def test_routed_rows_are_padded_under_cpu_bf16_only():
    """oneDNN compiles a bf16 kernel per row count (`assay.lm.shapes`); fp32 rows stay as they are."""
    rows = torch.arange(100)
    assert _bucketed(rows, torch.zeros(1)) is rows
    padded = _bucketed(rows, torch.zeros(1, dtype=torch.bfloat16))
    assert len(padded) == 112 and torch.equal(padded[:100], rows) and not padded[100:].any()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert len(_bucketed(rows, torch.zeros(1))) == 112


def test_a_padded_expert_gives_its_unpadded_output_and_gradient():
    experts = torch.nn.Module()
    experts.gate_up_proj = torch.nn.Parameter(torch.randn(2, 24, 32))
    view = ExpertLinear(experts, "gate_up_proj", 1)
    rows = torch.tensor([0, 3, 4, 9, 10, 11, 17])  # 7 of 2 x 10 tokens: padded to 16
    assert len(_bucketed(rows, torch.zeros(1, dtype=torch.bfloat16))) == 16
    x = torch.zeros(2, 10, 32)
    x.view(-1, 32)[rows] = torch.randn(len(rows), 32)
    x.requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = view(x, rows)
        want = torch.nn.functional.linear(x.view(-1, 32)[rows], view.weight)
    assert torch.equal(out.view(-1, 24)[rows], want)
    others = torch.ones(20, dtype=torch.bool).index_fill(0, rows, False)
    assert not out.view(-1, 24)[others].any()
    g = torch.randn_like(out)
    (grad,) = torch.autograd.grad(out, x, g)
    (grad_want,) = torch.autograd.grad(want, x, g.view(-1, 24)[rows])
    assert torch.allclose(grad, grad_want, rtol=1e-2, atol=1e-2) and grad.view(-1, 32)[rows].abs().sum() > 0


def test_the_experts_loop_keeps_no_routed_rows_for_its_scatters():
    """torch's index_copy and index_add keep their source rows for backward; the loop's scatters
    (index_put_) keep only the indices."""
    model = tiny_moe("mixtral")
    expose_experts(model)
    ids = torch.randint(1, 128, (2, 30))
    nodes, stack = set(), [model(ids).logits.sum().grad_fn]
    while stack:
        node = stack.pop()
        if node is not None and node not in nodes:
            nodes.add(node)
            stack += [f for f, _ in node.next_functions]
    kinds = {type(n).__name__ for n in nodes}
    assert "IndexPutBackward0" in kinds
    assert not kinds & {"IndexCopyBackward0", "IndexAddBackward0"}
