"""TopK (Gao et al. 2024): the k largest pre-activations of each token, ReLU'd.

Loss: FVU (squared error over the batch's variance) + aux_coefficient * AuxK, where AuxK lets
latents silent for the AuxK window reconstruct the residual. Trains through the sparse
kernels (assay/sae/kernels.py) unless --no-sparse_kernels. Saved as SAELens `topk` with `k`.
BatchTopK and Matryoshka BatchTopK build on this file.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from assay.core.errors import AssayError
from assay.sae.architectures.base import Architecture, TrainOutput, register
from assay.sae.kernels import (
    SparseCodes,
    SparseEncode,
    offsets,
    relu_straight_through,
    select_aux,
    topk_per_token,
)

if TYPE_CHECKING:
    from assay.sae.model import SparseAutoencoder


class Selector:
    """Selection rule run inside `SparseEncode`: main entries, then AuxK entries (if any).

    Returns (rows, cols, n_gated): AuxK's entries come after the main ones and, with
    `aux_straight_through`, take the ReLU's gradient straight through (`SparseEncode`).
    `n_main` tells the caller where the main entries end in the concatenated output.
    """

    def __init__(self, arch: TopK, dead: Tensor | None, k_aux: int):
        self.arch, self.dead, self.k_aux = arch, dead, k_aux
        self.n_main = 0

    def __call__(self, pre: Tensor) -> tuple[Tensor, Tensor, int]:
        rows, cols = self.arch.select(pre.detach())
        self.n_main = rows.numel()
        if self.k_aux == 0 or self.dead is None:
            return rows, cols, self.n_main
        a_rows, a_cols = select_aux(pre.detach(), self.dead, self.k_aux)
        n_gated = self.n_main if self.arch.cfg.aux_straight_through else self.n_main + a_rows.numel()
        return torch.cat([rows, a_rows]), torch.cat([cols, a_cols]), n_gated


@register
class TopK(Architecture):
    """Exactly k latents per token."""

    name = "topk"
    saelens_name = "topk"
    keeps_k = True
    loads_from: ClassVar[tuple[str, ...]] = ("topk",)
    unit_decoder_default = True
    normalised_loss = True
    aux_window_default: ClassVar[int | None] = (
        16_384  # 4 batches: 2.1% dead instead of 13.6% after 100 (docs/BENCHMARKS.md)
    )

    def select(self, pre: Tensor) -> tuple[Tensor, Tensor]:
        """(rows, cols) of the kept latents of pre [N, d_sae] (detached), token-major."""
        return topk_per_token(pre, self.cfg.k)

    def encode(self, sae: SparseAutoencoder, pre: Tensor) -> Tensor:
        vals, idx = pre.topk(self.cfg.k, dim=-1)
        return torch.zeros_like(pre).scatter_(-1, idx, F.relu(vals))

    def fit_codes(self, pre: Tensor) -> Tensor | None:
        rows, cols = self.select(pre)
        return torch.zeros_like(pre).index_put_((rows, cols), F.relu(pre)[rows, cols])

    # ---- training ----------------------------------------------------------------
    def train_forward(
        self, sae: SparseAutoencoder, x: Tensor, target: Tensor, dead: Tensor | None, coef: float
    ) -> TrainOutput:
        if self.cfg.sparse_kernels:
            return self.sparse_forward(sae, x, target, dead)
        return self.dense_forward(sae, x, target, dead, coef)

    def sparse_encode(
        self, sae: SparseAutoencoder, x: Tensor, dead: Tensor | None
    ) -> tuple[SparseCodes, SparseCodes | None]:
        """(main codes, AuxK codes or None) of x [N, d_in], through the sparse kernels."""
        n_dead = int(dead.sum()) if dead is not None and self.cfg.aux_coefficient > 0 else 0
        select = Selector(self, dead, min(sae.aux_k, n_dead))
        vals, rows, cols = SparseEncode.apply(x, sae.input_bias(), sae.W_enc, sae.b_enc, select)
        m = select.n_main
        codes = SparseCodes(rows[:m], cols[:m], vals[:m], offsets(rows[:m], len(x)))
        aux_codes = None
        if m < rows.numel():
            aux_codes = SparseCodes(rows[m:], cols[m:], vals[m:], offsets(rows[m:], len(x)))
        return codes, aux_codes

    def sparse_forward(
        self, sae: SparseAutoencoder, x: Tensor, target: Tensor, dead: Tensor | None
    ) -> TrainOutput:
        codes, aux_codes = self.sparse_encode(sae, x, dead)
        x_hat = sae.decode_sparse(codes) + sae.b_dec
        return self.losses(sae, target, x_hat, codes, aux_codes, dead)

    def dense_codes(self, sae: SparseAutoencoder, pre: Tensor) -> tuple[Tensor, Tensor]:
        rows, cols = self.select(pre.detach())
        mask = torch.zeros_like(pre, dtype=torch.bool)
        mask[rows, cols] = True
        return F.relu(pre) * mask, pre.new_zeros((), dtype=torch.float32)

    def dense_aux(self, sae: SparseAutoencoder, pre: Tensor, dead: Tensor | None) -> SparseCodes | None:
        if dead is None or int(dead.sum()) == 0 or self.cfg.aux_coefficient <= 0:
            return None
        r, c = select_aux(pre.detach(), dead, min(sae.aux_k, int(dead.sum())))
        raw = pre[r, c].float()
        vals = relu_straight_through(raw) if self.cfg.aux_straight_through else F.relu(raw)
        return SparseCodes(r, c, vals, offsets(r, len(pre)))

    # ---- format --------------------------------------------------------------------
    def save_fields(self) -> dict[str, Any]:
        return {"k": self.cfg.k, "rescale_acts_by_decoder_norm": False}

    @classmethod
    def config_from_saved(cls, cfg: dict[str, Any]) -> dict[str, Any]:
        old = cfg.get("activation_fn_kwargs")  # SAELens < 6 kept k there
        k = cfg["k"] if "k" in cfg else old.get("k") if isinstance(old, dict) else None
        if not isinstance(k, int) or isinstance(k, bool) or k <= 0:
            # no default: a TopK SAE encoded with another k than it was trained with is silently
            # a different SAE
            raise AssayError(
                f"cfg.json lacks a positive k (the latents a topk SAE keeps per token), got {k!r}"
            )
        return {"k": k}

    @torch.no_grad()
    def after_load(self, sae: SparseAutoencoder, cfg: dict[str, Any]) -> None:
        """SAELens's rescale_acts_by_decoder_norm (TopK over pre * |W_dec row|, decoded by unit
        rows) folded into the weights, as SAELens folds it for inference: pre_j and b_enc_j times
        n_j, W_dec row j over n_j (a no-op for the unit rows it saves)."""
        if not cfg.get("rescale_acts_by_decoder_norm"):
            return
        norms = sae.W_dec.norm(dim=1).clamp_min(1e-12)  # [d_sae]
        sae.W_enc.mul_(norms)
        sae.b_enc.mul_(norms)
        sae.W_dec.div_(norms[:, None])
