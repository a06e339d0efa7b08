"""SAE metrics, always computed in fp32 with autocast off, always saved locally.

Definitions (x: activations [N, d_in], x_hat: reconstructions, z: latents):
  MSE  = mean over tokens of ||x - x_hat||^2 (summed over d_in)
  FVU  = sum ||x - x_hat||^2 / sum ||x - mean(x)||^2 ; explained variance = 1 - FVU
  L0   = mean number of active latents per token
  dead fraction = share of latents that did not fire in the last `window` tokens
"""

from __future__ import annotations

import torch
from torch import Tensor


def fvu(x: Tensor, x_hat: Tensor) -> float:
    """Fraction of variance unexplained over a batch (fp64 sums)."""
    x64, err = x.double(), (x.double() - x_hat.double())
    total = (x64 - x64.mean(0)).pow(2).sum()
    return float(err.pow(2).sum() / total.clamp_min(1e-30))


class ReconstructionStats:
    """Accumulates MSE / FVU / L0 / firing counts over many batches (exact, in fp64)."""

    def __init__(self, d_in: int, d_sae: int):
        self.n = 0
        self.sq_err = 0.0
        self.sum_x = torch.zeros(d_in, dtype=torch.float64)
        self.sum_x2 = 0.0
        self.active = 0
        self.fire_counts = torch.zeros(d_sae, dtype=torch.float64)

    def update(self, x: Tensor, x_hat: Tensor, z: Tensor) -> None:
        """x, x_hat [N, d_in]; z [N, d_sae] latents."""
        x64 = x.double().reshape(-1, x.shape[-1])
        self.n += x64.shape[0]
        self.sq_err += float((x64 - x_hat.double().reshape(x64.shape)).pow(2).sum())
        self.sum_x += x64.sum(0)
        self.sum_x2 += float(x64.pow(2).sum())
        fired = z.reshape(-1, z.shape[-1]) > 0
        self.active += int(fired.sum())
        self.fire_counts += fired.sum(0).double()

    def result(self) -> dict[str, float]:
        total_var = self.sum_x2 - float(self.sum_x.pow(2).sum()) / max(self.n, 1)
        f = self.sq_err / max(total_var, 1e-30)
        return {
            "mse": self.sq_err / max(self.n, 1),
            "fvu": f,
            "explained_variance": 1.0 - f,
            "l0": self.active / max(self.n, 1),
            "dead_fraction_eval": float((self.fire_counts == 0).double().mean()),
        }

    def log_densities(self) -> Tensor:
        """[d_sae] log10 firing frequency (SAELens's `sparsity`), floored at 1e-10."""
        return torch.log10(self.fire_counts / max(self.n, 1) + 1e-10).float()


class DeadLatents:
    """Tokens since each latent last fired; a latent is dead past `window` tokens (the metric)
    and an AuxK target past `aux_window` tokens (default: the same)."""

    def __init__(self, d_sae: int, window: int, aux_window: int | None = None):
        self.since = torch.zeros(d_sae, dtype=torch.int64)
        self.window = window
        self.aux_window = window if aux_window is None else aux_window

    def update(self, counts: Tensor, n_tokens: int) -> None:
        """counts [d_sae]: tokens of a batch of n_tokens on which each latent fired."""
        self.since += n_tokens
        self.since[counts.cpu() > 0] = 0

    def mask(self) -> Tensor:
        return self.since >= self.window

    def aux_mask(self) -> Tensor:
        return self.since >= self.aux_window

    def fraction(self) -> float:
        return float(self.mask().double().mean())
