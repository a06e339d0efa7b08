"""The output head and its cross-entropy, computed a few hundred tokens at a time.

A causal LM's logits are [tokens, vocabulary]: at SmolLM2's 49k vocabulary and 4k tokens a
batch, the fp32 logits, their log-softmax and their gradient take ~2.4 GB, more than the rest of
a gradient-collection step. When the head's weight needs no gradient (gradient collection, LoRA
fine-tuning), the gradient of each token's loss with respect to the head's input is known as soon
as the loss is: (softmax − one-hot) · W. So `chunked_head_losses` computes logits, loss and that
gradient chunk by chunk in the forward pass and keeps only the [tokens, hidden] gradient; peak
memory no longer grows with the vocabulary.

Numerics follow the plain path (`logits = head(h)` under the precision policy, then fp32
cross-entropy): the head's matmuls run in the autocast dtype when autocast is on, the softmax and
loss in fp32; under fp16 the gradient matmul runs in fp32 (no loss-scale is known in the forward,
so small probabilities would underflow in fp16).

Used only where it is exact: model types whose logits are the head's output as is (no
soft-capping or logit scaling), a head that is an `nn.Linear` without hooks, and either without
`requires_grad` or run without autograd (losses of a model being trained, evaluated under
`torch.no_grad`). Everything else takes the plain path.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

# Model types whose causal-LM forward returns `lm_head(last_hidden_state)` unchanged.
PLAIN_HEAD_MODEL_TYPES = frozenset(
    {"llama", "mistral", "qwen2", "qwen3", "gpt2", "gpt_neox", "olmo", "olmo2", "phi3", "gemma", "smollm3"}
)
CHUNK_ELEMENTS = 2**20
"""Logits per chunk: 4 MB in fp32, 256 tokens at a 4k vocabulary."""
MIN_CHUNK_TOKENS = 128
"""Each chunk reads the head's whole weight twice, so a chunk never has fewer tokens than this
(SmolLM2's 49k vocabulary: 25 MB of fp32 logits; fewer tokens made its fp32 build slower)."""


def fusable_head(model: nn.Module) -> nn.Linear | None:
    """The model's output head if its loss can be computed chunk-wise exactly, else None."""
    config = getattr(model, "config", None)
    if getattr(config, "model_type", None) not in PLAIN_HEAD_MODEL_TYPES:
        return None
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if type(head) is not nn.Linear:  # LoRA-wrapped or custom heads take the plain path
        return None
    # a head being trained needs its weight gradient, which the chunks do not give; without
    # autograd (evaluation) only the losses are asked for, so a trainable head chunks too
    trainable = torch.is_grad_enabled() and any(p.requires_grad for p in head.parameters())
    hooked = bool(head._forward_hooks or head._forward_pre_hooks or head._backward_hooks)
    return None if trainable or hooked else head


class _Capture(nn.Module):
    """Stands in for the head for one forward: records its input, returns it unchanged."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden: torch.Tensor | None = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        self.hidden = hidden
        return hidden


@contextmanager
def head_bypassed(model: nn.Module, head: nn.Module) -> Iterator[_Capture]:
    """Within the block the model's forward skips its head; `.hidden` holds the head's input."""
    parent, attr = next((m, n) for m in model.modules() for n, child in m.named_children() if child is head)
    capture = _Capture()
    setattr(parent, attr, capture)
    try:
        yield capture
    finally:
        setattr(parent, attr, head)


def _compute_dtype(hidden: torch.Tensor) -> torch.dtype:
    device = hidden.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden.dtype


def _losses_and_grads(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    dtype: torch.dtype,
    need_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """([N] fp32 token losses, [N, H] fp32 d loss/d hidden or None), a chunk of tokens at a time.

    Every chunk reuses one set of [chunk, V] buffers: a fresh tensor per chunk would be a fresh
    mapping for the kernel to zero and fault in (see `assay.core.memory`), which cost more than
    the arithmetic. The softmax takes one exp per logit: lse = max + log Σ exp(z − max).
    """
    w = weight.to(dtype)  # [V, H]
    b = None if bias is None else bias.to(dtype)
    grad_dtype = torch.float32 if dtype == torch.float16 else dtype
    w_grad = w.to(grad_dtype)  # the same tensor unless fp16
    n, vocab = hidden.shape[0], weight.shape[0]
    chunk = max(1, min(n, max(MIN_CHUNK_TOKENS, CHUNK_ELEMENTS // vocab)))
    losses = hidden.new_empty(n, dtype=torch.float32)
    grads = torch.empty_like(hidden, dtype=torch.float32) if need_grad else None
    head_out = hidden.new_empty(chunk, vocab, dtype=dtype)
    logits = head_out if dtype == torch.float32 else hidden.new_empty(chunk, vocab, dtype=torch.float32)
    for start in range(0, n, chunk):
        rows, c = slice(start, start + chunk), min(chunk, n - start)
        h = hidden[rows].to(dtype)
        if b is None:
            torch.mm(h, w.T, out=head_out[:c])
        else:
            torch.addmm(b, h, w.T, out=head_out[:c])
        z = logits[:c]
        if logits is not head_out:  # bf16/fp16 head: upcast (an fp32 head wrote the logits)
            z.copy_(head_out[:c])
        target = targets[rows, None]
        picked = z.gather(1, target)[:, 0]
        top = z.amax(dim=1, keepdim=True)
        total = z.sub_(top).exp_().sum(dim=1, keepdim=True)  # z now holds exp(logits − max)
        losses[rows] = (top + total.log())[:, 0] - picked
        if grads is not None:
            probs = z.div_(total)
            probs.scatter_add_(1, target, probs.new_full(target.shape, -1.0))
            if grad_dtype == torch.float32:
                torch.mm(probs, w_grad, out=grads[rows])
            else:
                grads[rows] = torch.mm(head_out[:c].copy_(probs), w_grad)
    return losses, grads


class _ChunkedHeadLoss(torch.autograd.Function):
    """[N] fp32 token losses of hidden [N, H] under head (W [V, H], b); d loss/d hidden kept."""

    @staticmethod
    def forward(ctx: Any, *args: Any) -> torch.Tensor:  # type: ignore[override]
        hidden = args[0]
        with torch.autocast(hidden.device.type, enabled=False):  # dtypes are chosen explicitly
            losses, grads = _losses_and_grads(*args)
        ctx.save_for_backward(grads)
        ctx.hidden_dtype = hidden.dtype
        return losses

    @staticmethod
    def backward(ctx: Any, grad_losses: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        (grads,) = ctx.saved_tensors
        grad_hidden = (grads * grad_losses[:, None].float()).to(ctx.hidden_dtype)
        return grad_hidden, None, None, None, None, None


def chunked_head_losses(hidden: torch.Tensor, head: nn.Linear, labels: torch.Tensor) -> torch.Tensor:
    """[B, T] fp32 loss of each next-token target from the head's input hidden [B, T, H], laid
    out as `assay.lm.losses.token_losses` lays them out (0 where labels are -100)."""
    targets = labels[:, 1:]  # position t predicts token t + 1
    keep = targets != -100  # [B, T-1]
    rows = hidden[:, :-1][keep]  # [N, H]: only positions with a target
    need_grad = torch.is_grad_enabled() and rows.requires_grad
    losses = _ChunkedHeadLoss.apply(
        rows, head.weight, head.bias, targets[keep], _compute_dtype(hidden), need_grad
    )
    return F.pad(losses.new_zeros(keep.shape).masked_scatter(keep, losses), (1, 0))
