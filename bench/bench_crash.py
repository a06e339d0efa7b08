"""Crash test: `kill -9` at random points of `assay build`, `assay score`, `assay finetune` and
`assay sae train`, then the same command again until it finishes; the outputs must be identical
to an uninterrupted run's.

    .venv/bin/python bench/bench_crash.py --points 20            # every command, 20 kills each
    .venv/bin/python bench/bench_crash.py --commands build --points 5 --seed 1

Each point runs the command as its own process (`python -m assay ...`), kills it with SIGKILL
after a delay drawn uniformly from (0, T) where T is the uninterrupted process's wall time (so
kills land in start-up, data loading, the normalizer, the rows, the statistics, the commit...),
then reruns it to completion. Compared byte for byte: every file of the index (its
checksums.json records the sha256 of each); the scores and top-k records of a score run; the
fine-tuned weights, optimizer moments and visit order; the SAE's weights and config.
tests/test_crash.py runs a short version (a few points each) in the suite.

Prints the CPU model; timings are of this machine at this moment (noisy on a shared one).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from machine import header  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def write_texts(path: Path, count: int, seed: int = 0) -> Path:
    """`count` seeded texts of 4..40 words (varied lengths: several token batches)."""
    rng = np.random.default_rng(seed)
    words = "the king queen folk tune jig reel air of to and a in my love".split()
    with open(path, "w") as f:
        for _ in range(count):
            f.write(json.dumps({"text": " ".join(rng.choice(words, rng.integers(4, 40)))}) + "\n")
    return path


def build_args(out: Path, model: str, data: Path) -> list[str]:
    """An fp32 build with a normalizer and TrackStar statistics: every phase can be interrupted."""
    return [
        "build", str(out), "--model", model, "--dataset", str(data), "--precision", "fp32", "--threads", "1",
        "--projection_dim", "8", "--token_batch_size", "128", "--normalizer", "adafactor",
        "--normalizer_samples", "16", "--preconditioner", "trackstar",
    ]  # fmt: skip


def finetune_args(out: Path, model: str, data: Path) -> list[str]:
    """A short full fine-tune that checkpoints after every step."""
    return [
        "finetune", str(out), "--model", model, "--dataset", str(data), "--precision", "fp32",
        "--threads", "1", "--eval_split", "", "--effective_batch_size", "4", "--micro_batch_size", "2",
        "--num_epochs", "2",
        "--save_every", "1", "--log_every", "1", "--max_length", "64", "--attention", "eager",
    ]  # fmt: skip


def score_args(out: Path, model: str, data: Path) -> list[str]:
    """Every training row scored against four queries (the index is built once beforehand by
    `prepare`); score runs keep no partial work, so a killed one starts over."""
    return [
        "score", str(out), "--index", str(data.with_name("index")), "--query_dataset", str(data),
        "--query_max_samples", "4", "--save_scores",
    ]  # fmt: skip


def sae_args(out: Path, model: str, data: Path) -> list[str]:
    """A short TopK SAE on block 0's output that checkpoints every 2 steps."""
    return [
        "sae", "train", str(out), "--model", model, "--dataset", str(data), "--precision", "fp32",
        "--threads", "1", "--hookpoint", "model.layers.0", "--expansion_factor", "2", "--k", "4",
        "--training_tokens", "2048", "--batch_tokens", "128", "--context_length", "16",
        "--lm_batch_contexts", "4", "--buffer_batches", "2", "--checkpoint_every", "2",
        "--metrics_every", "1", "--eval_contexts", "2",
    ]  # fmt: skip


def build_outputs(out: Path) -> dict[str, str]:
    """The index's files by sha256 (those its checksums.json lists, recomputed here); index.json
    without the output folder's own name."""
    files = json.loads((out / "checksums.json").read_text())["files"]
    found = {name: _sha256(out / name) for name in files if name != "index.json"}
    meta = json.loads((out / "index.json").read_text())
    meta["config"].pop("out")
    found["index.json"] = json.dumps(meta, sort_keys=True)
    return found


def finetune_outputs(out: Path) -> dict[str, str]:
    """Weights, optimizer moments, visit order and the final losses of a fine-tune."""
    names = [p.relative_to(out).as_posix() for p in sorted((out / "model").glob("*.safetensors"))]
    names += ["optimizer_state.safetensors", "order.json"]
    found = {name: _sha256(out / name) for name in names}
    summary = json.loads((out / "summary.json").read_text())
    found["losses"] = json.dumps({k: summary[k] for k in ("train_loss", "eval_loss", "pool_loss")})
    return found


def score_outputs(out: Path) -> dict[str, str]:
    """Every score and the top-k records (with their texts) of a score run."""
    return {name: _sha256(out / name) for name in ("scores.npy", "top.jsonl", "queries.jsonl")}


def sae_outputs(out: Path) -> dict[str, str]:
    """The SAE's weights and its SAELens config."""
    return {name: _sha256(out / name) for name in ("sae_weights.safetensors", "cfg.json")}


COMMANDS: dict[str, tuple[Callable[[Path, str, Path], list[str]], Callable[[Path], dict[str, str]], int]] = {
    # command: (its arguments, its outputs, texts in its dataset)
    "build": (build_args, build_outputs, 48),
    "score": (score_args, score_outputs, 48),
    "finetune": (finetune_args, finetune_outputs, 24),
    "sae": (sae_args, sae_outputs, 96),
}


