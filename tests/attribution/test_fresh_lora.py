"""A fresh LoRA adapter (B = 0): its A layers' gradients are exactly 0, and scoring must leave them
out (their curvature is 0, so R^{-1/2} and (H + δ)^{-1} would be infinite and every score NaN)
rather than rank nothing. Reference: the same index built without the A layers."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from assay.attribution.api import Gradients, score
from assay.attribution.kfac import ModuleFactors, decompose
from assay.attribution.options import ScoreOptions
from assay.cli import main
from tests.helpers import write_word_texts

FLAGS = ["--precision", "fp32", "--projection_dim", "4", "--lora_rank", "2"]
QUERIES = ["--query_text", "the king and a folk tune", "my love of a jig", "--top_k", "5"]
WITHOUT_A = ["--modules", "!*lora_A*"]


def _gradients(rows: np.ndarray, sizes: dict[str, int]) -> Gradients:
    slices, start = {}, 0
    for name, size in sizes.items():
        slices[name] = slice(start, start + size)
        start += size
    return Gradients(torch.from_numpy(rows).float(), slices, 4, 0)


@pytest.mark.parametrize(
    "options",
    [ScoreOptions(mode="trackstar"), ScoreOptions(mode="trackstar", mix=0.3), ScoreOptions(mode="influence")],
)
def test_a_module_without_gradient_is_left_out_of_the_whitening(options):
    """Scores with an all-zero module equal the scores of the other modules alone."""
    rng = np.random.default_rng(0)
    train, queries = rng.normal(size=(50, 14)) @ rng.normal(size=(14, 14)), rng.normal(size=(3, 14))
    train[:, 6:10] = queries[:, 6:10] = 0.0  # module "silent": columns 6..9
    sizes = {"a": 6, "silent": 4, "b": 4}
    kept = np.r_[0:6, 10:14]
    full = score(_gradients(queries, sizes), _gradients(train, sizes), options).scores
    alone = score(
        _gradients(queries[:, kept], {"a": 6, "b": 4}), _gradients(train[:, kept], {"a": 6, "b": 4}), options
    ).scores
    assert torch.isfinite(full).all()
    torch.testing.assert_close(full, alone, rtol=1e-5, atol=1e-6)


def test_kfac_of_a_module_without_gradient_is_zero():
    """Its output-gradient factor G is 0, so H = G ⊗ A is 0 and so is the default damping: the
    pseudo-inverse (0), not a division by zero (an unprojected index's influence takes this path)."""
    factors = ModuleFactors(a=decompose([torch.eye(3) * 2.0], 4), g=decompose([torch.zeros(2, 2)], 4))
    grad = torch.zeros(5, 2, 3)
    assert torch.equal(factors.precondition(grad, "kfac", factors.damping("kfac")), grad)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, tiny_model_dir) -> tuple[Path, Path, Path]:
    root = tmp_path_factory.mktemp("fresh-lora")
    return root, tiny_model_dir, write_word_texts(root / "data.jsonl", 16, 30)


def _build(out: Path, model: Path, data: Path, *extra: str) -> int:
    return main(["build", str(out), "--model", str(model), "--dataset", str(data), *FLAGS, *extra])


def _score(out: Path, index: Path, *extra: str) -> np.ndarray:
    assert main(["score", str(out), "--index", str(index), *QUERIES, "--save_scores", *extra]) == 0
    records = [json.loads(line) for line in (out / "top.jsonl").read_text().splitlines()]
    assert all(len(r["proponents"]) == 5 for r in records)  # every row ranked, none left out as NaN
    return np.load(out / "scores.npy")


@pytest.mark.parametrize("preconditioner,mode", [("trackstar", "trackstar"), ("kfac", "influence")])
def test_fresh_lora_index_scores_as_its_b_layers_alone(corpus, capsys, preconditioner, mode):
    root, model, data = corpus
    both, b_only = root / f"both-{preconditioner}", root / f"b-{preconditioner}"
    assert _build(both, model, data, "--preconditioner", preconditioner) == 0
    assert "LoRA A layers whose B is all zero" in capsys.readouterr().err
    assert _build(b_only, model, data, "--preconditioner", preconditioner, *WITHOUT_A) == 0
    assert "LoRA A layers" not in capsys.readouterr().err
    scores = _score(root / f"s-both-{mode}", both, "--mode", mode)
    reference = _score(root / f"s-b-{mode}", b_only, "--mode", mode)
    np.testing.assert_allclose(scores, reference, rtol=1e-4, atol=1e-6)
    assert "inf/NaN" not in capsys.readouterr().err


def test_fresh_lora_corpus_scored_on_the_fly(corpus, capsys):
    """The stream path (no index) too: finite scores and results, no traceback."""
    root, model, data = corpus
    out = root / "stream"
    args = ["score", str(out), "--model", str(model), "--dataset", str(data), *FLAGS, *QUERIES]
    assert main(args) == 0
    records = [json.loads(line) for line in (out / "top.jsonl").read_text().splitlines()]
    assert all(len(r["proponents"]) == 5 for r in records)
    assert "inf/NaN" not in capsys.readouterr().err
