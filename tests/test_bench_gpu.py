"""The CPU path of what bench/gpu_check.sh runs on the GPU machine: its commands parse, the floors
run and mean the same loss, the random models load, the machine record reads the CPU.

(The whole check runs on the CPU with `DEVICE=cpu SMOKE=1 bash bench/gpu_check.sh`: minutes, so
not here.)"""

from __future__ import annotations

import sys
import time

import numpy as np
import pytest
import torch

from assay.cli import parse
from assay.core.config import ModelConfig
from assay.lm.data import collate
from assay.lm.losses import example_losses
from assay.lm.models import load_model
from bench import bench_build, bench_callback, floors, gpu_check, machine, random_model, sae_synthetic_stream
from tests.helpers import FP32, random_examples, tiny_llama


@pytest.mark.parametrize("sizes", [gpu_check.Sizes(), gpu_check.SMOKE], ids=["device", "smoke"])
def test_every_step_of_the_gpu_check_parses(tmp_path, sizes):
    todo = gpu_check.steps(sizes, "cuda", tmp_path, tmp_path)
    assert [name for name, _, _ in todo][:2] == ["model-smol", "build-smol"]
    for name, cmd, limit in todo:
        assert 0 < limit <= 600, name
        script = cmd[1]
        if cmd[1:3] == ["-m", "assay"]:
            words = 2 if cmd[3] == "sae" else 1
            cfg, _ = parse(" ".join(cmd[3 : 3 + words]), cmd[3 + words :])
            assert getattr(cfg, "runtime", cfg).device == "cuda", name
        elif script.endswith("bench_build.py"):
            args = bench_build.parser().parse_args(cmd[2:])
            assert args.device == "cuda" and set(args.floors) <= set(floors.FLOORS)
        elif script.endswith("bench_callback.py"):
            args = bench_callback.parser().parse_args(cmd[2:])
            assert args.device == "cuda" and args.steps >= 4, name
        elif script.endswith("sae_synthetic_stream.py"):
            args = sae_synthetic_stream.parser().parse_args(cmd[2:])
            assert args.device == "cuda" and args.smoke == (sizes is gpu_check.SMOKE), name
            assert args.libraries[0] == "assay", "assay's probe sets every library's length"
            slower = 4 if "saelens" in args.libraries else 1  # SAELens's trainer: at most 3x assay's time
            assert args.seconds * len(args.archs) * slower < limit - 120, "room for the world and the scoring"
        else:
            assert script.endswith("random_model.py")
            random_model.parser().parse_args(cmd[2:])


def test_standalone_steps_run_only_when_named_and_named_steps_bring_what_they_need(tmp_path):
    names = [name for name, _, _ in gpu_check.steps(gpu_check.SMOKE, "cpu", tmp_path, tmp_path)]
    assert "sae-synthetic" in names

    def chosen(only):
        return [n for n in names if gpu_check.selected(n, only)]

    assert "sae-synthetic" not in chosen([]) and "callback" in chosen([])
    assert chosen(["sae-synthetic"]) == ["sae-synthetic"]
    assert chosen(["score-inner"]) == ["model-smol", "index", "score-inner"]


def test_bergson_runs_beside_the_build_only_when_a_peer_python_is_given(tmp_path):
    def peer_steps(peer):
        todo = gpu_check.steps(gpu_check.SMOKE, "cpu", tmp_path, tmp_path, peer_python=peer)
        return [name for name, cmd, _ in todo if "--peer_python" in cmd]

    assert peer_steps("") == [] and peer_steps("/usr/bin/python3") == ["build-smol"]


def test_both_builds_read_the_same_tunes_with_the_same_settings(tmp_path):
    args = bench_build.parser().parse_args(["--model", "m", "--p", "8", "--token_batch_size", "512"])
    ours, peer = bench_build.build_commands(args, tmp_path / "tunes.jsonl", "bf16", tmp_path)
    for cmd in (ours, peer):
        flags = dict(zip(cmd, cmd[1:]))
        assert flags["--dataset"] == str(tmp_path / "tunes.jsonl") and flags["--projection_dim"] == "8"
        assert flags["--token_batch_size"] == "512" and flags["--precision"] == "bf16"
    args = bench_build.parser().parse_args(["--model", "m", "--ours_flags", "keep_freed_memory"])
    ours, peer = bench_build.build_commands(args, tmp_path / "tunes.jsonl", "bf16", tmp_path)
    assert "--keep_freed_memory" in ours and "--keep_freed_memory" not in peer  # assay's side only


