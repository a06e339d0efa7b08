"""The memory savings of `assay.lm.lean` change no number: checked bit for bit against the plain path."""

from __future__ import annotations

import contextlib
import os

import numpy as np
import pytest
import torch
from torch.utils.checkpoint import checkpoint

import assay.attribution.collector as collector_module
from assay.attribution.projection import Projector
from assay.core.precision import PrecisionPolicy
from assay.lm import lean, padding
from assay.lm.lean import keep_compute_casts, recompute_elementwise
from tests.helpers import collect_all, random_examples, tiny_gpt2, tiny_llama

PRECISIONS = ("fp32", "bf16", "bf16-pure")


def _model(make, precision: str):
    model = make()
    return model.to(torch.bfloat16) if precision == "bf16-pure" else model


def _rows(model, precision: str, projection_dim: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    examples = random_examples([9, 5, 12], seed=1)
    policy = PrecisionPolicy.resolve(precision, "cpu")
    _, grads, losses = collect_all(model, examples, np.arange(3), Projector(projection_dim, 0), policy)
    return grads, losses


def _kept_bytes(model, precision: str, monkeypatch) -> int:
    """Bytes of distinct non-parameter storages kept for backward in one collection: what autograd
    saves plus the inputs a checkpointed step holds for its recomputation."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept: dict[int, int] = {}

    def keep(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            kept[ptr] = t.untyped_storage().nbytes()
        return t

    def spied_checkpoint(fn, *args, **kw):
        for a in args:
            keep(a)
        return checkpoint(fn, *args, **kw)

    monkeypatch.setattr(lean, "checkpoint", spied_checkpoint)
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        _rows(model, precision)
    return sum(kept.values())


@pytest.mark.parametrize("precision", PRECISIONS)
def test_recomputed_elementwise_steps_give_identical_gradients(precision, monkeypatch):
    model = _model(tiny_llama, precision)
    recomputed = _rows(model, precision)
    monkeypatch.setattr(collector_module, "recompute_elementwise", lambda *a: contextlib.nullcontext())
    plain = _rows(model, precision)
    assert torch.equal(recomputed[0], plain[0]) and torch.equal(recomputed[1], plain[1])


@pytest.mark.parametrize("precision", PRECISIONS)
def test_recomputing_keeps_less_for_backward(precision, monkeypatch):
    model = _model(lambda: tiny_llama(intermediate_size=256), precision)  # MLP-heavy, like real LMs
    lean_bytes = _kept_bytes(model, precision, monkeypatch)
    monkeypatch.setattr(collector_module, "recompute_elementwise", lambda *a: contextlib.nullcontext())
    plain_bytes = _kept_bytes(model, precision, monkeypatch)
    # the MLP keeps 2 of its 3 [tokens, intermediate] tensors; pure bf16 norms a bf16, not fp32, input
    assert lean_bytes < 0.9 * plain_bytes, (lean_bytes, plain_bytes)


def test_recompute_elementwise_restores_the_forwards():
    model = tiny_llama()
    mlp, norm = model.model.layers[0].mlp, model.model.layers[0].input_layernorm
    with recompute_elementwise(model) as switched:
        assert switched == 2 * 3 + 1  # per layer an MLP and two norms, plus the final norm
        assert "forward" in vars(mlp) and "forward" in vars(norm)
    assert "forward" not in vars(mlp) and "forward" not in vars(norm)


@pytest.mark.parametrize("make", [tiny_llama, tiny_gpt2], ids=["llama", "gpt2"])
@pytest.mark.parametrize("tied", [False, True])
def test_compute_casts_give_identical_gradients(make, tied):
    model = make()
    if tied:
        model.get_output_embeddings().weight = model.get_input_embeddings().weight
    before = _rows(model, "bf16")
    changed = keep_compute_casts(model, PrecisionPolicy.resolve("bf16", "cpu"))
    after = _rows(model, "bf16")
    assert changed > 0
    assert torch.equal(before[0], after[0]) and torch.equal(before[1], after[1])
    assert model.get_output_embeddings().weight.dtype == torch.float32  # the head keeps fp32
    assert model.get_input_embeddings().weight.dtype == torch.float32


def test_compute_casts_touch_only_linear_weights_under_autocast():
    model = tiny_llama()
    assert keep_compute_casts(model, PrecisionPolicy.resolve("fp32", "cpu")) == 0
    assert keep_compute_casts(model, PrecisionPolicy.resolve("bf16", "cpu")) == 2 * 7  # q k v o gate up down
    dtypes = {n: p.dtype for n, p in model.named_parameters()}
    assert dtypes["model.layers.0.self_attn.q_proj.weight"] == torch.bfloat16
    assert dtypes["model.layers.0.input_layernorm.weight"] == torch.float32
    assert dtypes["model.embed_tokens.weight"] == torch.float32


@pytest.mark.parametrize("precision, tolerance", [("fp32", 1e-5), ("bf16", 1e-2)])
def test_grouped_query_attention_matches_repeated_heads(precision, tolerance, monkeypatch):
    """Only the order of the key/value gradient sums differs: fp32 agrees to rounding. With the
    padding mask passed (assay.lm.padding leaves it out of right-padded batches of known causal
    models, and transformers then shares the heads itself), as for any other model."""
    monkeypatch.setattr(padding, "mask_needed", lambda model, mask: mask is not None)
    model = _model(tiny_llama, precision)  # 4 query heads share 2 key/value heads
    shared_grads, shared_losses = _rows(model, precision)
    shared_bytes = _kept_bytes(model, precision, monkeypatch)
    monkeypatch.setattr(collector_module, "grouped_query_attention", lambda d: contextlib.nullcontext())
    repeated_grads, repeated_losses = _rows(model, precision)
    assert torch.equal(shared_losses, repeated_losses)  # the forward is the same
    assert float((shared_grads - repeated_grads).norm() / repeated_grads.norm()) < tolerance
    assert shared_bytes < _kept_bytes(model, precision, monkeypatch)


def test_without_the_mask_transformers_shares_key_value_heads_itself(monkeypatch):
    """A right-padded batch of a Llama goes without its mask: SDPA then reads the shared heads
    (`enable_gqa`) with or without assay's switch, and keeps less than with the mask (no
    [B, 1, T, T] mask kept for backward)."""
    model = tiny_llama()
    without_mask = _kept_bytes(model, "fp32", monkeypatch)
    monkeypatch.setattr(collector_module, "grouped_query_attention", lambda d: contextlib.nullcontext())
    assert _kept_bytes(model, "fp32", monkeypatch) == without_mask  # the switch no longer matters
    monkeypatch.undo()
    monkeypatch.setattr(padding, "mask_needed", lambda model, mask: mask is not None)
    assert without_mask < _kept_bytes(model, "fp32", monkeypatch)  # the switch's, with the mask


def test_grouped_query_attention_only_on_cpu_and_restores_the_switch():
    assert lean.FORCE_GQA not in os.environ
    with lean.grouped_query_attention(torch.device("cpu")) as on:
        assert on and os.environ[lean.FORCE_GQA] == "1"
    assert lean.FORCE_GQA not in os.environ
    with lean.grouped_query_attention(torch.device("cuda")) as on:
        assert not on and lean.FORCE_GQA not in os.environ


def test_compute_casts_leave_lora_adapters_alone():
    """PEFT casts a LoRA layer's input to its adapter's weight dtype: bf16 adapters would change
    what the adapter hooks see, so only base weights are cast."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny_llama(), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1)  # non-zero B, so the adapters matter
    modules = {n: m for n, m in model.named_modules() if n.endswith(("lora_A.default", "lora_B.default"))}
    examples = random_examples([9, 5, 12], seed=1)
    policy = PrecisionPolicy.resolve("bf16", "cpu")

    def rows() -> torch.Tensor:
        from assay.attribution.collector import GradientCollector
        from assay.lm.data import collate
        from assay.lm.losses import example_losses

        batch = collate(examples, np.arange(3), pad_id=0)
        with GradientCollector(model, modules, Projector(4, 0), policy) as col:
            return col.gradients(batch, example_losses)[0]

    before = rows()
    assert keep_compute_casts(model, policy) > 0
    assert all(p.dtype == torch.float32 for n, p in model.named_parameters() if "lora_" in n)
    assert torch.equal(before, rows())


