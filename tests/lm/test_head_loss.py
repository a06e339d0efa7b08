"""The chunked head + cross-entropy equals the plain logits path, and is used only where exact."""

from __future__ import annotations

from functools import partial

import numpy as np
import pytest
import torch

from assay.core.precision import PrecisionPolicy
from assay.lm import head_loss
from assay.lm.data import collate
from assay.lm.head_loss import fusable_head
from assay.lm.losses import example_losses, token_losses
from tests.helpers import random_examples, tiny_gpt2, tiny_llama, tiny_moe


def plain_losses(model, batch):
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return token_losses(logits, batch["labels"]).sum(dim=1)


def frozen_head(model):
    """Head (and, tied, the embedding) frozen, as in gradient collection or LoRA training."""
    model.get_output_embeddings().weight.requires_grad_(False)
    return model


def losses_and_grads(model, batch, objective, policy):
    model.zero_grad(set_to_none=True)
    with policy.autocast():
        losses = objective(model, batch)
    (losses * torch.linspace(0.5, 2.0, len(losses))).sum().backward()  # unequal weights per example
    grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.requires_grad])
    return losses.detach(), grads


def batch_with_prompts():
    examples = random_examples([7, 19, 12, 3], loss_start=[1, 5, 1, 2])
    return collate(examples, np.arange(4), pad_id=0)


@pytest.mark.parametrize("trained", [False, True], ids=["frozen-head", "trained-head"])
@pytest.mark.parametrize("make", [tiny_llama, tiny_gpt2, tiny_moe, partial(tiny_moe, "olmoe")])
def test_chunked_head_equals_plain_logits_fp32(make, trained, monkeypatch):
    """Losses and every trainable parameter's gradient; a trained head's weight (GPT-2's tied to
    its embedding, Llama's its own) gets its gradient from the backward's chunks."""
    monkeypatch.setattr(head_loss, "CHUNK_ELEMENTS", 128 * 5)  # 5 tokens a chunk: many chunks
    monkeypatch.setattr(head_loss, "MIN_CHUNK_TOKENS", 1)
    model, batch = make() if trained else frozen_head(make()), batch_with_prompts()
    policy = PrecisionPolicy.resolve("fp32", torch.device("cpu"))
    assert fusable_head(model) is not None
    fused = losses_and_grads(model, batch, example_losses, policy)
    plain = losses_and_grads(model, batch, plain_losses, policy)
    torch.testing.assert_close(fused[0], plain[0], rtol=1e-6, atol=1e-5)
    assert float((fused[1] - plain[1]).norm() / plain[1].norm()) < 1e-5  # fp32 summation order


@pytest.mark.parametrize("trained", [False, True], ids=["frozen-head", "trained-head"])
def test_chunked_head_follows_bf16_autocast(trained):
    model, batch = tiny_llama() if trained else frozen_head(tiny_llama()), batch_with_prompts()
    bf16 = PrecisionPolicy.resolve("bf16", torch.device("cpu"))
    fused = losses_and_grads(model, batch, example_losses, bf16)
    plain = losses_and_grads(model, batch, plain_losses, bf16)
    # the same bf16 head matmuls and fp32 softmax: equal up to bf16 rounding of the gradient
    torch.testing.assert_close(fused[0], plain[0], rtol=1e-3, atol=1e-3)
    cos = torch.nn.functional.cosine_similarity(fused[1], plain[1], dim=0)
    assert cos > 0.999


@pytest.mark.parametrize("trainable", [False, True])
def test_no_grad_losses_match(trainable, monkeypatch):
    """Without autograd the chunks need no head gradient: a head being trained (evaluated under
    no_grad, as `assay finetune` evaluates) chunks as a frozen one does."""
    monkeypatch.setattr(head_loss, "CHUNK_ELEMENTS", 128 * 5)  # 5 tokens a chunk: many chunks
    monkeypatch.setattr(head_loss, "MIN_CHUNK_TOKENS", 1)
    model, batch = tiny_llama(), batch_with_prompts()
    model.get_output_embeddings().weight.requires_grad_(trainable)
    with torch.no_grad():
        assert fusable_head(model) is not None
        torch.testing.assert_close(example_losses(model, batch), plain_losses(model, batch))


