"""`assay filter` and `assay coreset` under torchrun with 2 CPU processes (gloo) equal 1 process."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.helpers import ok, torchrun, write_many


@pytest.fixture(scope="module")
def many_jsonl(tmp_path_factory) -> Path:
    return write_many(tmp_path_factory.mktemp("data"))


def _selected(folder: Path) -> list[str]:
    return (folder / "selected_ids.txt").read_text().split()


def test_filter_two_processes_equal_one(tmp_path, tiny_model_dir, many_jsonl):
    """TrackStar filter building its own index in OUT/index: every rank joins the build, rank 0
    scores and writes; the selection and the scores equal one process's."""
    from assay.cli import main

    args = ["--model", str(tiny_model_dir), "--dataset", str(many_jsonl), "--precision", "fp32"]
    args += ["--strategy", "trackstar", "--num_examples", "4", "--projection_dim", "4"]
    assert main(["filter", str(tmp_path / "one"), *args]) == 0
    ok(torchrun("-m", "assay", "filter", str(tmp_path / "two"), *args))
    assert (
        _selected(tmp_path / "two") == _selected(tmp_path / "one") and len(_selected(tmp_path / "one")) == 4
    )
    s1, s2 = (np.load(tmp_path / r / "scores.npy") for r in ("one", "two"))
    np.testing.assert_allclose(s2, s1, rtol=1e-5, atol=1e-6)
    assert {p.name for p in (tmp_path / "two" / "index").iterdir()} >= {"gradients.npy", "run.json"}


def test_coreset_two_processes_equal_one(tmp_path, tiny_model_dir, many_jsonl):
    """A whole (tiny) experiment under torchrun: every stage on both ranks, selection and report
    by rank 0; the same selections and the same table as one process (fp32 noise)."""
    from assay.cli import main

    args = ["--model", str(tiny_model_dir), "--dataset", str(many_jsonl), "--precision", "fp32"]
    args += ["--attention", "eager", "--seeds", "0", "--random_draws", "2"]
    args += ["--strategies", "random", "trackstar"]
    args += ["--index_precisions", "fp32", "--eval_dataset", str(many_jsonl), "--eval_split", "train"]
    args += [
        "--num_epochs",
        "1",
        "--effective_batch_size",
        "4",
        "--micro_batch_size",
        "2",
        "--fraction",
        "0.3",
    ]
    assert main(["coreset", str(tmp_path / "one"), *args]) == 0
    ok(torchrun("-m", "assay", "coreset", str(tmp_path / "two"), *args))
    for row in ("random_seed0", "random_seed0_draw1", "trackstar_fp32"):
        assert _selected(tmp_path / "two" / "select" / row) == _selected(tmp_path / "one" / "select" / row)
    r1, r2 = (json.loads((tmp_path / r / "results.json").read_text())["rows"] for r in ("one", "two"))
    assert set(r1) == set(r2) == {"full", "random", "trackstar_fp32"}
    for row, entry in r1.items():
        assert r2[row]["examples"] == entry["examples"]
        for key in ("eval_loss", "pool_loss"):
            assert r2[row][key] == pytest.approx(entry[key], rel=1e-5)
    assert (tmp_path / "two" / "run.json").exists() and (tmp_path / "two" / "results.md").exists()


def test_validate_ground_truth_two_processes_equal_one(tmp_path, tiny_model_dir, many_jsonl):
    """`assay validate` under torchrun: the full run and the subsets are shared out over the
    ranks, each trained by one process alone, so the ground truth (masks and every query's loss)
    is the one a single process measures; so are the methods (indexes shared out by kind, replay
    by batch of queries: 5 queries are 2 batches, one per rank) and their LDS."""
    from assay.cli import main

    args = ["--model", str(tiny_model_dir), "--dataset", str(many_jsonl), "--precision", "fp32"]
    args += ["--attention", "eager", "--threads", "1", "--max_length", "32", "--num_subsets", "3"]
    args += ["--query_dataset", str(many_jsonl), "--query_split", "train", "--query_max_samples", "5"]
    args += ["--num_epochs", "1", "--effective_batch_size", "4", "--micro_batch_size", "2"]
    args += ["--methods", "inner", "kfac", "replay", "--projection_dim", "4"]
    assert main(["validate", str(tmp_path / "one"), *args]) == 0
    ok(torchrun("-m", "assay", "validate", str(tmp_path / "two"), *args))
    one, two = tmp_path / "one" / "ground_truth", tmp_path / "two" / "ground_truth"
    np.testing.assert_array_equal(np.load(two / "masks.npy"), np.load(one / "masks.npy"))
    np.testing.assert_allclose(np.load(two / "outputs.npy"), np.load(one / "outputs.npy"), rtol=1e-6)
    l1, l2 = (json.loads((tmp_path / r / "lds.json").read_text())["results"] for r in ("one", "two"))
    assert set(l1) == set(l2) == {"inner-p4-fp32", "kfac-p4-fp32", "replay-fp32"}  # p = 4: tagged
    for label in l1:
        assert l2[label]["mean"] == pytest.approx(l1[label]["mean"], abs=1e-9), label
    parts = sorted(p.name for p in (tmp_path / "two" / "methods" / "replay-fp32.parts").glob("*.npy"))
    assert parts == ["batch-0000.npy", "batch-0001.npy"]
    assert (tmp_path / "two" / "run.json").exists()