def test_llama_form_rmsnorms_share_llamas_forward():
    """The written-out RMSNorm backward is Llama's: every class it is used for has that forward."""
    import importlib
    import inspect

    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    llama = inspect.getsource(LlamaRMSNorm.forward)
    for name in lean.LLAMA_RMSNORM_TYPES:
        family = name[: -len("RMSNorm")].lower()
        module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
        assert inspect.getsource(getattr(module, name).forward) == llama, name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_written_out_backwards_match_autograd_bit_for_bit(dtype):
    """Norm and gated MLP on a residual stream (x feeds both, as in a decoder layer), width 48
    (not a power of two), random weights: outputs and input gradients equal the plain module's."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm

    torch.manual_seed(0)
    block = torch.nn.ModuleDict(
        {
            "norm": LlamaRMSNorm(48),
            "mlp": LlamaMLP(LlamaConfig(hidden_size=48, intermediate_size=80, num_attention_heads=4)),
        }
    )
    block.norm.weight.data.normal_()
    block.requires_grad_(False)

    def run():
        x = torch.randn(3, 7, 48, generator=torch.Generator().manual_seed(1), requires_grad=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            out = x + block.mlp(block.norm(x))
        out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(2), dtype=out.dtype))
        return out, x.grad

    plain = run()
    with recompute_elementwise(block) as switched:
        assert switched == 2
        written = run()
    assert torch.equal(written[0], plain[0]) and torch.equal(written[1], plain[1])


def test_trainable_or_low_precision_norms_keep_the_checkpoint(monkeypatch):
    """The written-out norm only for an fp32 input and a frozen fp32 weight."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    used = []
    monkeypatch.setattr(lean._FrozenRMSNorm, "apply", lambda *a: used.append(1) or a[0])
    norm = LlamaRMSNorm(8)
    x = torch.randn(2, 8, requires_grad=True)
    with recompute_elementwise(norm):
        norm(x)  # trainable weight: needs its gradient
        norm.weight.requires_grad_(False)
        norm(x.bfloat16())  # bf16 input
        assert not used
        norm(x)
    assert used == [1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_written_out_rotary_matches_transformers_bit_for_bit(dtype):
    """Llama's rotary embedding of non-contiguous q and k (the attention's transposed views)
    in the dtype the projections give, with fp32 cos and sin: outputs and input gradients equal
    transformers' own, and the function is back on exit."""
    from transformers.models.llama import modeling_llama

    gen = torch.Generator().manual_seed(0)
    cos, sin = torch.randn(1, 7, 16, generator=gen), torch.randn(1, 7, 16, generator=gen)
    upstream = [torch.randn(2, 4, 7, 16, generator=gen), torch.randn(2, 2, 7, 16, generator=gen)]

    def run(rotary):
        q = torch.randn(2, 7, 4, 16, generator=torch.Generator().manual_seed(1)).to(dtype)
        k = torch.randn(2, 7, 2, 16, generator=torch.Generator().manual_seed(2)).to(dtype)
        q, k = q.requires_grad_(), k.requires_grad_()
        outs = rotary(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
        torch.autograd.backward(outs, upstream)
        return (*outs, q.grad, k.grad)

    original = modeling_llama.apply_rotary_pos_emb
    plain = run(original)
    with recompute_elementwise(tiny_llama()):
        patched = modeling_llama.apply_rotary_pos_emb
        written = run(patched)
    assert patched is lean._rotary and modeling_llama.apply_rotary_pos_emb is original
    assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(written, plain))
    assert written[2].dtype == dtype


def test_rotary_left_alone_where_it_is_not_llamas(monkeypatch):
    """A rotary function of another form (Phi-3's partial rotary), or one wrapped in a way that
    hides its code, is left as it is."""
    from transformers import Phi3Config, Phi3ForCausalLM
    from transformers.models.llama import modeling_llama

    phi3 = Phi3ForCausalLM(
        Phi3Config(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
            partial_rotary_factor=0.5,
            pad_token_id=0,
        )
    )
    assert lean._llama_rotary_globals(phi3) == []
    assert lean._llama_rotary_globals(tiny_llama()) == [vars(modeling_llama)]
    monkeypatch.setattr(lean, "_plain_function", lambda fn: None)
    original = modeling_llama.apply_rotary_pos_emb
    with recompute_elementwise(tiny_llama()):
        assert modeling_llama.apply_rotary_pos_emb is original
