"""The sparse autoencoder: one class for every architecture, for training and inference.

Shapes: N tokens, d_in input width, d_sae latents, d_out output width (d_in for an SAE; the
target hookpoint's width for a transcoder).
  W_enc [d_in, d_sae], b_enc [d_sae], W_dec [d_sae, d_out], b_dec [d_out]
  pre = (x - b_dec) @ W_enc + b_enc          [N, d_sae]  (a transcoder: x @ W_enc + b_enc)
  z = the architecture's rule(pre)            [N, d_sae]
  x_hat = z @ W_dec + b_dec                   [N, d_out]

The activation rule, training forward, losses, save fields and defaults belong to the
architecture (assay/sae/architectures/, one file each); this class holds the parameters and
the normalisation. The SAE trains on activations scaled by `act_scale` (so their mean norm is
sqrt(d_in)); a transcoder's targets are scaled by `target_scale`. `reconstruct` takes raw
activations, and `folded()` bakes the scales into the weights for saving.
"""

from __future__ import annotations

import copy
import math
import numbers
from typing import Any

import torch
from torch import Tensor, nn

from assay.core.config import require_config
from assay.core.errors import AssayError
from assay.sae.architectures import TrainOutput, architecture_class
from assay.sae.architectures.base import decode_sparse
from assay.sae.architectures.batchtopk import THRESHOLD_BETA
from assay.sae.config import SaeArchConfig
from assay.sae.kernels import SparseCodes, select_aux

__all__ = ["THRESHOLD_BETA", "SparseAutoencoder", "SparseCodes", "TrainOutput", "select_active", "select_aux"]


