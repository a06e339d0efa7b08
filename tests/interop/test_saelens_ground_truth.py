"""assay's ground-truth scores against SAELens's own (sae_lens.synthetic.evals) and scipy's
assignment, on the same inputs (run in .venv-peers: `make test-interop`)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from assay.sae.ground_truth import ClassificationCounts, linear_sum_assignment, mean_correlation_coefficient

evals = pytest.importorskip("sae_lens.synthetic.evals")
scipy_optimize = pytest.importorskip("scipy.optimize")


@pytest.mark.parametrize("shape", [(200, 200), (120, 300), (300, 120)])
def test_assignment_cost_equals_scipys(shape: tuple[int, int]) -> None:
    cost = np.random.default_rng(0).random(shape)
    rows, cols = linear_sum_assignment(cost)
    ref_rows, ref_cols = scipy_optimize.linear_sum_assignment(cost)
    assert cost[rows, cols].sum() == pytest.approx(cost[ref_rows, ref_cols].sum(), rel=1e-12)


def test_mcc_and_classification_equal_saelens() -> None:
    torch.manual_seed(0)
    features = torch.randn(150, 32)
    decoder = torch.cat([features[:90] + 0.4 * torch.randn(90, 32), torch.randn(30, 32)])  # 120 latents
    latents = torch.rand(500, 120) * (torch.rand(500, 120) < 0.1)
    truth = torch.rand(500, 150) * (torch.rand(500, 150) < 0.1)
    assert mean_correlation_coefficient(decoder, features) == pytest.approx(
        evals.mean_correlation_coefficient(decoder, features), rel=1e-5
    )
    counts = ClassificationCounts(decoder, features)
    counts.update(latents, truth > 0)
    ours, theirs = counts.result(), evals.compute_classification_metrics(latents, truth, decoder, features)
    assert ours.f1 == pytest.approx(theirs.f1_score, rel=1e-5)
    assert ours.precision == pytest.approx(theirs.precision, rel=1e-5)
    assert ours.recall == pytest.approx(theirs.recall, rel=1e-5)
    assert ours.accuracy == pytest.approx(theirs.accuracy, rel=1e-5)
