"""Autograd kernels shared by the SAE architectures: sparse encode/decode and JumpReLU's
straight-through estimators, plus the flat (token-major) layout of active latents.

Shapes: N tokens, d_in input width, d_sae latents, d_out output width (d_in for an SAE).
TopK-type architectures train through the sparse path (`SparseEncode` + embedding_bag):
the encoder matmul is the only dense product, forward or backward.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor


class SparseCodes(NamedTuple):
    """Active latents as flat lists, token-major: entry i is latent cols[i] of token rows[i]."""

    rows: Tensor  # [nnz] int64, ascending
    cols: Tensor  # [nnz] int64
    vals: Tensor  # [nnz] fp32 activations (>= 0)
    offsets: Tensor  # [N] int64: token n's entries start at offsets[n] (embedding_bag layout)

    def subset(self, keep: Tensor, n: int) -> SparseCodes:
        """The entries where keep [nnz] bool is set (still token-major), for n tokens."""
        rows = self.rows[keep]
        return SparseCodes(rows, self.cols[keep], self.vals[keep], offsets(rows, n))


def offsets(rows: Tensor, n: int) -> Tensor:
    """[n] start of each token's run in ascending `rows` (empty runs allowed)."""
    return torch.searchsorted(rows, torch.arange(n, device=rows.device))


class SparseEncode(torch.autograd.Function):
    """relu(pre[rows, cols]) for selected entries, with a backward that stays sparse.

    pre = (x - b_in) @ W_enc + b_enc, where b_in is b_dec for an SAE and None for a transcoder
    (whose b_dec lives in the output space). `select(pre)` returns (rows, cols, n_gated): the
    first n_gated entries take the ReLU's gradient, the rest (AuxK's revival entries) take it
    straight through. Gradients: b_enc and W_enc only at selected (row, col) pairs; b_in
    through -W_enc @ (column sums of the pre-activation gradient). x gets none (it is data).
    """

    @staticmethod
    def forward(
        ctx: Any, x: Tensor, b_in: Tensor | None, W_enc: Tensor, b_enc: Tensor, select: Callable
    ) -> Any:
        x_c = x - b_in if b_in is not None else x  # [N, d_in]
        pre = torch.addmm(b_enc, x_c, W_enc)  # [N, d_sae]; bf16 under autocast
        rows, cols, n_gated = select(pre)  # [nnz] each
        raw = pre[rows, cols].float()
        vals = raw.clamp_min(0)
        passes = raw > 0
        passes[n_gated:] = True
        ctx.save_for_backward(x_c, W_enc, rows, cols, passes)
        ctx.has_b_in = b_in is not None
        ctx.mark_non_differentiable(rows, cols)
        return vals, rows, cols

    @staticmethod
    def backward(ctx: Any, g_vals: Tensor, *_: Any) -> Any:
        x_c, W_enc, rows, cols, passes = ctx.saved_tensors
        g = (g_vals * passes).to(W_enc.dtype)  # [nnz]
        n, d_sae = x_c.shape[0], W_enc.shape[1]
        grad_b_enc = torch.zeros(d_sae, dtype=W_enc.dtype, device=g.device).index_add_(0, cols, g)
        # grad_W_enc.T = S.T @ x_c with S [N, d_sae] holding g at the selected entries; a
        # sparse x dense product (no sort, no dense [N, d_sae] scratch).
        s_t = torch.sparse_coo_tensor(torch.stack([cols, rows]), g, (d_sae, n), check_invariants=False)
        grad_W_enc_t = torch.sparse.mm(s_t, x_c.to(W_enc.dtype))  # [d_sae, d_in]
        grad_b_in = -(W_enc @ grad_b_enc) if ctx.has_b_in else None  # [d_in]
        return None, grad_b_in, grad_W_enc_t.t(), grad_b_enc, None


