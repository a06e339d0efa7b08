"""Sparse autoencoders: ReLU + L1, TopK, BatchTopK and JumpReLU in one module.

Shapes: N tokens, d_in activation width, d_sae latents.
  W_enc [d_in, d_sae], b_enc [d_sae], W_dec [d_sae, d_in], b_dec [d_in]
  pre = (x - b_dec) @ W_enc + b_enc          [N, d_sae]
  z = sparsify(pre) (architecture-specific)  [N, d_sae] (or sparse codes, see SparseCodes)
  x_hat = z @ W_dec + b_dec                   [N, d_in]

The SAE trains on activations scaled by `act_scale` (so their mean norm is sqrt(d_in));
`reconstruct` takes raw activations, and `folded()` bakes the scale into the weights for
saving. TopK/BatchTopK train through a sparse path (`_SparseEncode` + embedding_bag): the
encoder matmul is the only dense product, forward or backward.
"""

from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from assay.sae.config import SaeArchConfig

THRESHOLD_BETA = 0.99  # BatchTopK threshold EMA: a ~100-step horizon (dictionary_learning: 0.999)


class SparseCodes(NamedTuple):
    """Active latents as flat lists, token-major: entry i is latent cols[i] of token rows[i]."""

    rows: Tensor  # [nnz] int64, ascending
    cols: Tensor  # [nnz] int64
    vals: Tensor  # [nnz] fp32 activations (>= 0)
    offsets: Tensor  # [N] int64: token n's entries start at offsets[n] (embedding_bag layout)


@dataclass
class TrainOutput:
    """What one training forward produces (losses are scalars, autograd-connected)."""

    loss: Tensor
    x_hat: Tensor  # [N, d_in] reconstruction (normalised space)
    mse: Tensor  # sum over d_in, mean over tokens
    sparsity: Tensor  # L1 (relu) / L0 (jumprelu) penalty before its coefficient; 0 otherwise
    aux: Tensor  # AuxK loss before its coefficient
    counts: Tensor  # [d_sae] int64: tokens of the batch on which each latent is active
    l0: Tensor  # [] mean active latents per token (fp32, detached)
    min_kept: Tensor | None = None  # BatchTopK: smallest kept activation (threshold update)


def _offsets(rows: Tensor, n: int) -> Tensor:
    """[n] start of each token's run in ascending `rows` (empty runs allowed)."""
    return torch.searchsorted(rows, torch.arange(n, device=rows.device))


class _SparseEncode(torch.autograd.Function):
    """relu(pre[rows, cols]) for selected entries, with a backward that stays sparse.

    Gradients: b_enc and W_enc only at selected (row, col) pairs; b_dec through
    -W_enc @ (column sums of the pre-activation gradient). x gets none (it is data).
    """

    @staticmethod
    def forward(ctx: Any, x: Tensor, b_dec: Tensor, W_enc: Tensor, b_enc: Tensor, select: Callable) -> Any:
        x_c = x - b_dec  # [N, d_in]
        pre = torch.addmm(b_enc, x_c, W_enc)  # [N, d_sae]; bf16 under autocast
        rows, cols = select(pre)  # [nnz] each
        raw = pre[rows, cols].float()
        vals = raw.clamp_min(0)
        ctx.save_for_backward(x_c, W_enc, rows, cols, raw > 0)
        ctx.mark_non_differentiable(rows, cols)
        return vals, rows, cols

    @staticmethod
    def backward(ctx: Any, g_vals: Tensor, *_: Any) -> Any:
        x_c, W_enc, rows, cols, positive = ctx.saved_tensors
        g = (g_vals * positive).to(W_enc.dtype)  # [nnz]
        n, d_sae = x_c.shape[0], W_enc.shape[1]
        grad_b_enc = torch.zeros(d_sae, dtype=W_enc.dtype, device=g.device).index_add_(0, cols, g)
        # grad_W_enc.T = S.T @ x_c with S [N, d_sae] holding g at the selected entries; a
        # sparse x dense product (no sort, no dense [N, d_sae] scratch).
        s_t = torch.sparse_coo_tensor(torch.stack([cols, rows]), g, (d_sae, n), check_invariants=False)
        grad_W_enc_t = torch.sparse.mm(s_t, x_c.to(W_enc.dtype))  # [d_sae, d_in]
        grad_b_dec = -(W_enc @ grad_b_enc)  # [d_in]
        return None, grad_b_dec, grad_W_enc_t.t(), grad_b_enc, None