class SparseAutoencoder(nn.Module):
    """An SAE (or, with d_out, a transcoder) of any registered architecture; parameters fp32."""

    act_scale: Tensor  # [] buffer: raw activations * act_scale = training scale
    target_scale: Tensor  # [] buffer (transcoders): raw targets * target_scale = training scale
    threshold_buf: Tensor  # [d_sae] buffer: BatchTopK's inference threshold
    jumprelu_threshold: nn.Parameter  # [d_sae] (learned-threshold architectures only)

    def __init__(self, d_in: int, d_sae: int, arch: SaeArchConfig, d_out: int | None = None):
        """d_out: a transcoder's output width (None: an SAE, which reconstructs its input)."""
        super().__init__()
        _check_construction(d_in, d_sae, arch, d_out)
        self.d_in, self.d_sae, self.arch = int(d_in), int(d_sae), arch
        self.transcoder = d_out is not None
        self.d_out = self.d_in if d_out is None else int(d_out)
        self.rule = architecture_class(arch.architecture)(arch)
        self.W_enc = nn.Parameter(torch.empty(d_in, d_sae))
        self.b_enc = nn.Parameter(torch.zeros(d_sae))
        self.W_dec = nn.Parameter(torch.empty(d_sae, self.d_out))
        self.b_dec = nn.Parameter(torch.zeros(self.d_out))
        if self.rule.learned_threshold:
            # the threshold itself, as SAELens learns it: Adam moves it by ~lr per step, where a
            # log-threshold moves by ~lr in log space (~1% of 0.01) and the L0 barely falls
            self.jumprelu_threshold = nn.Parameter(torch.full((d_sae,), arch.jumprelu_init_threshold))
        self.register_buffer("threshold_buf", torch.zeros(d_sae))  # batchtopk at inference
        self.register_buffer("act_scale", torch.ones(()))  # raw activation -> training scale
        if self.transcoder:
            self.register_buffer("target_scale", torch.ones(()))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Decoder rows in random directions, of norm 1 (unit) or decoder_init_norm (small);
        the encoder is the decoder's transpose (a transcoder's: other random unit directions,
        its input and output spaces differ). `fit_encoder_scale` then sets the unit start's
        output scale from data."""
        with torch.no_grad():
            w = torch.randn(self.d_sae, self.d_out)
            norm = 1.0 if self.arch.unit_decoder else self.arch.decoder_init_norm
            w *= norm / w.norm(dim=1, keepdim=True)
            self.W_dec.copy_(w)
            if self.transcoder:
                w = torch.randn(self.d_sae, self.d_in)
                w *= norm / w.norm(dim=1, keepdim=True)
            self.W_enc.copy_(w.t())

    @torch.no_grad()
    def fit_encoder_scale(self, x: Tensor, target: Tensor | None = None) -> float:
        """Unit start: scale W_enc so the reconstruction of target [N, d_out] (default x [N,
        d_in]; normalised) from x has the least-squares scale; returns the factor (1.0 when the
        start is small or the architecture's rule is not scale-free).

        With b_enc = 0 the kept latents do not depend on W_enc's scale c and x_hat - b_dec is
        linear in c, so c = <target - b_dec, y> / <y, y> with y the reconstruction at c = 1. A
        transpose of unit rows alone over-shoots (k latents each carrying their full projection)
        and the first steps would be spent shrinking it.
        """
        if not self.arch.unit_decoder:
            return 1.0
        x = x.float()
        z = self.rule.fit_codes(self.pre_acts(x))  # [N, d_sae]
        if z is None:
            return 1.0
        y = z @ self.W_dec  # [N, d_out]
        goal = (x if target is None else target.float()) - self.b_dec
        c = float((goal * y).sum() / (y * y).sum().clamp_min(1e-12))
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
        """Latents the AuxK loss revives per token."""
        return self.arch.aux_k or self.arch.k

    def threshold(self) -> Tensor:
        """[d_sae] JumpReLU threshold (learned) or BatchTopK's inference threshold."""
        if self.rule.learned_threshold:
            return self.jumprelu_threshold
        return self.threshold_buf

    def input_bias(self) -> Tensor | None:
        """b_dec, subtracted from the input before encoding (None for a transcoder, whose b_dec
        lives in the output space: SAELens's apply_b_dec_to_input = false)."""
        return None if self.transcoder else self.b_dec

    @property
    def out_scale(self) -> Tensor:
        """[] raw output * out_scale = training scale (act_scale for an SAE)."""
        return self.target_scale if self.transcoder else self.act_scale

    # ---- inference (dense codes) -------------------------------------------------
    def pre_acts(self, x: Tensor) -> Tensor:
        """[N, d_sae] encoder pre-activations of normalised activations x [N, d_in]."""
        b_in = self.input_bias()
        if b_in is None:
            return torch.addmm(self.b_enc, x, self.W_enc)
        # b_dec's gradient through the encoder, -(sum over tokens of d pre) @ W_enc^T, reaches it
        # through the bias as a zero-valued term: autograd would otherwise form the input's
        # gradient, a whole [N, d_sae] x [d_sae, d_in] product, only to sum it over tokens.
        zero = b_in - b_in.detach()
        return torch.addmm(self.b_enc - zero @ self.W_enc, x - b_in.detach(), self.W_enc)

    def encode(self, x: Tensor) -> Tensor:
        """[..., d_sae] latent activations of normalised activations x [..., d_in], by the
        architecture's inference rule (as saved: BatchTopK-type SAEs encode with their threshold)."""
        z = self.rule.encode(self, self.pre_acts(self._rows(x, "d_in", "encode")))
        return z if x.ndim == 2 else z.reshape(*x.shape[:-1], self.d_sae)

    def decode(self, z: Tensor) -> Tensor:
        """[..., d_out] reconstruction from latents z [..., d_sae]."""
        x_hat = self.decode_rows(self._rows(z, "d_sae", "decode"))
        return x_hat if z.ndim == 2 else x_hat.reshape(*z.shape[:-1], self.d_out)

    def decode_rows(self, z: Tensor) -> Tensor:
        """[N, d_out] from latents z [N, d_sae], unchecked: the training forward's decode."""
        return z @ self.W_dec + self.b_dec

    def forward(self, x: Tensor) -> Tensor:
        """Reconstruction (a transcoder: prediction) of normalised activations."""
        return self.decode(self.encode(x))

    def _rows(self, x: Any, dim: str, method: str) -> Tensor:
        """x [..., width] (width: the attribute `dim`, d_in or d_sae) as rows [N, width] in the
        weights' dtype, or one line saying what is wrong. Shape and dtype reads only: no pass
        over the data unless it must be cast (outside autocast, which casts for the matmul)."""
        width = getattr(self, dim)
        if not isinstance(x, Tensor):
            raise AssayError(
                f"SparseAutoencoder.{method} takes a torch.Tensor, not a {type(x).__name__} "
                "(torch.as_tensor converts an array)"
            )
        if x.ndim == 0 or x.shape[-1] != width:
            raise AssayError(
                f"SparseAutoencoder.{method} takes [..., {dim}={width}], got shape {list(x.shape)}"
            )
        if x.dtype != self.W_enc.dtype and not torch.is_autocast_enabled(x.device.type):
            x = x.to(self.W_enc.dtype)  # float64, bf16, ints: the weights' dtype
        return x if x.ndim == 2 else x.reshape(-1, width)

    @torch.no_grad()
    def reconstruct(self, x_raw: Tensor) -> Tensor:
        """Reconstruction (prediction) of raw activations [..., d_in] -> [..., d_out]
        (normalisation applied and undone)."""
        x = self._rows(x_raw, "d_in", "reconstruct") * self.act_scale
        out = self.forward(x) / self.out_scale
        return out.reshape(*x_raw.shape[:-1], self.d_out).to(x_raw.dtype)

    def folded(self) -> SparseAutoencoder:
        """A copy working on raw activations: the scales folded into the weights (pre unchanged)."""
        out = copy.deepcopy(self)
        s, s_out = float(self.act_scale), float(self.out_scale)
        with torch.no_grad():
            out.W_enc.mul_(s)
            out.W_dec.div_(s_out)
            out.b_dec.div_(s_out)
            out.act_scale.fill_(1.0)
            if out.transcoder:
                out.target_scale.fill_(1.0)
        return out

    # ---- training ----------------------------------------------------------------
    def train_forward(
        self, x: Tensor, dead: Tensor | None, sparsity_coef: float, target: Tensor | None = None
    ) -> TrainOutput:
        """Losses on a batch x [N, d_in] (normalised) against target [N, d_out] (default x).
        dead [d_sae] bool selects AuxK latents."""
        return self.rule.train_forward(self, x, x if target is None else target, dead, sparsity_coef)

    def decode_sparse(self, codes: SparseCodes) -> Tensor:
        """[N, d_out] sum of vals * W_dec[cols] per token (no bias), as one embedding_bag."""
        return decode_sparse(codes, self.W_dec)

    @torch.no_grad()
    def update_threshold(self, min_kept: Tensor | None, first: bool) -> None:
        """After a step: the architecture's own updates (BatchTopK's threshold EMA, in fp32)."""
        self.rule.after_step(self, min_kept, first)


def _check_construction(d_in: Any, d_sae: Any, arch: Any, d_out: Any) -> None:
    """One line for sizes and configs an SAE cannot be built from (before any tensor is made)."""
    require_config(arch, SaeArchConfig, "SparseAutoencoder's arch")
    for name, value in (("d_in", d_in), ("d_sae", d_sae), ("d_out", d_out)):
        if value is None and name == "d_out":
            continue
        if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value <= 0:
            raise AssayError(f"SparseAutoencoder's {name} must be a positive integer, got {value!r}")
    if arch.d_sae is not None and arch.d_sae != d_sae:
        raise AssayError(
            f"SparseAutoencoder's d_sae {d_sae} differs from its arch's d_sae {arch.d_sae}; give one"
        )
    widths = arch.matryoshka_widths or []
    if arch.architecture == "matryoshka" and widths and widths[-1] > d_sae:
        raise AssayError(f"--matryoshka_widths {widths} exceed the SAE's {d_sae} latents (d_sae)")
    if architecture_class(arch.architecture).keeps_k and arch.k > d_sae:
        # here, not only in the config: a TopK of more latents than there are fails at every encode
        raise AssayError(f"--k {arch.k} exceeds the SAE's {d_sae} latents; lower --k or widen the SAE")


def select_active(pre: Tensor, architecture: str, k: int) -> tuple[Tensor, Tensor]:
    """(rows, cols) of the latents a TopK-type architecture keeps, token-major (pre detached)."""
    rule = architecture_class(architecture)(SaeArchConfig(architecture=architecture, k=k))
    select = getattr(rule, "select", None)
    if select is None:
        raise ValueError(f"{architecture} selects no latents by rank")
    return select(pre)
