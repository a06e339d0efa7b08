"""torchrun with 2 CPU processes (gloo) equals 1 process: build, finetune, SAE step; errors.

Each distributed case launches `python -m torch.distributed.run --nproc_per_node 2 ...` as a
subprocess (the same launcher users run) and compares with an in-process single-process run.
Run as a script (`torchrun ... tests/core/test_distributed.py MODE ARGS`), this file is also the
worker for the cases that need code inside the ranks (the SAE step, a failing rank, an
interrupted finetune). Its launcher and reference runs are shared by test_fsdp.py (--fsdp) and
test_distributed_stages.py (filter, coreset).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from assay.core.distributed import Distributed
from tests.helpers import BUILD_FLAGS, assert_same_training, finetune_one, ok, torchrun, write_many


@pytest.fixture(scope="module")
def many_jsonl(tmp_path_factory) -> Path:
    return write_many(tmp_path_factory.mktemp("data"))


# ---- the helper in one process ---------------------------------------------------------------
def test_single_process_helper_is_a_no_op():
    dist = Distributed()
    t = torch.ones(3, dtype=torch.bfloat16)
    assert dist.all_reduce_(t) is t and dist.sum_scalars(1, 2.5) == [1.0, 2.5]
    assert dist.shard([1, 2, 3]) == [1, 2, 3] and dist.interleave([1, 2, 3]) == [1, 2, 3]
    assert dist.rank_file("progress.json") == "progress.json" and dist.gather(7) == [7]
    assert dist.agree(None) is None and dist.agree("boom") == "boom"
    assert dist.main_only(lambda a: a + 1, 1) == 2


def test_main_only_hands_rank_zeros_error_to_the_caller():
    from assay.core.errors import AssayError

    def refuse() -> None:
        raise AssayError("no pool")

    with pytest.raises(AssayError, match="no pool"):
        Distributed().main_only(refuse)


def test_shares_are_equal_length_and_cover_everything():
    items = list(range(7))
    shards = [Distributed(rank=r, world_size=3).shard(items) for r in range(3)]
    assert [len(s) for s in shards] == [3, 3, 3]  # padded: every rank takes 3 steps
    assert [x for s in shards for x in s if x is not None] == items
    parts = [Distributed(rank=r, world_size=3).interleave(items) for r in range(3)]
    assert sorted(x for p in parts for x in p) == items
    assert Distributed(rank=1, world_size=2).rank_file("progress.json") == "progress.rank1-of-2.json"


# ---- build -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def built(tmp_path_factory, tiny_model_dir, many_jsonl) -> tuple[Path, Path]:
    """(1-process index, 2-process index) of the same data and flags."""
    from assay.cli import main

    folder = tmp_path_factory.mktemp("build")
    args = ["--model", str(tiny_model_dir), "--dataset", str(many_jsonl), *BUILD_FLAGS]
    assert main(["build", str(folder / "one"), *args]) == 0
    ok(torchrun("-m", "assay", "build", str(folder / "two"), *args))
    return folder / "one", folder / "two"


def test_build_two_processes_equal_one(built):
    import assay

    one, two = (assay.open_index(p) for p in built)
    assert one.meta["num_examples"] == 13 and one.meta["dim"] == two.meta["dim"]
    np.testing.assert_array_equal(one.ids, two.ids)
    np.testing.assert_array_equal(one.token_counts, two.token_counts)
    assert not np.any(np.all(np.asarray(two.gradients) == 0, axis=1))  # every row was written
    np.testing.assert_allclose(two.gradients, one.gradients, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(two.losses, one.losses, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(two.row_norms, one.row_norms, rtol=1e-5)  # each rank wrote its rows' norms
    for key, value in one.normalizer_tensors().items():
        torch.testing.assert_close(two.normalizer_tensors()[key], value, rtol=0, atol=0)
    (s1, c1), (s2, c2) = one.preconditioner_stats(), two.preconditioner_stats()
    assert c1 == c2 == 13
    for name in s1:
        torch.testing.assert_close(s2[name], s1[name], rtol=1e-5, atol=1e-6)


def test_build_run_folder_holds_each_ranks_progress(built):
    _, two = built
    names = {p.name for p in two.iterdir()}
    assert {"progress.rank0-of-2.json", "progress.rank1-of-2.json", "run.json"} <= names
    done = [json.loads((two / f"progress.rank{r}-of-2.json").read_text()) for r in (0, 1)]
    assert sum(d["num_batches"] for d in done) >= 3 and all(
        d["batches_done"] == d["num_batches"] for d in done
    )


# ---- score -----------------------------------------------------------------------------------
def test_score_two_processes_equal_one(tmp_path, built, many_jsonl):
    from assay.cli import main

    one_index, _ = built
    args = ["--index", str(one_index), "--query_dataset", str(many_jsonl), "--query_split", "train"]
    args += ["--query_max_samples", "3", "--top_k", "4", "--save_scores", "--damping", "0.1"]
    assert main(["score", str(tmp_path / "one"), *args]) == 0
    ok(torchrun("-m", "assay", "score", str(tmp_path / "two"), *args))
    s1, s2 = (np.load(tmp_path / r / "scores.npy") for r in ("one", "two"))
    assert s1.shape == (3, 13)
    np.testing.assert_allclose(s2, s1, rtol=1e-5, atol=1e-6)
    tops = [
        [json.loads(x)["proponents"] for x in (tmp_path / r / "top.jsonl").read_text().splitlines()]
        for r in ("one", "two")
    ]
    assert [[i for i, _ in q] for q in tops[0]] == [[i for i, _ in q] for q in tops[1]]


# ---- finetune --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def finetuned(tmp_path_factory, tiny_model_dir, many_jsonl) -> tuple[Path, list[str]]:
    return finetune_one(tmp_path_factory.mktemp("finetune"), tiny_model_dir, many_jsonl)


def test_finetune_two_processes_follow_the_one_process_loss_curve(tmp_path, finetuned):
    """Effective batch 4 = 2 ranks x 1 micro x 2 accumulation; the 4th step has 1 example, so
    rank 1 has nothing to do in it and must still join the gradient reduction."""
    one, args = finetuned
    ok(torchrun("-m", "assay", "finetune", str(tmp_path / "two"), *args))
    assert_same_training(one, tmp_path / "two")


# ---- sae train -------------------------------------------------------------------------------
def test_sae_steps_on_two_ranks_equal_one_process_on_the_global_batch(tmp_path, tiny_model_dir, many_jsonl):
    """Three TopK steps: 2 ranks x 32 rows == 1 process x 64 rows (weights, Adam, dead counters);
    then a whole `assay sae train` (BatchTopK, evaluated mid-run) under the same torchrun (run
    folder written by rank 0)."""
    ok(torchrun(__file__, "sae", str(tmp_path), str(tiny_model_dir), str(many_jsonl)))
    for rank in (0, 1):
        got = json.loads((tmp_path / f"sae-step-{rank}.json").read_text())
        assert got["max_diff"] < 1e-5 and got["dead_equal"]
        assert got["own_half_diff"] > 1e-3  # a rank alone (no reduction) would differ
    out = tmp_path / "sae"
    assert {"cfg.json", "sae_weights.safetensors", "metrics.jsonl", "run.json"} <= {
        p.name for p in out.iterdir()
    }
    summary = json.loads((out / "summary.json").read_text())
    assert summary["tokens"] == 256 and summary["steps"] == 4  # global tokens, not one rank's


# ---- errors ----------------------------------------------------------------------------------
def test_a_failing_rank_stops_the_job_with_its_message(tmp_path):
    started = time.perf_counter()
    proc = torchrun(__file__, "fail", str(tmp_path), timeout=120)
    assert proc.returncode != 0
    assert "error (rank 1 of 2): rank 1 cannot read its shard" in proc.stderr
    assert time.perf_counter() - started < 100  # rank 0 did not wait forever in its barrier


def test_every_rank_reports_a_refused_output_folder(built, tiny_model_dir, many_jsonl):
    one, _ = built
    proc = torchrun(
        "-m", "assay", "build", str(one), "--model", str(tiny_model_dir), "--dataset", str(many_jsonl)
    )
    assert proc.returncode != 0 and "already holds a finished run" in proc.stderr
    assert "(rank 0 of 2)" in proc.stderr


# ---- workers (run inside torchrun) -------------------------------------------------------------
def _worker_fail(folder: str) -> int:
    """Rank 1 raises an AssayError while rank 0 waits in a barrier: the job must end."""
    from assay import cli
    from assay.core.errors import AssayError

    def run(cfg: object) -> None:
        dist = Distributed.current()
        if dist.rank == 1:
            raise AssayError("rank 1 cannot read its shard")
        dist.barrier()

    cli.COMMANDS["eval"] = cli.Command("assay.training.evaluate:EvalConfig", "x:y", "")
    cli.parse = lambda name, rest: (None, run)  # type: ignore[assignment]
    return cli.main(["eval"])


def _worker_sae(folder: str, model_dir: str, data: str) -> int:
    import assay.core.distributed as D
    from assay.cli import main
    from assay.core.precision import PrecisionPolicy
    from assay.sae.config import SaeArchConfig
    from assay.sae.metrics import DeadLatents
    from assay.sae.model import SparseAutoencoder
    from assay.sae.train import init_from_data, make_optimizer, train_step

    dist = D.Distributed.current()
    torch.manual_seed(0)
    x = torch.randn(3, 64, 16) * 2 + 0.5  # 3 global batches of 64 rows

    def run(rows: slice) -> tuple[SparseAutoencoder, DeadLatents]:
        torch.manual_seed(1)
        sae = SparseAutoencoder(16, 64, SaeArchConfig(architecture="topk", k=4))
        init_from_data(sae, x[0])
        opt, dead, policy = make_optimizer(sae, 1e-2), DeadLatents(64, 96), PrecisionPolicy.resolve("fp32")
        for i in range(3):
            train_step(sae, opt, x[i, rows] * sae.act_scale, dead, policy, 1e-2, 0.0, 1.0, first=i == 0)
        return sae, dead

    mine = slice(32 * dist.rank, 32 * (dist.rank + 1))
    D._CURRENT = D.Distributed()  # references: one process
    (ref, ref_dead), (alone, _) = run(slice(None)), run(mine)
    D._CURRENT = dist
    sae, dead = run(mine)

    def diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
        pairs = zip(a.state_dict().values(), b.state_dict().values(), strict=True)
        return max(float((u - v).abs().max()) for u, v in pairs)

    result = {
        "max_diff": diff(sae, ref),
        "dead_equal": bool(torch.equal(dead.since, ref_dead.since)),
        "own_half_diff": diff(alone, ref),
    }
    (Path(folder) / f"sae-step-{dist.rank}.json").write_text(json.dumps(result))
    args = ["sae", "train", str(Path(folder) / "sae"), "--model", model_dir, "--dataset", data]
    args += ["--hookpoint", "model.layers.0", "--training_tokens", "256", "--batch_tokens", "64"]
    args += ["--context_length", "16", "--buffer_batches", "2", "--precision", "fp32"]
    # BatchTopK with a mid-run evaluation: its threshold is calibrated on rank 0 alone mid-run
    # (evaluations run there only) and over every rank at the end
    args += [
        "--architecture",
        "batchtopk",
        "--eval_contexts",
        "2",
        "--eval_every",
        "2",
        "--browser_latents",
        "0",
    ]
    return main([*args, "--d_sae", "64", "--k", "4", "--checkpoint_every", "2"])


def _worker_resume(out: str, *args: str) -> int:
    """`assay finetune` stopped after step 3 (as by Ctrl-C), then run again to resume."""
    from assay.cli import main
    from assay.training import finetune

    def stop(step: int) -> None:
        if step == 3:
            raise KeyboardInterrupt

    finetune._after_step = stop  # type: ignore[assignment]
    assert main(["finetune", out, *args]) == 130
    finetune._after_step = lambda step: None  # type: ignore[assignment]
    return main(["finetune", out, *args])


if __name__ == "__main__":
    mode, *rest = sys.argv[1:]
    workers: dict[str, Any] = {"fail": _worker_fail, "sae": _worker_sae, "resume": _worker_resume}
    sys.exit(workers[mode](*rest))