def _sha256(path: Path) -> str:
    """sha256 of a file; of a safetensors file, of its tensors and its metadata in sorted order
    (safetensors writes the metadata's keys in no fixed order, so two identical saves can differ
    in their bytes)."""
    if path.suffix != ".safetensors":
        return hashlib.sha256(path.read_bytes()).hexdigest()
    from safetensors import safe_open

    h = hashlib.sha256()
    with safe_open(str(path), framework="pt") as f:
        h.update(json.dumps(f.metadata() or {}, sort_keys=True).encode())
        for key in sorted(f.keys()):
            t = f.get_tensor(key).contiguous()
            h.update(f"{key}|{t.dtype}|{tuple(t.shape)}|".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def _assay(args: list[str]) -> list[str]:
    return [sys.executable, "-m", "assay", *args]


def run(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    """`assay ARGS` as its own process, to the end."""
    return subprocess.run(_assay(args), capture_output=True, text=True, env=env, cwd=ROOT)


def timed_reference(args: list[str], out: Path, env: dict[str, str]) -> tuple[float, float]:
    """Run the command uninterrupted; (seconds until OUT.part appeared, until OUT was finished)."""
    part = out.with_name(out.name + ".part")
    start = time.perf_counter()
    proc = subprocess.Popen(
        _assay(args), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, cwd=ROOT
    )
    appeared = finished = None
    while proc.poll() is None:
        now = time.perf_counter() - start
        if appeared is None and part.exists():
            appeared = now
        if finished is None and (out / "run.json").exists():
            finished = now
        time.sleep(0.01)
    total = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"uninterrupted run failed: {proc.stderr.read()[-2000:] if proc.stderr else ''}")
    return (appeared if appeared is not None else 0.0), (finished if finished is not None else total)


def killed_then_resumed(args: list[str], out: Path, delay: float, env: dict[str, str]) -> dict[str, float]:
    """Start the command, SIGKILL it after `delay` s, then rerun it until OUT is finished."""
    quiet = subprocess.DEVNULL
    proc = subprocess.Popen(_assay(args), stdout=quiet, stderr=quiet, env=env, cwd=ROOT)
    try:
        proc.wait(timeout=delay)
    except subprocess.TimeoutExpired:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    part = out.with_name(out.name + ".part").exists()
    state = "finished" if (out / "run.json").exists() else ("part" if part else "none")
    start = time.perf_counter()
    if not (out / "run.json").exists():
        done = run(args, env)
        if done.returncode != 0:
            raise RuntimeError(f"resume after a kill at {delay:.2f}s failed: {done.stderr[-2000:]}")
    return {"delay": delay, "resume_s": time.perf_counter() - start, "state_after_kill": state}  # type: ignore[dict-item]


def crash_points(
    command: str, root: Path, model: str, points: int, seed: int, env: dict[str, str] | None = None
) -> list[dict]:
    """Kill `command` at `points` random moments; return one record per point (raises on any
    output that differs from the uninterrupted run's)."""
    env = {**os.environ, **(env or {})}
    make_args, outputs, count = COMMANDS[command]
    data = write_texts(root / "data.jsonl", count)
    if command == "score":  # the index it reads
        done = run(build_args(root / "index", model, data), env)
        if done.returncode != 0:
            raise RuntimeError(f"building the index to score failed: {done.stderr[-2000:]}")
    began, finished = timed_reference(make_args(root / "ref", model, data), root / "ref", env)
    reference = outputs(root / "ref")
    rng = np.random.default_rng(seed)
    records = []
    for k in range(points):
        out = root / f"cut{k}"
        # most of the process's first seconds are imports: kill within the run itself, from just
        # before OUT.part appears to just after OUT is finished, where state is on disk
        # (a score run computes its query gradients before OUT.part appears: kill it there too)
        low = began / 2 if command == "score" else began - 0.2
        delay = float(rng.uniform(max(low, 0.0), finished + 0.05))
        record = killed_then_resumed(make_args(out, model, data), out, delay, env)
        got = outputs(out)
        differ = [name for name in reference if got.get(name) != reference[name]]
        if differ:
            raise AssertionError(f"{command}: after a kill at {record['delay']:.2f}s, {differ} differ")
        records.append({**record, "identical": True})
        shutil.rmtree(out)
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--commands", nargs="+", default=list(COMMANDS), choices=list(COMMANDS))
    parser.add_argument("--points", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default="assay-tiny")
    args = parser.parse_args()
    print(header() + "; figures are provisional on a shared machine")
    for command in args.commands:
        with tempfile.TemporaryDirectory() as tmp:
            start = time.perf_counter()
            records = crash_points(command, Path(tmp), args.model, args.points, args.seed)
            states = {
                s: sum(r["state_after_kill"] == s for r in records) for s in ("none", "part", "finished")
            }
            print(
                f"{command}: {len(records)} kills, all resumed to identical outputs "
                f"(killed before OUT.part: {states['none']}, mid-run: {states['part']}, after finishing: "
                f"{states['finished']}); {time.perf_counter() - start:.0f} s"
            )


if __name__ == "__main__":
    main()
