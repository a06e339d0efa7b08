"""Ground-truth scoring (MCC, classification F1): against brute force on small inputs."""

from __future__ import annotations

import itertools
import sys
import types

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from assay.core.errors import AssayError
from assay.sae import ground_truth
from assay.sae.ground_truth import (
    ClassificationCounts,
    linear_sum_assignment,
    load_ground_truth,
    mean_correlation_coefficient,
)


def _brute_force_min(cost: np.ndarray) -> float:
    """The least total cost of a one-to-one assignment, by trying every injection."""
    n, m = cost.shape
    if n <= m:
        return min(sum(cost[i, p[i]] for i in range(n)) for p in itertools.permutations(range(m), n))
    return _brute_force_min(cost.T)


@pytest.mark.parametrize("shape", [(1, 1), (4, 4), (5, 5), (3, 6), (6, 3), (6, 6)])
def test_linear_sum_assignment_finds_the_brute_force_optimum(shape: tuple[int, int]) -> None:
    rng = np.random.default_rng(sum(shape))
    for trial in range(5):
        cost = rng.random(shape) if trial % 2 else rng.integers(0, 3, shape).astype(float)  # ties too
        rows, cols = linear_sum_assignment(cost)
        assert len(rows) == min(shape) and len(set(rows)) == len(rows) and len(set(cols)) == len(cols)
        assert list(rows) == sorted(rows)
        assert cost[rows, cols].sum() == pytest.approx(_brute_force_min(cost), abs=1e-12)


def test_mcc_is_one_for_a_permuted_signed_rescaled_dictionary_and_brute_force_otherwise() -> None:
    rng = np.random.default_rng(0)
    features = torch.from_numpy(rng.normal(size=(6, 5)))
    decoder = -3.0 * features[[2, 0, 5, 1, 4, 3]]
    assert mean_correlation_coefficient(decoder, features) == pytest.approx(1.0)
    decoder = torch.from_numpy(rng.normal(size=(4, 5)))  # fewer latents than features
    a = decoder / decoder.norm(dim=1, keepdim=True)
    b = features / features.norm(dim=1, keepdim=True)
    sims = (a @ b.T).abs().numpy()
    best = -_brute_force_min(-sims) / 4  # the largest mean |cos| over injections
    assert mean_correlation_coefficient(decoder, features) == pytest.approx(best, rel=1e-12)


def test_classification_counts_equal_an_explicit_loop() -> None:
    rng = np.random.default_rng(1)
    features = torch.from_numpy(rng.normal(size=(7, 6)))
    decoder = torch.from_numpy(rng.normal(size=(5, 6)))
    latents = torch.from_numpy(rng.random((40, 5)) * (rng.random((40, 5)) < 0.4))
    fires = torch.from_numpy(rng.random((40, 7)) < 0.3)
    latents[:, 3] = 0  # a latent that never fires: precision and F1 0
    counts = ClassificationCounts(decoder, features)
    counts.update(latents[:25], fires[:25])  # accumulation over batches
    counts.update(latents[25:], fires[25:])
    got = counts.result()
    precisions, recalls, f1s, accs = [], [], [], []
    for j in range(5):
        cos = [abs(float(decoder[j] @ f / (decoder[j].norm() * f.norm()))) for f in features]
        t = fires[:, int(np.argmax(cos))].numpy()
        p = latents[:, j].numpy() != 0
        tp, fp, fn = (p & t).sum(), (p & ~t).sum(), (~p & t).sum()
        prec = tp / (tp + fp) if tp + fp else 0.0
        rec = tp / (tp + fn) if tp + fn else 0.0
        precisions.append(prec)
        recalls.append(rec)
        f1s.append(2 * prec * rec / (prec + rec) if prec + rec else 0.0)
        accs.append((p == t).mean())
    assert got.precision == pytest.approx(np.mean(precisions))
    assert got.recall == pytest.approx(np.mean(recalls))
    assert got.f1 == pytest.approx(np.mean(f1s))
    assert got.accuracy == pytest.approx(np.mean(accs))


