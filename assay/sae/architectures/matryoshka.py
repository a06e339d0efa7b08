"""Matryoshka BatchTopK (Bussmann et al. 2025; SAELens's `matryoshka_batchtopk`).

Latents are nested prefixes of widths w_1 < ... < w_m = d_sae. BatchTopK picks the active
latents over the whole dictionary; each prefix must reconstruct the input on its own:
x_hat_i = z[:, :w_i] @ W_dec[:w_i] + b_dec. Loss: (sum over levels of ||x - x_hat_i||^2) over
the batch's variance + AuxK on the full residual (SAELens: the outer MSE plus every inner MSE,
unnormalised). Early latents learn general, frequent features and absorb fewer of their
children. Saved as SAELens saves it: a JumpReLU with the BatchTopK threshold.

The prefixes are decoded as disjoint slices whose partial sums give every level, so the sparse
decode costs what one full decode does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from assay.sae.architectures.base import TrainOutput, register
from assay.sae.architectures.batchtopk import BatchTopK
from assay.sae.kernels import SparseCodes

if TYPE_CHECKING:
    from assay.sae.model import SparseAutoencoder

DEFAULT_LEVELS = 5  # d_sae / 16, / 8, / 4, / 2, d_sae


def level_widths(widths: list[int] | None, d_sae: int) -> list[int]:
    """The strictly increasing level widths, ending at d_sae (added when missing).

    Default: d_sae / 2^j for j = DEFAULT_LEVELS - 1 .. 0 (rounded down, duplicates dropped).
    """
    if not widths:
        widths = [d_sae >> j for j in range(DEFAULT_LEVELS - 1, -1, -1)]
    out = sorted({w for w in widths if 0 < w < d_sae}) + [d_sae]
    return out


@register
class MatryoshkaBatchTopK(BatchTopK):
    """BatchTopK trained with nested reconstruction losses over prefixes of the latents."""

    name = "matryoshka"

    def widths(self, d_sae: int) -> list[int]:
        return level_widths(self.cfg.matryoshka_widths, d_sae)

    def sparse_forward(
        self, sae: SparseAutoencoder, x: Tensor, target: Tensor, dead: Tensor | None
    ) -> TrainOutput:
        codes, aux_codes = self.sparse_encode(sae, x, dead)
        recon: Tensor = sae.b_dec
        inner = target.new_zeros((), dtype=torch.float32)
        start = 0
        widths = self.widths(sae.d_sae)
        for i, width in enumerate(widths):
            part = codes.subset((codes.cols >= start) & (codes.cols < width), len(x))
            recon = recon + sae.decode_sparse(part)  # [N, d_out] level i's reconstruction
            if i < len(widths) - 1:
                inner = inner + (recon.float() - target.float()).pow(2).sum(-1).mean()
            start = width
        return self.losses(sae, target, recon, codes, aux_codes, dead, extra_mse=inner)

    def dense_forward(
        self, sae: SparseAutoencoder, x: Tensor, target: Tensor, dead: Tensor | None, coef: float
    ) -> TrainOutput:
        pre = sae.pre_acts(x)  # [N, d_sae]
        z, sparsity = self.dense_codes(sae, pre)
        z = z.to(pre.dtype)
        recon: Tensor = sae.b_dec
        inner, start = target.new_zeros((), dtype=torch.float32), 0
        widths = self.widths(sae.d_sae)
        for i, width in enumerate(widths):
            recon = recon + z[:, start:width] @ sae.W_dec[start:width]  # [N, d_out]
            if i < len(widths) - 1:
                inner = inner + (recon.float() - target.float()).pow(2).sum(-1).mean()
            start = width
        aux_codes: SparseCodes | None = self.dense_aux(sae, pre, dead)
        out = self.losses(sae, target, recon.float(), None, aux_codes, dead, z, extra_mse=inner)
        out.sparsity = sparsity
        return out

    def save_fields(self) -> dict[str, Any]:
        return {}
