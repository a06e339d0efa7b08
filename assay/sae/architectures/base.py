"""What an SAE architecture is: its activation rule, training forward and losses, save format
fields and defaults. One subclass per file in this package, registered by name.

An architecture object holds only its config; the parameters live in the one
`SparseAutoencoder` class (assay/sae/model.py), which asks its architecture how to encode,
train and save. Shapes: N tokens, d_in input width, d_sae latents, d_out output width (d_in,
except for a transcoder).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from assay.sae.kernels import SparseCodes, SparseDecode, firing_counts

if TYPE_CHECKING:
    from assay.sae.config import SaeArchConfig
    from assay.sae.model import SparseAutoencoder

REGISTRY: dict[str, type[Architecture]] = {}


def register(cls: type[Architecture]) -> type[Architecture]:
    """Class decorator: make an architecture available under `cls.name`."""
    REGISTRY[cls.name] = cls
    return cls


@dataclass
class TrainOutput:
    """What one training forward produces (losses are scalars, autograd-connected)."""

    loss: Tensor
    x_hat: Tensor  # [N, d_out] reconstruction (normalised space)
    mse: Tensor  # sum over d_out, mean over tokens
    sparsity: Tensor  # L1 (relu) / L0 (jumprelu) penalty before its coefficient; 0 otherwise
    aux: Tensor  # AuxK loss before its coefficient
    counts: Tensor  # [d_sae] int64: tokens of the batch on which each latent is active
    l0: Tensor  # [] mean active latents per token (fp32, detached)
    min_kept: Tensor | None = None  # BatchTopK-type: smallest kept activation (threshold update)


class Architecture:
    """Base class: the dense training path, the shared losses and the default save fields."""

    name: ClassVar[str]
    """The --architecture value."""
    saelens_name: ClassVar[str]
    """The `architecture` of the saved cfg.json (what SAELens loads it as)."""
    loads_from: ClassVar[tuple[str, ...]] = ()
    """SAELens cfg.json architectures read back as this architecture."""
    unit_decoder_default: ClassVar[bool] = False
    """--decoder_init auto: unit-norm decoder rows (True) or the small free start (False)."""
    normalised_loss: ClassVar[bool] = False
    """The reconstruction loss is divided by the batch's variance (FVU, Gao et al.)."""
    learned_threshold: ClassVar[bool] = False
    """Adds a learned per-latent `jumprelu_threshold` parameter."""
    saved_threshold: ClassVar[bool] = False
    """Saved with a `threshold` [d_sae] (as a JumpReLU)."""
    aux_window_default: ClassVar[int | None] = None
    """AuxK's window in tokens under signum with batches of >= 4,096 tokens (None: the
    dead-latent window; `assay.sae.config.default_aux_window`)."""
    keeps_k: ClassVar[bool] = False
    """Keeps the k largest pre-activations (--k is its sparsity; the others ignore --k)."""
    signum_encoder_step: ClassVar[float] = 2**-0.5
    """signum: W_enc's steps are its size relative to W_dec's (at the start) times this
    (--signum_encoder_step sets it; measured per architecture: docs/BENCHMARKS.md)."""

    def __init__(self, cfg: SaeArchConfig):
        self.cfg = cfg

    # ---- inference -----------------------------------------------------------------
    def encode(self, sae: SparseAutoencoder, pre: Tensor) -> Tensor:
        """[N, d_sae] latents from pre-activations [N, d_sae], as the saved SAE computes them."""
        raise NotImplementedError

    def fit_codes(self, pre: Tensor) -> Tensor | None:
        """[N, d_sae] the training forward's latents at the start, for the encoder-scale fit;
        None where the scale cannot be fitted in closed form (a fixed threshold)."""
        return F.relu(pre)

    # ---- training ------------------------------------------------------------------
    def sparsity_coefficient(self) -> float:
        """The coefficient of the sparsity penalty at the end of its warm-up (0: none)."""
        return 0.0

    def train_forward(
        self, sae: SparseAutoencoder, x: Tensor, target: Tensor, dead: Tensor | None, coef: float
    ) -> TrainOutput:
        """Losses on inputs x [N, d_in] against target [N, d_out] (normalised); dead [d_sae]."""
        return self.dense_forward(sae, x, target, dead, coef)

    def dense_codes(self, sae: SparseAutoencoder, pre: Tensor) -> tuple[Tensor, Tensor]:
        """(z [N, d_sae] differentiable latents, the sparsity penalty before its coefficient)."""
        raise NotImplementedError

    def dense_aux(self, sae: SparseAutoencoder, pre: Tensor, dead: Tensor | None) -> SparseCodes | None:
        """AuxK codes for the dense path (None: no auxiliary loss)."""
        return None

    def dense_forward(
        self, sae: SparseAutoencoder, x: Tensor, target: Tensor, dead: Tensor | None, coef: float
    ) -> TrainOutput:
        pre = sae.pre_acts(x)  # [N, d_sae]
        z, sparsity = self.dense_codes(sae, pre)
        x_hat = sae.decode_rows(z.to(pre.dtype))
        aux_codes = self.dense_aux(sae, pre, dead)
        out = self.losses(sae, target, x_hat.float(), None, aux_codes, dead, z)
        out.loss = out.loss + coef * sparsity
        out.sparsity = sparsity
        return out

    def losses(
        self,
        sae: SparseAutoencoder,
        x: Tensor,
        x_hat: Tensor,
        codes: SparseCodes | None,
        aux_codes: SparseCodes | None,
        dead: Tensor | None,
        z: Tensor | None = None,
        extra_mse: Tensor | None = None,
    ) -> TrainOutput:
        """MSE, or FVU (`normalised_loss`), plus AuxK; x is the target [N, d_out].

        extra_mse: further reconstruction errors added to the loss (Matryoshka's inner levels).
        """
        err = (x_hat - x).float()
        mse = err.pow(2).sum(-1).mean()
        total_var = (x - x.mean(0)).float().pow(2).sum(-1).mean().clamp_min(1e-12)
        aux = x.new_zeros((), dtype=torch.float32)
        if aux_codes is not None and dead is not None:
            e_hat = sae.decode_sparse(aux_codes)  # predicts the residual from dead latents
            scale = min(int(dead.sum()) / sae.aux_k, 1.0)
            aux = scale * (e_hat - (x - x_hat).detach().float()).pow(2).sum(-1).mean() / total_var
        recon = mse if extra_mse is None else mse + extra_mse
        loss = recon / total_var + self.cfg.aux_coefficient * aux if self.normalised_loss else recon
        counts, l0, min_kept = self.activity(sae, codes, z)
        return TrainOutput(loss, x_hat.detach(), mse, x.new_zeros(()), aux, counts, l0, min_kept)

    def activity(
        self, sae: SparseAutoencoder, codes: SparseCodes | None, z: Tensor | None
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        """Per-latent firing counts, L0, and (`tracks_min_kept`) the smallest kept activation."""
        kept: Tensor | None
        with torch.no_grad():
            if codes is not None:
                active = codes.vals > 0
                counts = torch.bincount(codes.cols[active], minlength=sae.d_sae)
                l0 = active.sum().float() / len(codes.offsets)
                kept = codes.vals[active]
            else:
                assert z is not None
                counts = firing_counts(z)
                l0 = counts.sum().float() / len(z)
                kept = z[z > 0].float() if self.tracks_min_kept else None
            min_kept = kept.min() if kept is not None and kept.numel() else None
        return counts, l0, min_kept

    tracks_min_kept: ClassVar[bool] = False
    """The training forward reports its smallest kept activation (BatchTopK's threshold EMA)."""

    def after_step(self, sae: SparseAutoencoder, min_kept: Tensor | None, first: bool) -> None:
        """Updates outside the optimizer after each step (fp32, autocast off); none by default."""

    def kept_minimum(self, sae: SparseAutoencoder, x: Tensor) -> Tensor | None:
        """`tracks_min_kept`: the smallest activation the training rule keeps on batch x at the
        SAE's current weights (no gradient); None where it keeps none or has no threshold."""
        return None

    # ---- format --------------------------------------------------------------------
    def save_fields(self) -> dict[str, Any]:
        """Architecture fields of the saved cfg.json (besides `architecture`)."""
        return {}

    @classmethod
    def config_from_saved(cls, cfg: dict[str, Any]) -> dict[str, Any]:
        """SaeArchConfig keyword arguments read from a saved cfg.json."""
        return {}

    def after_load(self, sae: SparseAutoencoder, cfg: dict[str, Any]) -> None:
        """Adjust weights just read from a folder with this cfg.json (none by default)."""


Selector = Callable[[Tensor], tuple[Tensor, Tensor]]
"""pre [N, d_sae] (detached) -> (rows, cols) of the kept latents, token-major."""


def decode_sparse(codes: SparseCodes, W_dec: Tensor) -> Tensor:
    """[N, d_out] sum of vals * W_dec[cols] per token (no bias), as one embedding_bag."""
    return SparseDecode.apply(codes.vals, codes.rows, codes.cols, codes.offsets, W_dec)