class _SparseDecode(torch.autograd.Function):
    """sum_i vals[i] * W_dec[cols[i]] per token: embedding_bag forward, sparse backward.

    Backward: grad_W_dec = S.T @ grad_out (sparse x dense) and grad_vals = (grad_out @
    W_dec.T) sampled at the active entries (SDDMM); torch's embedding_bag backward would sort.
    """

    @staticmethod
    def forward(ctx: Any, vals: Tensor, rows: Tensor, cols: Tensor, offsets: Tensor, W_dec: Tensor) -> Tensor:
        ctx.save_for_backward(vals, rows, cols, offsets, W_dec)
        return F.embedding_bag(cols, W_dec, offsets, per_sample_weights=vals, mode="sum")  # [N, d_in]

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> Any:
        vals, rows, cols, offsets, W_dec = ctx.saved_tensors
        grad_out = grad_out.to(W_dec.dtype).contiguous()  # [N, d_in]
        n, nnz = grad_out.shape[0], cols.numel()
        s_t = torch.sparse_coo_tensor(
            torch.stack([cols, rows]), vals.to(W_dec.dtype), (W_dec.shape[0], n), check_invariants=False
        )
        grad_W_dec = torch.sparse.mm(s_t, grad_out)  # [d_sae, d_in]
        crow = torch.cat([offsets, offsets.new_tensor([nnz])])
        zeros = torch.zeros_like(vals, dtype=W_dec.dtype)
        with warnings.catch_warnings():  # torch calls CSR support "beta" on every construction
            warnings.simplefilter("ignore")
            pattern = torch.sparse_csr_tensor(crow, cols, zeros, (n, W_dec.shape[0]), check_invariants=False)
        grad_vals = torch.sparse.sampled_addmm(pattern, grad_out, W_dec.t(), beta=0.0).values()  # [nnz]
        return grad_vals.to(vals.dtype), None, None, None, grad_W_dec


class _JumpReLU(torch.autograd.Function):
    """pre * (pre > t) with a straight-through threshold gradient (Rajamanoharan et al. 2024)."""

    @staticmethod
    def forward(ctx: Any, pre: Tensor, threshold: Tensor, bandwidth: float) -> Tensor:
        ctx.save_for_backward(pre, threshold)
        ctx.bandwidth = bandwidth
        return pre * (pre > threshold)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Any:
        pre, t = ctx.saved_tensors
        window = ((pre - t).abs() < ctx.bandwidth / 2).to(grad.dtype)  # rectangle kernel
        grad_t = (-(t / ctx.bandwidth) * window * grad).sum(0)
        return grad * (pre > t), grad_t, None


class _Step(torch.autograd.Function):
    """Heaviside(pre - t) (the L0 count) with the same straight-through threshold gradient."""

    @staticmethod
    def forward(ctx: Any, pre: Tensor, threshold: Tensor, bandwidth: float) -> Tensor:
        ctx.save_for_backward(pre, threshold)
        ctx.bandwidth = bandwidth
        return (pre > threshold).to(pre.dtype)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Any:
        pre, t = ctx.saved_tensors
        window = ((pre - t).abs() < ctx.bandwidth / 2).to(grad.dtype)
        return None, (-(1.0 / ctx.bandwidth) * window * grad).sum(0), None


