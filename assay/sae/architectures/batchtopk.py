"""BatchTopK (Bussmann et al. 2024): the k*N largest positive pre-activations over a batch of
N tokens, so k per token on average.

Trains as TopK does (FVU + AuxK, sparse kernels). At inference and at save the SAE is a
JumpReLU with one threshold (SAELens saves BatchTopK the same way): while training, an EMA (beta
THRESHOLD_BETA, fp32, autocast off) of the smallest kept activation; for evaluations and the
trained SAE, that smallest activation on a batch at the evaluated weights
(`assay.sae.loop.calibrate_threshold`). The EMA lags the weights: it starts at the first batch's
value, which still carries 0.99^100 = 37% of its weight after 100 steps, while the kept
activations fall as the SAE trains (0.65 against 0.44 after 100 steps on assay-tiny, so L0 22
for k = 32; docs/BENCHMARKS.md).
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
    aux_window_default = 16_384  # as topk: 3.4% dead instead of 15.8% after 100 (docs/BENCHMARKS.md)
    # twice topk's: a lower FVU on LM activations from 30 to 256 steps and more true features
    # recovered on synthetic ones (docs/BENCHMARKS.md, "The encoder's step per architecture")
    signum_encoder_step = 2**0.5

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

    @torch.no_grad()
    def kept_minimum(self, sae: SparseAutoencoder, x: Tensor) -> Tensor | None:
        pre = sae.pre_acts(x).float()
        rows, cols = self.select(pre)
        return pre[rows, cols].min() if len(rows) else None

    def save_fields(self) -> dict:
        return {}