def test_plain_path_where_chunking_would_be_wrong():
    model = frozen_head(tiny_llama())
    handle = model.get_output_embeddings().register_forward_hook(lambda *a: None)
    assert fusable_head(model) is None, "a hooked head (collected or spliced) must run"
    handle.remove()
    assert fusable_head(model) is not None
    model.config.model_type = "gemma2"  # soft-caps its logits after the head
    assert fusable_head(model) is None
    model.config.model_type = "llama"
    batch = batch_with_prompts()
    before = model.get_output_embeddings()
    example_losses(model, batch)
    assert model.get_output_embeddings() is before, "the head is restored after the forward"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_chunk_buffers_match_a_reference(dtype, with_bias, monkeypatch):
    """Losses and d loss/d hidden against fp64 on the same rounded inputs, with a bias and a
    last chunk shorter than the rest (the reused buffers must not leak between chunks)."""
    monkeypatch.setattr(head_loss, "CHUNK_ELEMENTS", 50 * 7)  # 7 tokens a chunk, 23 tokens
    monkeypatch.setattr(head_loss, "MIN_CHUNK_TOKENS", 1)
    gen = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(23, 16, generator=gen), torch.randn(50, 16, generator=gen)
    bias = torch.randn(50, generator=gen) if with_bias else None
    targets = torch.randint(0, 50, (23,), generator=gen)
    losses, lse, grads = head_loss._losses_and_grads(hidden, weight, bias, targets, dtype, True)
    h, w = hidden.to(dtype).double(), weight.to(dtype).double()
    logits = h @ w.T + (0 if bias is None else bias.to(dtype).double())
    ref_losses = torch.nn.functional.cross_entropy(logits, targets, reduction="none")
    probs = logits.softmax(dim=1) - torch.nn.functional.one_hot(targets, 50)
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(losses.double(), ref_losses, rtol=tol, atol=tol)
    torch.testing.assert_close(lse.double(), logits.logsumexp(dim=1), rtol=tol, atol=tol)
    assert grads is not None and grads.dtype == torch.float32
    torch.testing.assert_close(grads.double(), probs @ w, rtol=tol, atol=tol)
    # a trained head's backward: every token's upstream gradient, then d/d hidden, W and b
    upstream = torch.rand(23, generator=gen) + 0.5
    d_h, d_w, d_b = head_loss._head_backward(hidden, weight, bias, targets, lse, upstream, dtype)
    scaled = probs * upstream.double()[:, None]
    torch.testing.assert_close(d_h.double(), scaled @ w, rtol=tol, atol=tol)
    torch.testing.assert_close(d_w.double(), scaled.T @ h, rtol=tol, atol=tol * 5)
    if bias is not None:
        assert d_b is not None
        torch.testing.assert_close(d_b.double(), scaled.sum(dim=0), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_low_precision_head_keeps_one_row_count(dtype, monkeypatch):
    """On the CPU a bf16 head's matmuls run on the full chunk's rows whatever the batch's token
    count (oneDNN keeps a kernel per shape, `assay.lm.shapes`); fp32 ones on the rows there are."""
    from torch.utils._python_dispatch import TorchDispatchMode  # the ops' shapes, as torch runs them

    class Rows(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.seen: set[int] = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in (torch.ops.aten.mm.default, torch.ops.aten.mm.out, torch.ops.aten.addmm.out):
                self.seen.add(args[-2].shape[0] if func is torch.ops.aten.addmm.out else args[0].shape[0])
            return func(*args, **(kwargs or {}))

    monkeypatch.setattr(head_loss, "CHUNK_ELEMENTS", 50 * 32)  # 32 tokens a chunk
    monkeypatch.setattr(head_loss, "MIN_CHUNK_TOKENS", 1)
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(50, 16, generator=gen)
    rows = Rows()
    for n in (40, 57, 70, 96, 101):
        hidden, targets = torch.randn(n, 16, generator=gen), torch.randint(0, 50, (n,), generator=gen)
        with rows:
            head_loss._losses_and_grads(hidden, weight, None, targets, dtype, True)
    assert rows.seen == ({32} if dtype == torch.bfloat16 else {32, 8, 25, 6, 5})