def test_process_line_gives_medians_their_ratios_and_the_one_tune_peaks():
    runs = {
        "ours": [{"wall_s": w, "peak_gb": m} for w, m in ((4.0, 0.50), (6.0, 0.52), (5.0, 0.51))],
        "peer": [{"wall_s": 10.0, "peak_gb": 1.02}] * 3,
        "ours_one_tune": {"wall_s": 3.0, "peak_gb": 0.4},
        "peer_one_tune": {"error": "failed"},
    }
    line = bench_build.process_line("fp32", runs)
    assert "assay build 5.00 s, 0.510 GB; bergson build 10.00 s, 1.020 GB" in line
    assert "(ratios 0.50x time, 0.50x memory)" in line
    assert line.endswith("; assay on one tune 0.400 GB")  # a failed run is left out, not a crash


def test_an_overrunning_step_leaves_its_stack_and_a_finished_one_its_rc(capsys):
    slow = "import time\ndef waiting_here():\n    time.sleep(60)\nprint('started', flush=True)\n"
    slow += "waiting_here()"
    rc, text = gpu_check.run_with_stacks([sys.executable, "-c", slow], 3)
    assert rc == 124 and "started" in text and "waiting_here" in text
    assert "started" in capsys.readouterr().out  # echoed as it came, for a call cut short
    # a worker that inherits the output pipe and outlives the step must not hold the check up
    worker = "import subprocess, sys, time\n"
    worker += "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
    start = time.perf_counter()
    rc, _ = gpu_check.run_with_stacks([sys.executable, "-c", worker + "time.sleep(60)"], 3)
    assert rc == 124 and time.perf_counter() - start < 30
    start = time.perf_counter()  # nor when the step itself finished
    assert gpu_check.run_with_stacks([sys.executable, "-c", worker], 30) == (0, "")
    assert time.perf_counter() - start < 10
    failing = [sys.executable, "-c", "print('x'); raise SystemExit(3)"]
    assert gpu_check.run_with_stacks(failing, 30) == (3, "x\n")


def test_machine_record_names_the_cpu_and_its_isa():
    info = machine.machine()
    assert info["cpu"] and info["threads"] == torch.get_num_threads()
    assert set(info["isa"]) <= set(machine.ISA_FLAGS.values())
    line = machine.header(info)
    assert line.startswith("CPU: ") and f"{info['threads']} thread(s)" in line


def test_floors_compute_the_same_summed_loss_as_assay():
    """Padded with a mask, padded without one, packed and packed with attention per example: the
    same examples, the same loss."""
    model = tiny_llama(7)
    examples = random_examples([9, 30, 14, 5], seed=7, loss_start=[1, 4, 1, 2])
    positions = [np.arange(4)]
    with torch.no_grad():
        ref = example_losses(model, collate(examples, positions[0], pad_id=0)).sum()
        for name in ("sdpa", "sdpa-causal", "sdpa-packed", "sdpa-segments", "eager"):
            floor = floors.FLOORS[name]
            model.config._attn_implementation = floor.attention
            (batch,) = floors.floor_batches(floor, examples, positions, 0, torch.device("cpu"))
            assert ("attention_mask" in batch) == (floor.layout in ("masked", "segments")), name
            got = floors.floor_loss(model, batch, FP32)
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5, msg=name)
    assert floors.available("flash-varlen", torch.device("cpu")) == "flash_attention_2 needs CUDA"


def test_floor_pass_is_a_training_step_without_the_optimizer():
    model = tiny_llama(8)
    examples = random_examples([6, 11], seed=8)
    cpu = torch.device("cpu")
    batches = floors.floor_batches(floors.FLOORS["sdpa-causal"], examples, [np.arange(2)], 0, cpu)
    seen = []
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda p: seen.append(p))
    floors.floor_pass(model, batches, FP32)
    assert len(seen) == len(list(model.parameters()))  # every weight's gradient was formed
    assert all(p.grad is None for p in model.parameters())  # and cleared


def test_random_model_loads_with_its_tokenizer(tmp_path):
    folder = random_model.make("tiny-2m", tmp_path / "tiny")
    model = load_model(ModelConfig(model=str(folder)), FP32)
    assert 2.0e6 < sum(p.numel() for p in model.parameters()) < 2.3e6
    assert model.config.max_position_embeddings == 2048
