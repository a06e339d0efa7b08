"""The Python API on a model that is not a language model: an MLP classifier in torch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from assay.attribution.api import collect_gradients, score
from assay.attribution.options import ScoreOptions
from assay.core.errors import AssayError


def _loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(model(batch["x"]), batch["y"], reduction="none")  # [B]


def _batches(x: torch.Tensor, y: torch.Tensor, size: int = 32):
    return [{"x": x[i : i + size], "y": y[i : i + size]} for i in range(0, len(x), size)]


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)
    centers = torch.randn(4, 12) * 2
    y = torch.randint(0, 4, (240,))
    x = centers[y] + torch.randn(240, 12)
    model = nn.Sequential(nn.Linear(12, 32), nn.Tanh(), nn.Linear(32, 16), nn.Tanh(), nn.Linear(16, 4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(60):  # a briefly trained classifier: gradients are not all alike
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    queries_x, queries_y = x[200:], y[200:]  # held out
    train_x, train_y = x[:200].clone(), y[:200].clone()
    planted = {0: 37, 5: 121, 9: 180}  # query -> train row replaced by its near-duplicate
    for q, row in planted.items():
        train_x[row] = queries_x[q] + 1e-3 * torch.randn(12)
        train_y[row] = queries_y[q]
    return model, train_x, train_y, queries_x, queries_y, planted


def test_planted_near_duplicate_is_top_proponent(setup):
    model, tx, ty, qx, qy, planted = setup
    train = collect_gradients(model, _batches(tx, ty), _loss, projection_dim=8, seed=3)
    queries = collect_gradients(model, _batches(qx, qy), _loss, projection_dim=8, seed=3)
    assert train.rows.shape == (200, 3 * 64) and queries.rows.shape == (40, 3 * 64)
    assert all(p.requires_grad for p in model.parameters())  # restored after collection
    for mode in ("trackstar", "cosine"):  # influence is unnormalised: big gradients can outrank copies
        result = score(queries, train, ScoreOptions(mode=mode, top_k=5))
        assert result.scores.shape == (40, 200)
        for q, row in planted.items():
            assert int(result.top.top_rows[q, 0]) == row, (mode, q)
    ts = score(queries, train, ScoreOptions(mode="trackstar"))
    assert ts.scores[list(planted), list(planted.values())].min() > 0.99  # cosine of near-copies


def test_rows_match_explicit_per_example_autograd(setup):
    """Unprojected collection equals each example's own autograd gradient (an independent path)."""
    model, tx, ty, _, _, _ = setup
    grads = collect_gradients(model, _batches(tx[:6], ty[:6], 4), _loss, projection_dim=0)
    for i in range(6):
        model.zero_grad()
        _loss(model, {"x": tx[i : i + 1], "y": ty[i : i + 1]}).sum().backward()
        want = torch.cat([m.weight.grad.flatten() for m in model if isinstance(m, nn.Linear)])
        torch.testing.assert_close(grads.rows[i], want, rtol=1e-4, atol=1e-6)
    model.zero_grad()


def test_aggregates_and_mismatch(setup):
    model, tx, ty, qx, qy, _ = setup
    train = collect_gradients(model, _batches(tx, ty), _loss, projection_dim=4)
    queries = collect_gradients(model, _batches(qx[:5], qy[:5]), _loss, projection_dim=4)
    full = score(queries, train, ScoreOptions(mode="trackstar")).scores
    mean = score(queries, train, ScoreOptions(mode="trackstar", aggregate="mean")).scores
    top = score(queries, train, ScoreOptions(mode="trackstar", aggregate="max")).scores
    torch.testing.assert_close(mean[0], full.mean(0), rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(top[0], full.max(0).values, rtol=1e-4, atol=1e-6)
    other = collect_gradients(model, _batches(qx[:5], qy[:5]), _loss, projection_dim=4, seed=1)
    with pytest.raises(AssayError, match="different modules or projection"):
        score(other, train)
