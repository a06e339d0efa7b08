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


def test_batch_topk_encoding_is_saelens_batchtopk(tmp_path) -> None:
    """`assay sae eval --batch_topk K` and `bench_sae_synthetic.py score --training_rule`: a saved
    BatchTopK SAE, loaded back, encodes as SAELens's own `BatchTopK` activation does (what its
    SynthSAEBench runner scores), the k·B largest activations of the batch, not by its saved
    threshold."""
    from sae_lens.saes.batchtopk_sae import BatchTopK

    from assay.sae.ground_truth import BatchTopKEncoding
    from assay.sae.saelens_format import load_sae, save_sae
    from tests.helpers import make_sae

    saved = make_sae("batchtopk", d_in=16, d_sae=96, k=3)
    saved.threshold().fill_(0.5)
    save_sae(tmp_path / "sae", saved, {"hook_name": "synthetic"})
    sae = load_sae(tmp_path / "sae")[0]
    x = torch.randn(64, 16)
    ours = BatchTopKEncoding(sae, 3).encode(x)
    assert torch.equal(ours, BatchTopK(3)(sae.pre_acts(x)))
    assert int((ours != 0).sum()) == 3 * 64 and not torch.equal(ours, sae.encode(x))