class SparseAutoencoder(nn.Module):
    """An SAE of any supported architecture; parameters always fp32."""

    act_scale: Tensor  # [] buffer: raw activations * act_scale = training scale
    threshold_buf: Tensor  # [d_sae] buffer: BatchTopK's inference threshold
    log_threshold: nn.Parameter  # [d_sae] (jumprelu only)

    def __init__(self, d_in: int, d_sae: int, arch: SaeArchConfig):
        super().__init__()
        self.d_in, self.d_sae, self.arch = d_in, d_sae, arch
        self.W_enc = nn.Parameter(torch.empty(d_in, d_sae))
        self.b_enc = nn.Parameter(torch.zeros(d_sae))
        self.W_dec = nn.Parameter(torch.empty(d_sae, d_in))
        self.b_dec = nn.Parameter(torch.zeros(d_in))
        if arch.architecture == "jumprelu":
            self.log_threshold = nn.Parameter(torch.full((d_sae,), math.log(arch.jumprelu_init_threshold)))
        self.register_buffer("threshold_buf", torch.zeros(d_sae))  # batchtopk at inference
        self.register_buffer("act_scale", torch.ones(()))  # raw activation -> training scale
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Decoder rows in random directions, of norm 1 (unit) or decoder_init_norm (small);
        the encoder is the decoder's transpose. `fit_encoder_scale` then sets the unit start's
        output scale from data."""
        with torch.no_grad():
            w = torch.randn(self.d_sae, self.d_in)
            norm = 1.0 if self.arch.unit_decoder else self.arch.decoder_init_norm
            w *= norm / w.norm(dim=1, keepdim=True)
            self.W_dec.copy_(w)
            self.W_enc.copy_(w.t())

    @torch.no_grad()
    def fit_encoder_scale(self, x: Tensor) -> float:
        """Unit start (not jumprelu): scale W_enc so the reconstruction of x [N, d_in]
        (normalised) has the least-squares scale; returns the factor (1.0 otherwise).

        With b_enc = 0 the kept latents do not depend on W_enc's scale c and x_hat - b_dec is
        linear in c, so c = <x - b_dec, y> / <y, y> with y the reconstruction at c = 1. A
        transpose of unit rows alone over-shoots (k latents each carrying their full projection)
        and the first Adam steps would be spent shrinking it.
        """
        a = self.arch.architecture
        if not self.arch.unit_decoder or a == "jumprelu":  # a fixed threshold breaks the linearity
            return 1.0
        x = x.float()
        pre = self.pre_acts(x)  # [N, d_sae]
        z = F.relu(pre)
        if a in ("topk", "batchtopk"):
            rows, cols = select_active(pre, a, self.arch.k)
            z = torch.zeros_like(pre).index_put_((rows, cols), z[rows, cols])
        y, target = z @ self.W_dec, x - self.b_dec  # [N, d_in] each
        c = float((target * y).sum() / (y * y).sum().clamp_min(1e-12))
        c = c if math.isfinite(c) and c > 0 else 1.0  # no kept latent: leave the start as is
        self.W_enc.mul_(c)
        return c

    @torch.no_grad()
    def project_decoder_grad_(self) -> None:
        """Unit decoder: remove each row's gradient component along the row (fp32, in place), so
        a step moves rows on the sphere to first order; `normalise_decoder_` removes the rest."""
        g = self.W_dec.grad
        if not self.arch.unit_decoder or g is None:
            return
        w = self.W_dec.detach()
        g -= (g * w).sum(1, keepdim=True) * w / w.pow(2).sum(1, keepdim=True).clamp_min(1e-12)

    @torch.no_grad()
    def normalise_decoder_(self) -> None:
        """Unit decoder: rows back to norm 1 after an optimizer step (fp32, in place)."""
        if self.arch.unit_decoder:
            self.W_dec.div_(self.W_dec.norm(dim=1, keepdim=True).clamp_min(1e-12))

    @property
    def aux_k(self) -> int:
        return self.arch.aux_k or self.arch.k

    def threshold(self) -> Tensor:
        """[d_sae] JumpReLU threshold (learned) or BatchTopK's inference threshold."""
        if self.arch.architecture == "jumprelu":
            return self.log_threshold.exp()
        return self.threshold_buf

    # ---- inference (dense codes) -------------------------------------------------
    def pre_acts(self, x: Tensor) -> Tensor:
        """[N, d_sae] encoder pre-activations of normalised activations x [N, d_in]."""
        return torch.addmm(self.b_enc, x - self.b_dec, self.W_enc)

    def encode(self, x: Tensor) -> Tensor:
        """[N, d_sae] latent activations. BatchTopK encodes with its threshold, as saved."""
        pre = self.pre_acts(x)
        a = self.arch.architecture
        if a == "relu":
            return F.relu(pre)
        if a == "topk":
            vals, idx = pre.topk(self.arch.k, dim=-1)
            return torch.zeros_like(pre).scatter_(-1, idx, F.relu(vals))
        t = self.threshold().to(pre.dtype)
        return F.relu(pre) * (pre > t)

    def decode(self, z: Tensor) -> Tensor:
        return z @ self.W_dec + self.b_dec

    def forward(self, x: Tensor) -> Tensor:
        """Reconstruction of normalised activations."""
        return self.decode(self.encode(x))

    @torch.no_grad()
    def reconstruct(self, x_raw: Tensor) -> Tensor:
        """Reconstruction of raw activations [..., d_in] (normalisation applied and undone)."""
        shape = x_raw.shape
        x = x_raw.reshape(-1, self.d_in).float() * self.act_scale
        return (self.forward(x) / self.act_scale).reshape(shape).to(x_raw.dtype)

    def folded(self) -> SparseAutoencoder:
        """A copy working on raw activations: act_scale folded into the weights (pre unchanged)."""
        out = copy.deepcopy(self)
        s = float(self.act_scale)
        with torch.no_grad():
            out.W_enc.mul_(s)
            out.W_dec.div_(s)
            out.b_dec.div_(s)
            out.act_scale.fill_(1.0)
        return out

    # ---- training ----------------------------------------------------------------
    def train_forward(self, x: Tensor, dead: Tensor | None, sparsity_coef: float) -> TrainOutput:
        """Losses on a batch x [N, d_in] (normalised). dead [d_sae] bool selects AuxK latents."""
        sparse = self.arch.sparse_kernels and self.arch.architecture in ("topk", "batchtopk")
        return self._sparse_forward(x, dead) if sparse else self._dense_forward(x, dead, sparsity_coef)

    def _sparse_forward(self, x: Tensor, dead: Tensor | None) -> TrainOutput:
        n_dead = int(dead.sum()) if dead is not None and self.arch.aux_coefficient > 0 else 0
        select = _Selector(self.arch.architecture, self.arch.k, dead, min(self.aux_k, n_dead))
        vals, rows, cols = _SparseEncode.apply(x, self.b_dec, self.W_enc, self.b_enc, select)
        m = select.n_main
        codes = SparseCodes(rows[:m], cols[:m], vals[:m], _offsets(rows[:m], len(x)))
        x_hat = self.decode_sparse(codes) + self.b_dec
        aux_codes = None
        if m < rows.numel():
            aux_codes = SparseCodes(rows[m:], cols[m:], vals[m:], _offsets(rows[m:], len(x)))
        return self._losses(x, x_hat, codes, aux_codes, dead)

    def decode_sparse(self, codes: SparseCodes) -> Tensor:
        """[N, d_in] sum of vals * W_dec[cols] per token (no bias), as one embedding_bag."""
        return _SparseDecode.apply(codes.vals, codes.rows, codes.cols, codes.offsets, self.W_dec)

    def _dense_forward(self, x: Tensor, dead: Tensor | None, sparsity_coef: float) -> TrainOutput:
        pre = self.pre_acts(x)  # [N, d_sae]
        a = self.arch.architecture
        sparsity = x.new_zeros(())
        if a == "jumprelu":
            pre32, t = pre.float(), self.threshold()  # threshold comparisons in fp32
            z = _JumpReLU.apply(pre32, t, self.arch.jumprelu_bandwidth)
            sparsity = _Step.apply(pre32, t, self.arch.jumprelu_bandwidth).sum(-1).mean()
        elif a == "relu":
            z = F.relu(pre)
            sparsity = (z.float() * self.W_dec.norm(dim=1)).sum(-1).mean()
        else:
            rows, cols = select_active(pre.detach(), a, self.arch.k)
            mask = torch.zeros_like(pre, dtype=torch.bool)
            mask[rows, cols] = True
            z = F.relu(pre) * mask
        x_hat = self.decode(z.to(pre.dtype))
        aux_codes = None
        if a in ("topk", "batchtopk") and dead is not None and int(dead.sum()) > 0:
            if self.arch.aux_coefficient > 0:
                r, c = select_aux(pre.detach(), dead, min(self.aux_k, int(dead.sum())))
                aux_codes = SparseCodes(r, c, F.relu(pre[r, c].float()), _offsets(r, len(x)))
        out = self._losses(x, x_hat.float(), None, aux_codes, dead, z)
        out.loss = out.loss + sparsity_coef * sparsity
        out.sparsity = sparsity
        return out

    def _losses(
        self,
        x: Tensor,
        x_hat: Tensor,
        codes: SparseCodes | None,
        aux_codes: SparseCodes | None,
        dead: Tensor | None,
        z: Tensor | None = None,
    ) -> TrainOutput:
        """MSE (relu/jumprelu) or FVU (topk/batchtopk, as in Gao et al.) plus AuxK."""
        err = (x_hat - x).float()
        mse = err.pow(2).sum(-1).mean()
        total_var = (x - x.mean(0)).float().pow(2).sum(-1).mean().clamp_min(1e-12)
        aux = x.new_zeros((), dtype=torch.float32)
        if aux_codes is not None and dead is not None:
            e_hat = self.decode_sparse(aux_codes)  # predicts the residual from dead latents
            scale = min(int(dead.sum()) / self.aux_k, 1.0)
            aux = scale * (e_hat - (x - x_hat).detach().float()).pow(2).sum(-1).mean() / total_var
        if self.arch.architecture in ("topk", "batchtopk"):
            loss = mse / total_var + self.arch.aux_coefficient * aux
        else:
            loss = mse
        counts, l0, min_kept = self._activity(codes, z)
        return TrainOutput(loss, x_hat.detach(), mse, x.new_zeros(()), aux, counts, l0, min_kept)

    def _activity(self, codes: SparseCodes | None, z: Tensor | None) -> tuple[Tensor, Tensor, Tensor | None]:
        """Per-latent firing counts, L0, and (BatchTopK) the smallest kept positive activation."""
        kept: Tensor | None
        with torch.no_grad():
            if codes is not None:
                active = codes.vals > 0
                counts = torch.bincount(codes.cols[active], minlength=self.d_sae)
                l0 = active.sum().float() / len(codes.offsets)
                kept = codes.vals[active]
            else:
                assert z is not None
                active_mask = z > 0
                counts = active_mask.sum(0)
                l0 = active_mask.sum(-1).float().mean()
                kept = z[active_mask].float() if self.arch.architecture == "batchtopk" else None
            min_kept = kept.min() if kept is not None and kept.numel() else None
        return counts, l0, min_kept

    @torch.no_grad()
    def update_threshold(self, min_kept: Tensor | None, first: bool) -> None:
        """BatchTopK: EMA of the smallest kept activation, in fp32 (the JumpReLU threshold at save)."""
        if self.arch.architecture != "batchtopk" or min_kept is None:
            return
        value = min_kept.float()
        if first:
            self.threshold_buf.fill_(value)
        else:
            self.threshold_buf.mul_(THRESHOLD_BETA).add_((1 - THRESHOLD_BETA) * value)


