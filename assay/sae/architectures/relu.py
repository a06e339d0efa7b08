"""ReLU + L1 ("standard"): z = ReLU(pre); loss MSE + l1_coefficient * sum_j z_j * |W_dec row j|
(the penalty weighs activations by their decoder norms, so shrinking rows cannot dodge it).
Saved as SAELens `standard`."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch.nn.functional as F
from torch import Tensor

from assay.sae.architectures.base import Architecture, register
from assay.sae.kernels import ReLUL1Fn

if TYPE_CHECKING:
    from assay.sae.model import SparseAutoencoder


@register
class ReLU(Architecture):
    """Every positive pre-activation; sparsity from the L1 penalty."""

    name = "relu"
    saelens_name = "standard"
    loads_from = ("standard",)

    def encode(self, sae: SparseAutoencoder, pre: Tensor) -> Tensor:
        return F.relu(pre)

    def sparsity_coefficient(self) -> float:
        return self.cfg.l1_coefficient

    def dense_codes(self, sae: SparseAutoencoder, pre: Tensor) -> tuple[Tensor, Tensor]:
        return ReLUL1Fn.apply(pre, sae.W_dec.norm(dim=1))
