"""Seeded random projections, one pair per module: identical for the index and every later query.

A module's per-example weight gradient ∇W = Σ_t g_t a_tᵀ (out × in) is compressed to the
p × p block P_out ∇W P_inᵀ = Σ_t (P_out g_t)(P_in a_t)ᵀ, so the full gradient is never formed.
The matrices depend only on (seed, module name, side, size): a query built next week, on
another machine or device, projects exactly as the index did (generated on CPU, then moved).
"""

from __future__ import annotations

import hashlib

import torch

from assay.core.precision import STATS_DTYPE


def _side_seed(seed: int, name: str, side: str) -> int:
    """A 63-bit seed from the run seed, module name and side (stable across processes)."""
    digest = hashlib.sha256(f"assay-projection/{seed}/{name}/{side}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def projection_matrix(name: str, side: str, dim: int, size: int, seed: int = 0) -> torch.Tensor:
    """[dim, size] fp32 Rademacher matrix scaled by 1/sqrt(dim) (E[PᵀP] = I), on CPU.

    `side` is "in" or "out". Rademacher entries need one random bit each and project as well
    as Gaussians (Johnson–Lindenstrauss holds for both).
    """
    if side not in ("in", "out"):
        raise ValueError(f"side must be 'in' or 'out', got {side!r}")
    gen = torch.Generator(device="cpu").manual_seed(_side_seed(seed, name, side))
    signs = torch.randint(0, 2, (dim, size), generator=gen, dtype=torch.int8)
    return (signs.to(STATS_DTYPE) * 2 - 1) / dim**0.5


class Projector:
    """The projection matrices of a set of modules, made once and cached per device."""

    def __init__(self, dim: int, seed: int = 0):
        self.dim = dim
        self.seed = seed
        self._cache: dict[tuple[str, str, torch.device], torch.Tensor] = {}

    def matrix(self, name: str, side: str, size: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """[dim, size] fp32 on `device`."""
        key = (name, side, torch.device(device))
        if key not in self._cache:
            self._cache[key] = projection_matrix(name, side, self.dim, size, self.seed).to(device)
        return self._cache[key]

    def block_dims(self, out_features: int, in_features: int) -> tuple[int, int]:
        """Shape of a module's stored block: (p, p), or the raw (out, in) when dim is 0."""
        return (self.dim, self.dim) if self.dim > 0 else (out_features, in_features)

    def project_full(self, name: str, grad: torch.Tensor) -> torch.Tensor:
        """Explicit projection of full gradients [..., out, in] -> [..., p, p] (fp32 reference)."""
        out_f, in_f = grad.shape[-2:]
        p_out = self.matrix(name, "out", out_f, grad.device)
        p_in = self.matrix(name, "in", in_f, grad.device)
        return p_out @ grad.to(STATS_DTYPE) @ p_in.T