class _Selector:
    """Selection rule run inside `_SparseEncode`: main entries, then AuxK entries (if any).

    `n_main` tells the caller where the main entries end in the concatenated output.
    """

    def __init__(self, architecture: str, k: int, dead: Tensor | None, k_aux: int):
        self.architecture, self.k, self.dead, self.k_aux = architecture, k, dead, k_aux
        self.n_main = 0

    def __call__(self, pre: Tensor) -> tuple[Tensor, Tensor]:
        rows, cols = select_active(pre.detach(), self.architecture, self.k)
        self.n_main = rows.numel()
        if self.k_aux == 0 or self.dead is None:
            return rows, cols
        a_rows, a_cols = select_aux(pre.detach(), self.dead, self.k_aux)
        return torch.cat([rows, a_rows]), torch.cat([cols, a_cols])


def select_active(pre: Tensor, architecture: str, k: int) -> tuple[Tensor, Tensor]:
    """(rows, cols) of the kept latents, token-major. pre [N, d_sae] is detached.

    topk: the k largest per token. batchtopk: the k*N largest positive ones in the batch.
    """
    n, d_sae = pre.shape
    if architecture == "topk":
        idx = pre.topk(k, dim=-1, sorted=False).indices  # [N, k]
        rows = torch.arange(n, device=pre.device).repeat_interleave(k)
        return rows, idx.reshape(-1)
    flat = F.relu(pre).reshape(-1)
    idx = flat.topk(min(k * n, flat.numel()), sorted=False).indices
    idx = idx[flat[idx] > 0].sort().values
    return idx // d_sae, idx % d_sae


def select_aux(pre: Tensor, dead: Tensor, k_aux: int) -> tuple[Tensor, Tensor]:
    """(rows, cols) of the k_aux largest pre-activations among dead latents, per token."""
    dead_idx = dead.nonzero().squeeze(1)  # [n_dead]
    idx = pre[:, dead_idx].topk(k_aux, dim=-1, sorted=False).indices  # [N, k_aux]
    rows = torch.arange(pre.shape[0], device=pre.device).repeat_interleave(k_aux)
    return rows, dead_idx[idx.reshape(-1)]
