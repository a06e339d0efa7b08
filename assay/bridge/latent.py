"""Attributing a sparse-autoencoder latent to training data: where the two pillars meet.

The query is not a loss but a feature: f(x) = Σ_t a_L(h_t(x)), the activation of SAE latent L
at the SAE's hookpoint summed over the query's real tokens (attention-masked). Its gradient
∇θ f goes through the same collector, projection, normalizer and preconditioner as the
index's loss gradients, so the index answers "which training examples most increase this
feature?".

Sign: one SGD step on a training example z changes f by Δf ≈ -η ⟨∇θ f, ∇θ L(z)⟩. A loss query
ranks z as a proponent when ⟨∇θ L_q, ∇θ L(z)⟩ > 0 (the step lowers the query's loss); to keep
that meaning ("the step moves the query the way we want") the objective is -f, a loss that
falls as the feature rises. Proponents are then the training examples whose step raises the
latent; opponents are those whose step suppresses it.

The SAE is the SAE pillar's own `SparseAutoencoder`, read from its SAELens-format folder
(cfg.json + sae_weights.safetensors), so SAEs trained elsewhere work too; its encoder is the
one the SAE pillar trains and evaluates with. The objective enters attribution as any
`Objective` does (attribution never imports this package).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from torch import nn

from assay.attribution.build import GradientSetup, collect
from assay.attribution.collector import Objective
from assay.core.errors import AssayError
from assay.core.precision import STATS_DTYPE, full_precision
from assay.lm.data import Examples, collate, token_batches
from assay.lm.hooks import capture_output
from assay.sae.model import SparseAutoencoder
from assay.sae.saelens_format import CFG_FILE, WEIGHTS_FILE, load_sae

Activation = Literal["post", "pre"]


@dataclass
class HookedSae:
    """An SAE (fp32, on raw activations) and the module whose output it reads."""

    sae: SparseAutoencoder
    hookpoint: str

    def to(self, device: torch.device | str) -> HookedSae:
        self.sae.to(device)
        return self

    def check_latent(self, latent: int) -> None:
        if not 0 <= latent < self.sae.d_sae:
            raise AssayError(f"--latent must be in [0, {self.sae.d_sae}), got {latent}")

    def latents(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """[B, T, d_sae] fp32 latent activations, 0 at padding, connected to the model's graph."""
        return self.codes(model, batch, activation="post")

    def codes(
        self, model: nn.Module, batch: dict[str, torch.Tensor], activation: Activation = "post"
    ) -> torch.Tensor:
        """[B, T, d_sae] fp32 activations (post: the SAE's rule; pre: pre-activations), 0 at padding."""
        h = capture_output(model, self.hookpoint, batch["input_ids"], batch["attention_mask"])  # [B, T, d_in]
        if h.shape[-1] != self.sae.d_in:
            raise AssayError(f"the SAE reads {self.sae.d_in} dims but {self.hookpoint} outputs {h.shape[-1]}")
        with full_precision(h.device):  # the SAE in fp32, whatever the model's compute dtype
            x = h.to(STATS_DTYPE).reshape(-1, self.sae.d_in)  # [B*T, d_in]: the SAE's 2-D layout
            z = self.sae.encode(x) if activation == "post" else self.sae.pre_acts(x)  # [B*T, d_sae]
            return z.reshape(*h.shape[:2], -1) * batch["attention_mask"].to(STATS_DTYPE)[:, :, None]


def find_sae_folder(sae_dir: Path | str) -> Path:
    """The folder holding cfg.json + sae_weights.safetensors: SAE_DIR itself, or one level down."""
    folder = Path(sae_dir)
    candidates = [folder, folder / "sae"] + sorted(p.parent for p in folder.glob("*/" + WEIGHTS_FILE))
    found = next((c for c in candidates if (c / WEIGHTS_FILE).exists() and (c / CFG_FILE).exists()), None)
    if found is None:
        raise AssayError(
            f"{folder} holds no SAE ({CFG_FILE} + {WEIGHTS_FILE}); train one with `assay sae train`"
        )
    return found


def load_hooked_sae(sae_dir: Path | str, hookpoint: str | None = None) -> HookedSae:
    """The SAE in SAE_DIR (SAELens format, ours or SAELens's) and its hookpoint (saved, or given)."""
    found = find_sae_folder(sae_dir)
    sae, meta = load_sae(found)
    hook = hookpoint or meta.get("hook_name")
    if not hook:
        raise AssayError(f"{found / CFG_FILE} names no hook_name; pass the hookpoint explicitly")
    return HookedSae(sae.float().requires_grad_(False), str(hook))  # read, never trained here


def latent_objective(hooked: HookedSae, latent: int, activation: Activation = "post") -> Objective:
    """Objective (model, batch) -> [B]: minus the latent's activation summed over real tokens.

    Minus, so that proponents are the training examples whose gradient step raises the latent
    (see the module docstring). Usable wherever attribution takes an `objective`.
    """
    hooked.check_latent(latent)

    def objective(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        hooked.to(batch["input_ids"].device)
        return -hooked.codes(model, batch, activation)[:, :, latent].sum(dim=1)  # [B]

    return objective


@torch.no_grad()
def most_active_latent(
    model: nn.Module, hooked: HookedSae, examples: Examples, pad_id: int, token_batch_size: int = 2048
) -> int:
    """The latent with the largest activation summed over these examples' real tokens.

    A natural query for a demo: "this feature fires most on these texts; which training
    examples raise it?". Runs in fp32 on the model's device; the forward stops at the hookpoint.
    """
    device = next(model.parameters()).device
    hooked.to(device)
    totals = torch.zeros(hooked.sae.d_sae, dtype=torch.float64, device=device)  # [d_sae]
    for positions in token_batches(examples, token_batch_size):
        batch = collate(examples, positions, pad_id, device)
        totals += hooked.latents(model, batch).sum((0, 1)).double()
    return int(totals.argmax())


def silent_queries(grads: np.ndarray) -> np.ndarray:
    """Positions of all-zero query gradient rows (the latent never fired on those queries)."""
    return np.flatnonzero(~np.any(grads != 0, axis=1))


def latent_query_gradients(
    setup: GradientSetup,
    hooked: HookedSae,
    latent: int,
    examples: Examples,
    token_batch_size: int = 2048,
    activation: Activation = "post",
) -> np.ndarray:
    """[Q, D] float32 gradients of -(latent L's activation summed over each example's tokens),
    computed exactly like an index's rows with `setup` (e.g. `setup_from_index(index)`), so they
    can be scored against it with `assay.attribution.score.score_index`."""
    hooked.to(setup.policy.device)
    grads = collect(setup, examples, token_batch_size, latent_objective(hooked, latent, activation))
    silent = silent_queries(grads)
    if len(silent):
        raise AssayError(
            f"latent {latent} never fires on query {int(silent[0])} (all-zero gradient); pick texts where it "
            "fires (`assay report` on the SAE run lists its top contexts) or use the pre-activation"
        )
    return grads
