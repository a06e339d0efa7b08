"""The attribution pillar's Python entry points given what a user plausibly passes by mistake:
each refused in one line before any work (never a raw torch traceback, a silently wrong result
or a model left frozen), or, for ordinary DataLoader batches, simply accepted."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from assay.attribution.api import Gradients, collect_gradients, score
from assay.attribution.options import ScoreOptions


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))


def _batches(n: int = 12, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    x, y = torch.randn(n, 6, generator=gen), torch.randint(0, 3, (n,), generator=gen)
    return [{"x": x[i : i + 4], "y": y[i : i + 4]} for i in range(0, n, 4)]


def _ce(model: nn.Module, batch: dict) -> torch.Tensor:
    return F.cross_entropy(model(batch["x"]), batch["y"], reduction="none")  # [B]


# --- modules --------------------------------------------------------------------------------------


# --- projection and seed --------------------------------------------------------------------------


# --- loss_fn --------------------------------------------------------------------------------------


# --- batches --------------------------------------------------------------------------------------


# --- kfac_influence's options ---------------------------------------------------------------------


# --- save_factors ---------------------------------------------------------------------------------


# --- score ----------------------------------------------------------------------------------------
def test_score_takes_rows_that_require_grad():
    model, b = _mlp(), _batches()
    train, queries = (
        collect_gradients(model, b, _ce, projection_dim=4),
        collect_gradients(model, b[:1], _ce, projection_dim=4),
    )
    tracked = Gradients(queries.rows.clone().requires_grad_(True), queries.modules, 4, 0)
    for mode in ("trackstar", "cosine"):
        want = score(queries, train, ScoreOptions(mode=mode)).scores
        torch.testing.assert_close(score(tracked, train, ScoreOptions(mode=mode)).scores, want)
