"""BatchTopK (Bussmann et al. 2024): the k*N largest positive pre-activations over a batch of
N tokens, so k per token on average.

Trains as TopK does (FVU + AuxK, sparse kernels). Its inference threshold is an EMA (beta
THRESHOLD_BETA, fp32, autocast off) of the smallest kept activation; at inference and at save
the SAE is a JumpReLU with that threshold (SAELens saves BatchTopK the same way).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor

from assay.sae.architectures.base import register
from assay.sae.architectures.topk import TopK
from assay.sae.kernels import topk_over_batch

if TYPE_CHECKING:
    from assay.sae.model import SparseAutoencoder

THRESHOLD_BETA = 0.99  # BatchTopK threshold EMA: a ~100-step horizon (dictionary_learning: 0.999)


@register
class BatchTopK(TopK):
    """k latents per token on average over the batch; a JumpReLU with one threshold once trained."""

    name = "batchtopk"
    saelens_name = "jumprelu"
    loads_from = ()
    saved_threshold = True
    tracks_min_kept = True
    aux_window_default = None  # a short AuxK window killed latents here (docs/BENCHMARKS.md)

    def select(self, pre: Tensor) -> tuple[Tensor, Tensor]:
        return topk_over_batch(pre, self.cfg.k)

    def encode(self, sae: SparseAutoencoder, pre: Tensor) -> Tensor:
        t = sae.threshold().to(pre.dtype)
        return F.relu(pre) * (pre > t)

    @torch.no_grad()
    def after_step(self, sae: SparseAutoencoder, min_kept: Tensor | None, first: bool) -> None:
        """EMA of the smallest kept activation, in fp32 (the JumpReLU threshold at save)."""
        if min_kept is None:
            return
        value = min_kept.float()
        if first:
            sae.threshold_buf.fill_(value)
        else:
            sae.threshold_buf.mul_(THRESHOLD_BETA).add_((1 - THRESHOLD_BETA) * value)

    def save_fields(self) -> dict:
        return {}
