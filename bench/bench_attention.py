"""Causal attention's forward and backward on CPU: torch's flash kernel, its math backend, and a
backward written out from flash's log-sum-exp, at the batch shapes `assay build` makes.

The collector runs whatever attention the model's config picks (SDPA: the flash kernel on CPU).
This measures whether another path would be faster at the lengths its token batches have
(batch × length ≈ the token batch), and how far the written-out backward is from flash's.
Usage: python bench/bench_attention.py [--heads 9] [--head_dim 64] [--tokens 2048]
    [--lengths 64 128 256 512] [--dtype bf16]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).parent))
from bench_verify import timed  # noqa: E402
from machine import header  # noqa: E402


def written_out_backward(q, k, v, out, lse, grad, scale):
    """dq, dk, dv of causal softmax attention, the probabilities recomputed from the log-sum-exp
    (what flash keeps) in fp32 and every product a batched matmul in the inputs' dtype."""
    length = q.shape[-2]
    scores = torch.matmul(q, k.transpose(-1, -2)).float().mul_(scale)
    scores.masked_fill_(torch.ones(length, length, dtype=torch.bool).triu_(1), float("-inf"))
    probs = scores.sub_(lse[..., None]).exp_()
    dv = torch.matmul(probs.to(q.dtype).transpose(-1, -2), grad)
    dprobs = torch.matmul(grad, v.transpose(-1, -2)).float()
    delta = (grad.float() * out.float()).sum(-1, keepdim=True)
    dscores = probs.mul_(dprobs.sub_(delta)).mul_(scale).to(q.dtype)
    return torch.matmul(dscores, k), torch.matmul(dscores.transpose(-1, -2), q), dv


def one_shape(batch: int, length: int, args: argparse.Namespace, dtype: torch.dtype) -> str:
    gen = torch.Generator().manual_seed(0)
    shape = (batch, args.heads, length, args.head_dim)
    q, k, v = (torch.randn(shape, generator=gen, dtype=dtype).requires_grad_() for _ in range(3))
    grad = torch.randn(shape, generator=gen, dtype=dtype)
    scale = args.head_dim**-0.5

    def backend(kind: SDPBackend) -> Callable[[], None]:
        def run() -> None:
            with sdpa_kernel(kind):
                F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(grad)

        return run

    with torch.no_grad():
        flash_op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        out, lse = flash_op(q, k, v, 0.0, True, scale=scale)[:2]
        written = written_out_backward(q, k, v, out, lse.float(), grad, scale)
    q.grad = k.grad = v.grad = None
    backend(SDPBackend.FLASH_ATTENTION)()
    err = max(
        float((w.float() - x.grad.float()).norm() / x.grad.float().norm()) for w, x in zip(written, (q, k, v))
    )
    reps = args.repeats
    with torch.no_grad():
        flash_fwd = 1e3 * timed(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), reps)
        lse32 = lse.float()
        written_bwd = 1e3 * timed(lambda: written_out_backward(q, k, v, out, lse32, grad, scale), reps)
    flash = 1e3 * timed(backend(SDPBackend.FLASH_ATTENTION), reps)
    math = 1e3 * timed(backend(SDPBackend.MATH), reps)
    times = f"{flash:>13.1f} {flash_fwd:>9.1f} {math:>12.1f} {written_bwd:>16.1f}"
    return f"{batch:>5} {length:>6} {times} {err:>10.1e}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--heads", type=int, default=9, help="attention heads (SmolLM2-135M: 9)")
    ap.add_argument("--head_dim", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=2048, help="batch × length of each shape")
    ap.add_argument("--lengths", type=int, nargs="+", default=[64, 128, 192, 256, 320, 384, 512])
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    print(header(), flush=True)
    print(f"{args.heads} heads of {args.head_dim}, {args.dtype}, ~{args.tokens} tokens a batch; ms, medians")
    print("batch length flash fwd+bwd flash fwd math fwd+bwd written-out bwd rel. error")
    for length in args.lengths:
        print(one_shape(max(1, args.tokens // length), length, args, dtype), flush=True)


if __name__ == "__main__":
    main()
