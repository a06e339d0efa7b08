"""--fsdp (FSDP2) under torchrun with 2 CPU processes (gloo) equals 1 process: build, finetune.

Uses the launcher and worker of test_distributed.py; the references are in-process runs.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.helpers import BUILD_FLAGS, assert_same_training, finetune_one, ok, torchrun, write_many

WORKER = str(Path(__file__).with_name("test_distributed.py"))  # its __main__ runs the workers


@pytest.fixture(scope="module")
def many_jsonl(tmp_path_factory) -> Path:
    return write_many(tmp_path_factory.mktemp("data"))


@pytest.fixture(scope="module")
def one_index(tmp_path_factory, tiny_model_dir, many_jsonl) -> Path:
    """The 1-process index (fp32, Adafactor normalizer estimated, TrackStar statistics)."""
    from assay.cli import main

    out = tmp_path_factory.mktemp("build") / "one"
    args = ["--model", str(tiny_model_dir), "--dataset", str(many_jsonl), *BUILD_FLAGS]
    assert main(["build", str(out), *args]) == 0
    return out


@pytest.fixture(scope="module")
def finetuned(tmp_path_factory, tiny_model_dir, many_jsonl) -> tuple[Path, list[str]]:
    return finetune_one(tmp_path_factory.mktemp("finetune"), tiny_model_dir, many_jsonl)


def test_build_fsdp_two_processes_equal_one(tmp_path, one_index, tiny_model_dir, many_jsonl):
    """--fsdp: sharded weights (gathered per decoder block), the normalizer estimated by all ranks
    together from gathered gradients; fp32, so rows and statistics match to summation order."""
    import assay

    args = ["--model", str(tiny_model_dir), "--dataset", str(many_jsonl), *BUILD_FLAGS, "--fsdp"]
    ok(torchrun("-m", "assay", "build", str(tmp_path / "fsdp"), *args))
    one, two = assay.open_index(one_index), assay.open_index(tmp_path / "fsdp")
    assert two.meta["model"]["fingerprint"] == one.meta["model"]["fingerprint"]  # of the whole weights
    np.testing.assert_array_equal(one.ids, two.ids)
    np.testing.assert_allclose(two.gradients, one.gradients, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(two.losses, one.losses, rtol=1e-6, atol=1e-6)
    for key, value in one.normalizer_tensors().items():
        torch.testing.assert_close(two.normalizer_tensors()[key], value, rtol=1e-6, atol=0)
    (s1, _), (s2, _) = one.preconditioner_stats(), two.preconditioner_stats()
    for name in s1:
        torch.testing.assert_close(s2[name], s1[name], rtol=1e-5, atol=1e-6)
    # Interrupted with rank 0 done and rank 1 not started (rows lost): the ranks must resume in
    # step from the least advanced one (else rank 1 waits forever in rank 0's absent forwards).
    part = tmp_path / "fsdp.part"
    (tmp_path / "fsdp").rename(part)
    (part / "run.json").unlink()
    rows = np.load(part / "gradients.npy", mmap_mode="r+")
    rows[:] = 0
    rows.flush()
    del rows, two
    for rank in (0, 1):
        record = json.loads((part / f"progress.rank{rank}-of-2.json").read_text())
        record["batches_done"] = record["num_batches"] if rank == 0 else 0
        (part / f"progress.rank{rank}-of-2.json").write_text(json.dumps(record))
    ok(torchrun("-m", "assay", "build", str(tmp_path / "fsdp"), *args, timeout=120))
    np.testing.assert_allclose(
        assay.open_index(tmp_path / "fsdp").gradients, one.gradients, rtol=1e-5, atol=1e-6
    )


@pytest.mark.parametrize("command", ["build", "finetune"])
def test_fsdp_in_one_process_is_refused_before_writing(command, tmp_path):
    from assay.cli import main

    assert main([command, str(tmp_path / "out"), "--fsdp"]) == 2
    assert not any(tmp_path.iterdir())


def test_finetune_fsdp_two_processes_follow_one_and_resume(tmp_path, finetuned):
    """--fsdp (sharded weights, gradients and Adam moments), interrupted after step 3 and resumed
    from the step-2 checkpoint (gathered whole, then re-sharded): the same run as one process."""
    one, args = finetuned
    proc = torchrun(WORKER, "resume", str(tmp_path / "fsdp"), *args, "--fsdp")
    ok(proc)
    assert "resuming from step 2 of 4" in proc.stderr
    assert_same_training(one, tmp_path / "fsdp")
