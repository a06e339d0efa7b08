"""Per-token attribution (`assay score --granularity token`): which tokens of a training example
drive its score against a query.

A module's block of an example's row is Σ_t (P_out g_t)(P_in a_t)ᵀ, a sum over the example's
positions t (collector.py), and every mode's score is V·row / norm(row) (kernel.py), with V and
norm(row) fixed for that example. So the score splits exactly into one term per position,

    s_t = Σ_m (P_out g_t)ᵀ V_m (P_in a_t) / norm(row),      Σ_t s_t = the score,

one small product per module from the collector's projected factors (the per-token gradients
are never formed). With the Adam normalizer, whose correction does not factor, the term is
g_tᵀ (P_outᵀ V_m P_in ⊘ √v) a_t on the unprojected factors instead.

What a position's term means: the part of the example's weight gradient that flows through the
activations at that position (a_t is a layer's input there, g_t the gradient of the example's
whole loss with respect to that layer's output there). It says which tokens' representations
carry the training step that helps (or hurts) the query, not which target tokens' losses do.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from assay.attribution.build import GradientSetup
from assay.attribution.collector import GradientCollector, ModuleSlot
from assay.attribution.kernel import EPS, QueryPlan
from assay.core.precision import STATS_DTYPE, full_precision
from assay.lm.data import Examples, collate, token_batches
from assay.lm.losses import example_losses


class TokenTermCollector(GradientCollector):
    """The collector, also keeping per-position terms Σ_m g_tᵀ U_m a_t of score vectors V [A, D]
    (U_m: V's block of module m in the space of the hooked factors): `terms` [B, A, T] fp32."""

    def __init__(self, setup: GradientSetup, vectors: torch.Tensor):
        super().__init__(setup.model, setup.modules, setup.projector, setup.policy, setup.normalizer)
        self.vectors = vectors.to(self._device, STATS_DTYPE)  # [A, D]
        self._u: dict[str, torch.Tensor] = {}
        self.terms: torch.Tensor | None = None

    def _u_of(self, slot: ModuleSlot) -> torch.Tensor:
        """[A, out-side, in-side] fp32: V's block of `slot` as it multiplies g_t and a_t."""
        if slot.name not in self._u:
            v = self.vectors[:, slot.start : slot.stop].reshape(-1, *slot.shape)
            if slot.conv1d and self.projector.dim == 0:
                v = v.transpose(1, 2)  # Conv1D stores (in, out): back to (out, in)
            if self._uses_full(slot.name):  # Adam: ⟨V, P (G ⊘ √v) Pᵀ⟩ = ⟨(Pᵀ V P) ⊘ √v, G⟩
                if self.projector.dim > 0:
                    p_out = self.projector.matrix(slot.name, "out", slot.out_features, self._device)
                    p_in = self.projector.matrix(slot.name, "in", slot.in_features, self._device)
                    v = p_out.T @ v @ p_in  # [A, out, in]
                v = v * self._inv_sqrt_v[slot.name]
            self._u[slot.name] = v.contiguous()
        return self._u[slot.name]

    def _backward_hook(self, slot: ModuleSlot, call: int, grad: torch.Tensor) -> None:
        self._flush()
        with full_precision(self._device):
            a = self._saved[slot.name][call]  # [B, T, in-side] fp32 (what the block is made of)
            g = self._masked(self._side(slot, "out", grad))  # [B, T, out-side] fp32
            assert a is not None
            term = torch.einsum("bti,aij,btj->bat", g, self._u_of(slot), a)  # [B, A, T]
            same = self.terms is not None and self.terms.shape == term.shape
            self.terms = self.terms + term if same else term  # type: ignore[operator]
        super()._backward_hook(slot, call, grad)

    def _attempt(
        self, batch: dict[str, torch.Tensor], objective: Any, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.terms = None  # an fp16 retry starts afresh
        rows, values = super()._attempt(batch, objective, scale)
        if self.terms is not None and scale != 1.0:
            self.terms = self.terms / scale  # the loss scale, as the rows are unscaled
        return rows, values

    def batch_terms(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """([B, D] rows, [B, A, T] per-position terms) of one batch (loss gradients)."""
        rows, _ = self.gradients(batch, example_losses)
        assert self.terms is not None
        return rows, self.terms


def row_scale(plan: QueryPlan, rows: torch.Tensor) -> torch.Tensor:
    """[B] 1 / norm(row) of the plan's mode (1 where it has none): score = (V row) · scale."""
    rows = rows.to(STATS_DTYPE)
    if plan.row_norm == "raw":
        return 1 / torch.linalg.vector_norm(rows, dim=1).clamp_min(EPS)
    if plan.row_norm in ("whitened", "lowrank"):
        assert plan.whitening is not None
        return 1 / plan.whitening.to(rows.device).sq_norms(rows).sqrt().clamp_min(EPS)
    return torch.ones(rows.shape[0], dtype=STATS_DTYPE, device=rows.device)


@dataclass
class TokenScores:
    """One example's scores split over its positions, per score column."""

    position: int
    """The example's position in the examples it was taken from."""
    scores: np.ndarray
    """[A] the example's score per vector of the plan (per query for --aggregate max)."""
    terms: np.ndarray
    """[A, T] per-position terms; they sum to `scores` over T (fp32 rounding)."""


def token_scores(
    setup: GradientSetup, examples: Examples, positions: list[int], plan: QueryPlan, token_batch_size: int
) -> dict[int, TokenScores]:
    """{position: TokenScores} of the examples at `positions` (their loss gradients, computed as an
    index's rows), for the plan's score vectors."""
    subset = examples.subset(positions)
    out: dict[int, TokenScores] = {}
    col = TokenTermCollector(setup, plan.vectors)
    with col:
        for batch_positions in token_batches(subset, token_batch_size):
            batch = collate(subset, batch_positions, setup.pad_id, setup.policy.device)
            rows, terms = col.batch_terms(batch)  # [B, D], [B, A, T]
            with full_precision(rows.device):
                scale = row_scale(plan, rows)  # [B]
                scores = (rows @ plan.vectors.to(rows.device).T) * scale[:, None]  # [B, A]
                terms = terms * scale[:, None, None]
            for row, pos in enumerate(batch_positions):
                length = int(subset.lengths[pos])
                kept = terms[row, :, :length].cpu().numpy()
                out[int(positions[pos])] = TokenScores(int(positions[pos]), scores[row].cpu().numpy(), kept)
    return out


def column_of(record_column: int, reduce_max: bool, found: TokenScores) -> int:
    """The plan vector a score column's per-token terms come from: the column itself, or for
    --aggregate max the query that gives the example its (maximal) score."""
    return int(np.argmax(found.scores)) if reduce_max else record_column


def token_record(query: Any, train_id: int, score: float, tokens: list[str], terms: np.ndarray) -> dict:
    """A tokens.jsonl record: the training example's tokens and each one's share of its score."""
    values = [float(v) for v in terms]
    return {"query": query, "id": train_id, "score": score, "sum": float(np.sum(terms)), "tokens": tokens,
            "scores": values}  # fmt: skip