def test_chance_f1_is_the_f1_of_latents_firing_independently_of_their_features() -> None:
    """Reference: latents drawn independently of the truth at rates 2-60% score, over many samples,
    the F1 the chance formula gives from their rates alone; a latent that detects its feature
    exactly scores F1 1 against a chance F1 equal to its firing rate."""
    g = torch.Generator().manual_seed(3)
    features = torch.eye(4, dtype=torch.float64)
    truth_rates = torch.tensor([0.4, 0.1, 0.02, 0.3])
    latent_rates = torch.tensor([0.5, 0.05, 0.6, 0.3])
    n = 400_000
    truth = torch.rand(n, 4, generator=g) < truth_rates
    counts = ClassificationCounts(features, features)
    counts.update((torch.rand(n, 4, generator=g) < latent_rates).double(), truth)
    got = counts.result()
    expected = (2 * truth_rates * latent_rates / (truth_rates + latent_rates)).mean()
    assert got.chance_f1 == pytest.approx(float(expected), abs=2e-3)
    assert got.f1 == pytest.approx(got.chance_f1, abs=3e-3)  # independent latents: F1 at chance

    exact = ClassificationCounts(features, features)
    exact.update(truth.double(), truth)
    perfect = exact.result()  # a latent as often as its feature: chance F1 2pp / 2p = p
    assert perfect.f1 == 1.0
    assert perfect.chance_f1 == pytest.approx(float(truth.double().mean(0).mean()), rel=1e-12)