class SparseDecode(torch.autograd.Function):
    """sum_i vals[i] * W_dec[cols[i]] per token: embedding_bag forward, sparse backward.

    Backward: grad_W_dec = S.T @ grad_out (sparse x dense) and grad_vals = (grad_out @
    W_dec.T) sampled at the active entries (SDDMM); torch's embedding_bag backward would sort.
    """

    @staticmethod
    def forward(ctx: Any, vals: Tensor, rows: Tensor, cols: Tensor, offsets: Tensor, W_dec: Tensor) -> Tensor:
        ctx.save_for_backward(vals, rows, cols, offsets, W_dec)
        return F.embedding_bag(cols, W_dec, offsets, per_sample_weights=vals, mode="sum")  # [N, d_out]

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> Any:
        vals, rows, cols, offsets, W_dec = ctx.saved_tensors
        grad_out = grad_out.to(W_dec.dtype).contiguous()  # [N, d_out]
        n, nnz = grad_out.shape[0], cols.numel()
        s_t = torch.sparse_coo_tensor(
            torch.stack([cols, rows]), vals.to(W_dec.dtype), (W_dec.shape[0], n), check_invariants=False
        )
        grad_W_dec = torch.sparse.mm(s_t, grad_out)  # [d_sae, d_out]
        crow = torch.cat([offsets, offsets.new_tensor([nnz])])
        zeros = torch.zeros_like(vals, dtype=W_dec.dtype)
        with warnings.catch_warnings():  # torch calls CSR support "beta" on every construction
            warnings.simplefilter("ignore")
            pattern = torch.sparse_csr_tensor(crow, cols, zeros, (n, W_dec.shape[0]), check_invariants=False)
        grad_vals = torch.sparse.sampled_addmm(pattern, grad_out, W_dec.t(), beta=0.0).values()  # [nnz]
        return grad_vals.to(vals.dtype), None, None, None, grad_W_dec


class JumpReLUFn(torch.autograd.Function):
    """(z, L0) = (pre * 1[pre > t], mean over tokens of the latents with pre > t), with the
    straight-through threshold gradients of Rajamanoharan et al. 2024 (rectangle kernel of width
    `bandwidth`): dz/dt = -(t / bandwidth) and d1[pre > t]/dt = -1 / bandwidth inside the window
    |pre - t| < bandwidth / 2. One function for both, so the [N, d_sae] mask and window are formed
    once each way and nothing is cast: z keeps pre's dtype, the comparisons promote to fp32 (t)."""

    @staticmethod
    def forward(ctx: Any, pre: Tensor, threshold: Tensor, bandwidth: float) -> tuple[Tensor, Tensor]:
        active = pre > threshold  # [N, d_sae] bool
        ctx.save_for_backward(pre, threshold, active)
        ctx.bandwidth = bandwidth
        z = pre * active  # a multiply by the bool mask: faster than torch.where on CPU
        return z, torch.count_nonzero(active).float() / pre.shape[0]

    @staticmethod
    def backward(ctx: Any, grad_z: Tensor, grad_l0: Tensor) -> Any:
        pre, t, active = ctx.saved_tensors
        window = (pre - t).abs_() < ctx.bandwidth / 2  # [N, d_sae] bool
        through = (grad_z * window).sum(0, dtype=torch.float32)
        grad_t = (
            -(t * through + window.sum(0, dtype=torch.float32) * (grad_l0 / pre.shape[0])) / ctx.bandwidth
        )
        return grad_z * active, grad_t, None


def column_totals(z: Tensor) -> Tensor:
    """[d_sae] fp32 sums over tokens of z [N, d_sae]. fp32: a matrix-vector product, about twice
    as fast on CPU as a reduction over the rows; other dtypes: a reduction accumulated in fp32
    (a product in z's dtype would round the totals)."""
    if z.dtype == torch.float32:
        return z.new_ones(z.shape[0]) @ z
    return z.sum(0, dtype=torch.float32)


def firing_counts(z: Tensor) -> Tensor:
    """[d_sae] int64: tokens on which each latent fires, for codes z [N, d_sae] >= 0 (every
    architecture's). fp32: the totals of sign(z), exact below 2^24 tokens and about twice as fast
    as summing the bool mask as bytes, which other dtypes do."""
    if z.dtype == torch.float32:
        return column_totals(torch.sign(z)).long()
    return (z > 0).view(torch.uint8).sum(0, dtype=torch.int32).long()


