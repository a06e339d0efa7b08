"""The output head and its cross-entropy, computed a few hundred tokens at a time.

A causal LM's logits are [tokens, vocabulary]: at SmolLM2's 49k vocabulary and 4k tokens a
batch, the fp32 logits, their log-softmax and their gradient take ~2.4 GB, more than the rest of
a gradient-collection step. When the head's weight needs no gradient (gradient collection, LoRA
fine-tuning), the gradient of each token's loss with respect to the head's input is known as soon
as the loss is: (softmax − one-hot) · W. So `chunked_head_losses` computes logits, loss and that
gradient chunk by chunk in the forward pass and keeps only the [tokens, hidden] gradient; peak
memory no longer grows with the vocabulary. A head being trained (full fine-tuning) needs its
weight's gradient, which depends on each token's upstream gradient, known only in backward: the
forward then keeps each token's log-sum-exp, and the backward computes the logits again chunk by
chunk (one more head matmul) for the hidden, weight and bias gradients, summed in fp32.

Numerics follow the plain path (`logits = head(h)` under the precision policy, then fp32
cross-entropy): the head's matmuls run in the autocast dtype when autocast is on, the softmax and
loss in fp32; under fp16 the gradient matmul runs in fp32 (no loss-scale is known in the forward,
so small probabilities would underflow in fp16). A trained head's weight gradient is each
chunk's product summed in fp32, where the plain path rounds the whole product once to the
autocast dtype.

Used only where it is exact: model types whose logits are the head's output as is (no
soft-capping or logit scaling) and a head that is an `nn.Linear` without hooks. Everything else
takes the plain path, and so do second derivatives (the backward works in place on its buffers).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from assay.lm.shapes import compute_dtype, kept_per_shape, kernel_rows

# Model types whose causal-LM forward returns `lm_head(last_hidden_state)` unchanged.
PLAIN_HEAD_MODEL_TYPES = frozenset(
    {"llama", "mistral", "qwen2", "qwen3", "gpt2", "gpt_neox", "olmo", "olmo2", "phi3", "gemma", "smollm3"}
    # mixtures of experts: the router's auxiliary loss joins `loss` only, given labels
    | {"mixtral", "qwen2_moe", "qwen3_moe", "olmoe"}
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
    hooked = bool(head._forward_hooks or head._forward_pre_hooks or head._backward_hooks)
    return None if hooked else head


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


def _losses_and_grads(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    dtype: torch.dtype,
    need_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """([N] fp32 token losses, [N] fp32 log-sum-exps of their logits, [N, H] fp32 d loss/d hidden
    or None), a chunk of tokens at a time.

    The softmax takes one exp per logit: lse = max + log Σ exp(z − max).
    """
    head = _Chunks(hidden, weight, bias, dtype)
    losses = hidden.new_empty(head.n, dtype=torch.float32)
    lse = torch.empty_like(losses)
    grads = torch.empty_like(hidden, dtype=torch.float32) if need_grad else None
    for rows, _, z in head.logits():
        target = targets[rows, None]
        picked = z.gather(1, target)[:, 0]
        top = z.amax(dim=1, keepdim=True)
        total = z.sub_(top).exp_().sum(dim=1, keepdim=True)  # z now holds exp(logits − max)
        lse[rows] = (top + total.log())[:, 0]
        losses[rows] = lse[rows] - picked
        if grads is not None:
            probs = z.div_(total)
            probs.scatter_add_(1, target, probs.new_full(target.shape, -1.0))
            if head.grad_dtype == torch.float32:
                torch.mm(probs, head.w_grad, out=grads[rows])
            else:
                grads[rows] = torch.mm(head.padded_grad(probs), head.w_grad)[: len(z)]
    return losses, lse, grads


class _Chunks:
    """The head's logits over hidden [N, H], a chunk of tokens at a time, in reused buffers.

    Every chunk reuses one set of [chunk, V] buffers: a fresh tensor per chunk would be a fresh
    mapping for the kernel to zero and fault in (see `assay.core.memory`), which cost more than
    the arithmetic. The head's matmul runs in `dtype` (the autocast dtype), the logits come out
    in fp32; gradient matmuls run in `grad_dtype`, fp32 under fp16 (small probabilities would
    underflow) and `dtype` otherwise. On the CPU a low-precision matmul's rows are padded with zeros to a
    full chunk (`assay.lm.shapes`): the last chunk's count follows the batch, and every new count
    would be a kernel oneDNN compiles and keeps (the zero rows cost at most a chunk per batch).
    """

    def __init__(
        self, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype
    ) -> None:
        self.hidden, self.dtype = hidden, dtype
        self.w = weight.to(dtype)  # [V, H]
        self.b = None if bias is None else bias.to(dtype)
        self.grad_dtype = torch.float32 if dtype == torch.float16 else dtype
        self.w_grad = self.w.to(self.grad_dtype)  # the same tensor unless fp16
        self.n, vocab = hidden.shape[0], weight.shape[0]
        self.chunk = max(1, min(self.n, max(MIN_CHUNK_TOKENS, CHUNK_ELEMENTS // vocab)))
        self.rows = kernel_rows(self.chunk, dtype, hidden.device)  # a low-precision matmul's rows
        self.head_out = hidden.new_empty(self.rows, vocab, dtype=dtype)
        fp32 = dtype == torch.float32
        self._logits = self.head_out if fp32 else hidden.new_empty(self.chunk, vocab, dtype=torch.float32)

    def padded_grad(self, probs: torch.Tensor) -> torch.Tensor:
        """[c, V] fp32 d loss/d logits in `grad_dtype`: itself when that is fp32, else in the
        reused buffer, padded with zero rows as the chunk's hidden is."""
        if self.grad_dtype == torch.float32:
            return probs
        c = len(probs)
        g = self.head_out[: self._rows_for(c)]
        g[:c].copy_(probs)
        g[c:].zero_()
        return g

    def _rows_for(self, c: int) -> int:
        """The rows a chunk of c tokens is multiplied on: the full chunk's where oneDNN keeps a
        kernel per shape (low precision on the CPU), else c."""
        return self.rows if kept_per_shape(self.dtype, self.hidden.device) else c

    def logits(self) -> Iterator[tuple[slice, torch.Tensor, torch.Tensor]]:
        """(rows, [c', H] hidden in `dtype` (c' ≥ c rows, zero past the chunk's c), [c, V] fp32
        logits: a buffer the next chunk reuses)."""
        for start in range(0, self.n, self.chunk):
            rows, c = slice(start, start + self.chunk), min(self.chunk, self.n - start)
            h = self.hidden[rows].to(self.dtype)
            padded = self._rows_for(c)
            h = torch.cat([h, h.new_zeros(padded - c, h.shape[1])]) if padded > c else h
            if self.b is None:
                torch.mm(h, self.w.T, out=self.head_out[:padded])
            else:
                torch.addmm(self.b, h, self.w.T, out=self.head_out[:padded])
            z = self._logits[:c]
            if self._logits is not self.head_out:  # bf16/fp16 head: upcast its output
                z.copy_(self.head_out[:c])
            yield rows, h, z


