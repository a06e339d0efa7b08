"""kill -9 at random points of `assay build`, `assay score`, `assay finetune` and `assay sae
train`, then the same command again: the outputs are identical to an uninterrupted run's (the
short version of bench/bench_crash.py, which kills each command at 20 points)."""

from __future__ import annotations

import pytest

from bench.bench_crash import crash_points


@pytest.mark.slow
@pytest.mark.parametrize("command, seed", [("build", 0), ("score", 2), ("finetune", 1), ("sae", 3)])
def test_killed_runs_resume_to_identical_outputs(tmp_path, tiny_model_dir, command, seed):
    records = crash_points(command, tmp_path, str(tiny_model_dir), points=2, seed=seed)
    assert len(records) == 2 and all(r["identical"] for r in records)