class ReLUL1Fn(torch.autograd.Function):
    """(z, penalty) = (relu(pre), mean over tokens of sum_j z_j * norms_j): ReLU and its L1 penalty
    weighed by the decoder row norms, in one function. The penalty is read from the per-latent
    column sums (fp32 accumulation, also the norms' gradient), so no [N, d_sae] product is
    formed either way; the backward adds the penalty's constant row and masks once. z keeps
    pre's dtype; norms are fp32."""

    @staticmethod
    def forward(ctx: Any, pre: Tensor, norms: Tensor) -> tuple[Tensor, Tensor]:
        z = F.relu(pre)
        column_sums = column_totals(z)  # [d_sae] fp32
        ctx.save_for_backward(z, norms, column_sums)
        return z, column_sums.dot(norms.float()) / pre.shape[0]

    @staticmethod
    def backward(ctx: Any, grad_z: Tensor, grad_penalty: Tensor) -> Any:
        z, norms, column_sums = ctx.saved_tensors
        per_token = grad_penalty / z.shape[0]
        row = (per_token * norms).to(grad_z.dtype)  # d penalty / d z[n, j], the same for every n
        grad_pre = torch.ops.aten.threshold_backward(grad_z + row, z, 0)  # 0 where z = 0
        return grad_pre, (per_token * column_sums).to(norms.dtype)


def topk_per_token(pre: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """(rows, cols) of the k largest entries of each row of pre [N, d_sae], token-major."""
    n = pre.shape[0]
    idx = pre.topk(k, dim=-1, sorted=False).indices  # [N, k]
    rows = torch.arange(n, device=pre.device).repeat_interleave(k)
    return rows, idx.reshape(-1)


def topk_over_batch(pre: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """(rows, cols) of the k*N largest positive entries of pre [N, d_sae], token-major.

    A top-(k*N) over all N * d_sae entries is one selection over the whole batch: 14-31% of a
    BatchTopK step's time on the CPU (docs/BENCHMARKS.md). So the selection runs on a few
    candidates instead: every entry at or above a threshold read from a strided sample,
    set low enough that the candidates hold the k*N largest (checked: else a lower threshold,
    and at last the whole batch). The result is the same selection (ties at the boundary may
    be broken otherwise, as topk breaks them arbitrarily too).
    """
    n, d_sae = pre.shape
    flat = pre.reshape(-1)
    m = min(k * n, flat.numel())
    cand = _batch_candidates(flat, m, d_sae)
    if cand is None:
        idx = flat.topk(m, sorted=False).indices
    else:
        idx = cand[flat[cand].topk(m, sorted=False).indices] if len(cand) > m else cand
    idx = idx[flat[idx] > 0].sort().values
    return idx // d_sae, idx % d_sae


SAMPLE = 1 << 16  # entries sampled to place the candidates' threshold


def _batch_candidates(flat: Tensor, m: int, d_sae: int) -> Tensor | None:
    """Indices of a superset of flat's m largest entries, about 2m of them, or None where
    sampling does not pay (a small batch, or m a large share of it)."""
    total = flat.numel()
    if total < 16 * SAMPLE or m * 8 > total:
        return None
    stride = total // SAMPLE
    while math.gcd(stride, d_sae) != 1:  # a stride sharing a factor with d_sae skips latents
        stride += 1
    sample = flat[::stride]
    rank = len(sample) * m / total  # the sample's expected count above the m-th largest
    for margin in (2.0, 8.0):  # ~2m candidates; the wider margin almost never runs
        r = min(len(sample), int(rank * margin) + 64)
        threshold = sample.topk(r, sorted=False).values.min()
        cand = (flat >= threshold).nonzero().squeeze(1)
        if len(cand) >= m:  # so the m-th largest is >= threshold: every one of the m is here
            return cand
    return None


def relu_straight_through(v: Tensor) -> Tensor:
    """relu(v) forward, the identity's gradient backward (AuxK's revival entries)."""
    return v + (v.clamp_min(0) - v).detach()


def select_aux(pre: Tensor, dead: Tensor, k_aux: int) -> tuple[Tensor, Tensor]:
    """(rows, cols) of the k_aux largest pre-activations among dead latents, per token."""
    dead_idx = dead.nonzero().squeeze(1)  # [n_dead]
    idx = pre[:, dead_idx].topk(k_aux, dim=-1, sorted=False).indices  # [N, k_aux]
    rows = torch.arange(pre.shape[0], device=pre.device).repeat_interleave(k_aux)
    return rows, dead_idx[idx.reshape(-1)]