class _ChunkedHeadLoss(torch.autograd.Function):
    """[N] fp32 token losses of hidden [N, H] under head (W [V, H], b); d loss/d hidden kept."""

    @staticmethod
    def forward(ctx: Any, *args: Any) -> torch.Tensor:  # type: ignore[override]
        hidden = args[0]
        with torch.autocast(hidden.device.type, enabled=False):  # dtypes are chosen explicitly
            losses, _, grads = _losses_and_grads(*args)
        ctx.save_for_backward(grads)
        ctx.hidden_dtype = hidden.dtype
        return losses

    @staticmethod
    def backward(ctx: Any, grad_losses: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        (grads,) = ctx.saved_tensors
        grad_hidden = (grads * grad_losses[:, None].float()).to(ctx.hidden_dtype)
        return grad_hidden, None, None, None, None, None


class _TrainedHeadLoss(torch.autograd.Function):
    """[N] fp32 token losses of hidden [N, H] under a head being trained (W [V, H], b).

    The weight's gradient Σ_t g_t (softmax_t − one-hot_t) h_tᵀ needs each token's upstream
    gradient g_t, known only in backward, so the forward keeps each token's log-sum-exp and the
    backward computes the logits again, chunk by chunk: one more head matmul for no
    [tokens, vocabulary] tensor. The weight's and bias's gradients are summed over chunks in fp32.
    """

    @staticmethod
    def forward(ctx: Any, *args: Any) -> torch.Tensor:  # type: ignore[override]
        hidden, weight, bias, targets, dtype = args
        with torch.autocast(hidden.device.type, enabled=False):  # dtypes are chosen explicitly
            losses, lse, _ = _losses_and_grads(hidden, weight, bias, targets, dtype, need_grad=False)
        ctx.save_for_backward(hidden, weight, bias, targets, lse)
        ctx.dtype = dtype
        return losses

    @staticmethod
    @once_differentiable  # in-place chunk buffers; second derivatives take the plain logits path
    def backward(ctx: Any, grad_losses: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        hidden, weight, bias, targets, lse = ctx.saved_tensors
        with torch.autocast(hidden.device.type, enabled=False):
            grads = _head_backward(hidden, weight, bias, targets, lse, grad_losses.float(), ctx.dtype)
        d_hidden, d_weight, d_bias = grads
        wanted = ctx.needs_input_grad
        return (
            d_hidden.to(hidden.dtype) if wanted[0] else None,
            d_weight.to(weight.dtype) if wanted[1] else None,
            d_bias.to(bias.dtype) if d_bias is not None and wanted[2] else None,
            None,
            None,
        )


def _head_backward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    lse: torch.Tensor,
    grad_losses: torch.Tensor,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """d/d hidden [N, H], d/d W [V, H] and d/d b [V] (fp32) of Σ_t grad_losses_t · loss_t."""
    head = _Chunks(hidden, weight, bias, dtype)
    d_hidden = torch.empty_like(hidden, dtype=torch.float32)
    d_weight = torch.zeros_like(weight, dtype=torch.float32)
    # each chunk's weight gradient lands in one reused buffer before the fp32 sum
    chunk_weight = None if head.grad_dtype == torch.float32 else torch.empty_like(head.w_grad)
    d_bias = None if bias is None else torch.zeros_like(bias, dtype=torch.float32)
    for rows, h, z in head.logits():
        probs = z.sub_(lse[rows, None]).exp_()  # softmax, from the forward's log-sum-exp
        target = targets[rows, None]
        probs.scatter_add_(1, target, probs.new_full(target.shape, -1.0))
        probs.mul_(grad_losses[rows, None])  # [c, V]: d Σ / d logits
        g = head.padded_grad(probs)
        d_hidden[rows] = (g @ head.w_grad)[: len(z)]
        h = h[: len(g)].to(head.grad_dtype)  # the same tensor unless fp16 (then unpadded)
        if chunk_weight is None:
            d_weight.addmm_(g.T, h)
        else:
            d_weight += torch.mm(g.T, h, out=chunk_weight)
        if d_bias is not None:
            d_bias += g.sum(dim=0, dtype=torch.float32)
    return d_hidden, d_weight, d_bias


def chunked_head_losses(hidden: torch.Tensor, head: nn.Linear, labels: torch.Tensor) -> torch.Tensor:
    """[B, T] fp32 loss of each next-token target from the head's input hidden [B, T, H], laid
    out as `assay.lm.losses.token_losses` lays them out (0 where labels are -100)."""
    targets = labels[:, 1:]  # position t predicts token t + 1
    keep = targets != -100  # [B, T-1]
    rows = hidden[:, :-1][keep]  # [N, H]: only positions with a target
    dtype = compute_dtype(hidden)
    head_trains = torch.is_grad_enabled() and any(p.requires_grad for p in head.parameters())
    if head_trains:
        losses = _TrainedHeadLoss.apply(rows, head.weight, head.bias, targets[keep], dtype)
    else:
        need_grad = torch.is_grad_enabled() and rows.requires_grad
        losses = _ChunkedHeadLoss.apply(rows, head.weight, head.bias, targets[keep], dtype, need_grad)
    return F.pad(losses.new_zeros(keep.shape).masked_scatter(keep, losses), (1, 0))
