"""JumpReLU (Rajamanoharan et al. 2024): z = pre * 1[pre > theta], the threshold theta learned
per latent (as SAELens learns it: the parameter is theta, kept >= MIN_THRESHOLD after each step)
through straight-through estimators (rectangle kernel of width jumprelu_bandwidth); loss MSE +
l0_coefficient * L0. Threshold comparisons run in fp32. Saved as SAELens `jumprelu` with
`threshold`."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch.nn.functional as F
from torch import Tensor

from assay.sae.architectures.base import Architecture, register
from assay.sae.kernels import JumpReLUFn

MIN_THRESHOLD = 1e-6

if TYPE_CHECKING:
    from assay.sae.model import SparseAutoencoder


@register
class JumpReLU(Architecture):
    """A learned threshold per latent; sparsity from the L0 penalty."""

    name = "jumprelu"
    saelens_name = "jumprelu"
    loads_from = ("jumprelu",)
    learned_threshold = True
    saved_threshold = True

    def encode(self, sae: SparseAutoencoder, pre: Tensor) -> Tensor:
        t = sae.threshold().to(pre.dtype)
        return F.relu(pre) * (pre > t)

    def fit_codes(self, pre: Tensor) -> Tensor | None:
        return None  # a fixed threshold breaks the linearity the fit relies on

    def sparsity_coefficient(self) -> float:
        return self.cfg.l0_coefficient

    def after_step(self, sae: SparseAutoencoder, min_kept: Tensor | None, first: bool) -> None:
        sae.jumprelu_threshold.clamp_(min=MIN_THRESHOLD)  # a threshold <= 0 would pass negative codes

    def dense_codes(self, sae: SparseAutoencoder, pre: Tensor) -> tuple[Tensor, Tensor]:
        # threshold comparisons against the fp32 threshold (bf16 pre promotes exactly)
        return JumpReLUFn.apply(pre, sae.threshold(), self.cfg.jumprelu_bandwidth)