def test_ground_truth_file_is_checked(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "gt.safetensors"
    save_file({"feature_vectors": torch.zeros(3, 4), "eval_acts": torch.zeros(2, 4)}, str(path))
    with pytest.raises(AssayError, match="lacks eval_fires"):
        load_ground_truth(path)
    save_file(
        {
            "feature_vectors": torch.zeros(3, 4),
            "eval_acts": torch.zeros(2, 4),
            "eval_fires": torch.zeros(2, 5),
        },
        str(path),
    )
    with pytest.raises(AssayError, match="mismatched"):
        load_ground_truth(path)


def test_ground_truth_metrics_and_the_eval_command(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    import json

    import torch.nn.functional as F

    from assay.cli import main
    from assay.sae.config import SaeArchConfig
    from assay.sae.ground_truth import ground_truth_metrics
    from assay.sae.model import SparseAutoencoder
    from assay.sae.saelens_format import save_sae

    g = torch.Generator().manual_seed(0)
    features = torch.randn(6, 5, generator=g)
    features /= features.norm(dim=1, keepdim=True)
    codes = torch.rand(300, 6, generator=g) * (torch.rand(300, 6, generator=g) < 0.3)
    acts = codes @ features
    sae = SparseAutoencoder(5, 6, SaeArchConfig(architecture="relu"))
    with torch.no_grad():
        sae.W_dec.copy_(features)
        sae.W_enc.copy_(features.T)
        sae.b_enc.fill_(-0.3)
        sae.b_dec.zero_()
    gt = {"feature_vectors": features, "eval_acts": acts, "eval_fires": codes > 0}
    got = ground_truth_metrics(sae, gt, batch=128)  # uneven batches
    z = F.relu(acts @ features.T - 0.3)  # explicit: latent j detects feature j (cosine 1)
    fires, truth = z > 0, codes > 0
    tp, fp, fn = (
        (fires & truth).sum(0).double(),
        (fires & ~truth).sum(0).double(),
        (~fires & truth).sum(0).double(),
    )
    prec = torch.where(tp + fp > 0, tp / (tp + fp).clamp_min(1), torch.zeros(6, dtype=torch.float64))
    rec = tp / (tp + fn)
    f1 = torch.where(
        prec + rec > 0, 2 * prec * rec / (prec + rec).clamp_min(1e-12), torch.zeros(6, dtype=torch.float64)
    )
    fvu = ((z @ features - acts) ** 2).sum() / ((acts - acts.mean(0)) ** 2).sum()
    assert got["mcc"] == pytest.approx(1.0)
    assert got["f1"] == pytest.approx(float(f1.mean()), rel=1e-9)
    assert got["fvu"] == pytest.approx(float(fvu), rel=1e-5)
    assert got["l0"] == pytest.approx(float(fires.sum(1).double().mean()))
    save_sae(tmp_path / "sae", sae, {"hook_name": "synthetic"})
    save_file({k: v.contiguous() for k, v in gt.items()}, str(tmp_path / "gt.safetensors"))
    assert (
        main(["sae", "eval", str(tmp_path / "sae"), "--ground_truth", str(tmp_path / "gt.safetensors")]) == 0
    )
    saved = json.loads((tmp_path / "sae" / "eval.json").read_text())
    assert saved["mcc"] == pytest.approx(got["mcc"]) and saved["f1"] == pytest.approx(got["f1"])
    assert "mcc" in capsys.readouterr().out


def test_batch_topk_encoding_keeps_the_k_b_largest_of_each_batch(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    """`assay sae eval --ground_truth F --batch_topk K`: each evaluation batch of B keeps its K·B
    largest ReLU'd pre-activations (explicitly: those at or above the K·B-th largest value), so the
    L0 is K exactly, whatever the saved threshold; without --ground_truth it is one line."""
    import json

    from assay.cli import main
    from assay.sae.ground_truth import BatchTopKEncoding
    from assay.sae.saelens_format import save_sae
    from tests.helpers import make_sae

    sae = make_sae("batchtopk", d_in=5, d_sae=12, k=2)
    sae.threshold().fill_(1e6)  # a saved threshold nothing reaches: only the rule can fire latents
    x = torch.randn(70, 5, generator=torch.Generator().manual_seed(1))
    for batch in (x[:64], x[64:]):  # a full and an uneven last batch
        pre = sae.pre_acts(batch).relu()
        cut = pre.flatten().sort(descending=True).values[2 * len(batch) - 1]
        expected = torch.where(pre >= cut, pre, torch.zeros_like(pre))
        assert torch.equal(BatchTopKEncoding(sae, 2).encode(batch), expected)
    features = torch.randn(4, 5, generator=torch.Generator().manual_seed(2))
    gt = {"feature_vectors": features, "eval_acts": x, "eval_fires": torch.rand(70, 4) < 0.3}
    save_sae(tmp_path / "sae", sae, {"hook_name": "synthetic"})
    save_file({k: v.contiguous() for k, v in gt.items()}, str(tmp_path / "gt.safetensors"))
    args = ["sae", "eval", str(tmp_path / "sae"), "--ground_truth", str(tmp_path / "gt.safetensors")]
    assert main([*args, "--batch_topk", "2", "--ground_truth_batch", "64"]) == 0
    saved = json.loads((tmp_path / "sae" / "eval.json").read_text())
    assert saved["l0"] == pytest.approx(2.0) and saved["batch_topk"] == 2 and saved["batch"] == 64
    assert main([*args, "--overwrite"]) == 0  # the saved threshold: nothing fires
    assert json.loads((tmp_path / "sae" / "eval.json").read_text())["l0"] == 0
    capsys.readouterr()
    assert main(["sae", "eval", str(tmp_path / "sae"), "--batch_topk", "2"]) == 2
    assert "pass --ground_truth" in capsys.readouterr().err


def test_the_assignment_solver_is_scipys_where_installed_and_ours_otherwise(
    monkeypatch: pytest.MonkeyPatch,
) -> None:

    monkeypatch.setitem(sys.modules, "scipy.optimize", None)  # import fails: scipy absent
    assert ground_truth.fastest_assignment() is linear_sum_assignment
    fake = types.ModuleType("scipy.optimize")
    calls: list[tuple[int, int]] = []

    def solver(cost: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        calls.append(cost.shape)
        return linear_sum_assignment(cost)

    fake.linear_sum_assignment = solver  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "scipy.optimize", fake)
    monkeypatch.setitem(sys.modules, "scipy", types.ModuleType("scipy"))
    features = torch.eye(3, dtype=torch.float64)
    assert mean_correlation_coefficient(features[[2, 0, 1]], features) == pytest.approx(1.0)
    assert calls == [(3, 3)]
