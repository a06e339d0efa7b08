"""The GPU readiness check's steps (run by bench/gpu_check.sh): gradient collection, scoring and SAE
training on CUDA, each a timed subprocess under its own time limit, with results written to $OUT
after every step (a step cut short by the device's 10-minute limit still leaves the others').

Steps, on random Llamas (bench/random_model.py; the weights do not matter for speed) and the
bundled ABC tunes:
  build-smol   bench/bench_build.py on SmolLM2-135M's shape: the floors (eager, SDPA masked,
               SDPA causal, segments, flash-attn varlen where installed) against `assay build`'s
               loop, fp32 and bf16, and one whole `assay build --device cuda` per precision;
               torch.profiler's costliest CUDA kernels of one floor pass and one of the loop
  index        `assay build` of 4,000 tunes (bf16, fp16 rows, TrackStar statistics) for scoring
  score-*      `assay score --device cuda` of 16 held-out tunes, trackstar and inner
  sae, sae-compiled  `assay sae train --device cuda` (TopK, bf16) without and with --compile
  build-compiled  the loop with --compile's fused elementwise kernels beside the eager one (bf16)
  callback     bench/bench_callback.py: a Trainer run with and without assay's GradientCallback
               (p = 16, the default normalizer), also alternating collected and uncollected steps
  build-1b     build-smol's loop on Llama-3.2-1B's shape, bf16 only (last: the first cut short)
  sae-synthetic  bench/sae_synthetic_stream.py: feature recovery at SynthSAEBench's published width
               (16,384 features in d = 768, 16,384 latents; BatchTopK, Matryoshka, JumpReLU in
               bf16), assay's SAEs and SAELens's (its trainer) on the same batches, drawn on the
               GPU by SAELens's generator (.gpu/synth). It needs the
               whole budget, so it is not run with the others: `--only sae-synthetic` alone
               (--synthetic_seconds sets its training time per SAE)
bergson is not on the device image and it has no network: bench/gpu_prepare.sh downloads its wheels
(.whl/peers) and bench/gpu_check.sh installs them, then build-smol times `bergson build` beside
`assay build` on the same GPU (--peer_python). SAELens comes as bench/saelens_copy.py's copy, for
sae-synthetic alone; its SAEs on LM activations are compared on the CPU (bench_sae_peers.py).

    python3 bench/gpu_check.py --device cuda --out $OUT
    .venv/bin/python bench/gpu_check.py --device cpu --smoke --out /tmp/gpu-smoke    # the CPU path
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import IO

sys.path.insert(0, str(Path(__file__).parent))
from machine import header, machine  # noqa: E402

BENCH = Path(__file__).parent
ASSAY = [sys.executable, "-m", "assay"]
SAELENS_COPY = BENCH.parent / ".gpu" / "synth"  # bench/gpu_prepare.sh (bench/saelens_copy.py)


@dataclass
class Sizes:
    """How much each step does: the device run's, or the CPU smoke run's."""

    smol_shape: str = "smollm2-135m"
    big_shape: str | None = "llama-1b"
    build_tokens: int = 60_000
    """Sized by the first H200 run: its fp32 floors ran at ~23k tokens/s on this shape, and 150k
    tokens at 2 repeats took build-smol past its limit before the bf16 half."""
    big_tokens: int = 30_000
    token_batch: int = 8192
    repeats: int = 1
    index_samples: int | None = 4000
    """Tunes in the index scored (None: the whole train split, 11.7k tunes, ~3M tokens)."""
    queries: int = 16
    sae_tokens: int = 1_000_000
    sae_hookpoint: str = "model.layers.15"
    callback_steps: int = 10
    callback_batch: tuple[int, int] = (8, 512)
    """Examples per step, tokens per example."""
    synthetic_seconds: float = 30.0
    """bench/sae_synthetic_stream.py's training time per assay SAE (SAELens's trains as many
    samples, at its own speed)."""
    synthetic: list[str] = field(
        default_factory=lambda: ["--libraries", "assay", "saelens", "--profile_steps", "30"]
    )
    """bench/sae_synthetic_stream.py's other size arguments."""
    # no sdpa-packed: each batch as one row with restarting positions ran at 0.43x sdpa's rate on the
    # H200 (fp32; SDPA over the whole row), and "segments" packs the same row with batched attention
    floors: list[str] = field(
        default_factory=lambda: [
            "eager",
            "sdpa",
            "sdpa-causal",
            "sdpa-segments",
            "flash-varlen",
        ]
    )


SMOKE = Sizes(
    smol_shape="tiny-2m",
    big_shape=None,
    build_tokens=1500,
    token_batch=2048,
    repeats=1,
    index_samples=24,
    queries=2,
    sae_tokens=16_384,
    sae_hookpoint="model.layers.2",
    callback_steps=4,
    callback_batch=(2, 32),
    floors=["sdpa", "sdpa-causal", "sdpa-segments"],
    synthetic=["--smoke"],
    synthetic_seconds=3.0,
)
STANDALONE = ("sae-synthetic",)
"""Steps that need no model or index, and that run only when --only names them."""


def run_with_stacks(cmd: list[str], limit: int) -> tuple[int, str]:
    """(rc, stdout and stderr) of `cmd` run under `limit` seconds, each line echoed as it comes (a
    device call cut short still shows how far the step got). A step that overruns gets SIGABRT
    first, so that faulthandler prints where each of its threads was (a bare timeout says nothing
    of where the time went), then its whole process group SIGKILL (workers it started would
    otherwise hold the output pipe open); its rc is then 124."""
    env = {**os.environ, "PYTHONFAULTHANDLER": "1"}
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True
    )
    lines: list[str] = []
    reader = threading.Thread(target=_echo, args=(proc.stdout, lines), daemon=True)
    reader.start()
    try:
        rc = proc.wait(limit)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGABRT)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(15)
        rc = 124
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    reader.join(15)
    return rc, "".join(lines)


def _echo(stream: IO[str], lines: list[str]) -> None:
    """Keep and print each line of `stream` until it closes (progress-bar lines kept, not printed)."""
    for line in stream:
        lines.append(line)
        if "it/s]" not in line:
            print(line, end="", flush=True)


def run_step(name: str, cmd: list[str], limit: int, out: Path, results: dict) -> dict:
    """Run one step under `limit` seconds; record rc, wall time, the end of its output and its
    summary.json (when the command wrote one); rewrite out/gpu_check.json."""
    print(f"== {name}: {' '.join(cmd)}", flush=True)
    start = time.perf_counter()
    rc, text = run_with_stacks(cmd, limit)
    wall = time.perf_counter() - start
    tail = "\n".join(line for line in text.splitlines() if "it/s]" not in line)[-1500:]
    record: dict = {"cmd": cmd, "rc": rc, "wall_s": round(wall, 2), "output_tail": tail}
    folder = next((Path(c) for c in cmd if c.startswith("/tmp/assay-gpu/run-")), None)
    if folder is not None and (folder / "summary.json").exists():
        record["summary"] = json.loads((folder / "summary.json").read_text())
    results["steps"][name] = record
    (out / "gpu_check.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
    print(f"== {name}: rc {rc}, {wall:.1f} s", flush=True)
    return record


Step = tuple[str, list[str], int]
"""(name, command, time limit in s)."""


def steps(sizes: Sizes, device: str, out: Path, work: Path, peer_python: str = "") -> list[Step]:
    """Every step, in order; `peer_python` runs bergson beside build-smol."""
    smol, big = work / "smol", work / "big"
    build = _bench_build(sizes, device)
    smol_build = [*build, "--model", str(smol), "--tokens", str(sizes.build_tokens)]
    peer = ["--peer_python", peer_python] if peer_python else []
    # bf16 first: the first H200 run measured fp32, and a step cut short has printed bf16's lines
    both = [*smol_build, "--precisions", "bf16", "fp32", "--out", str(out / "build_smol.json"), *peer]
    both += ["--profile", "25"]  # where the loop's time goes beside the floor's (bf16 was 1.30x)
    todo = [
        _model("model-smol", sizes.smol_shape, smol, device),
        ("build-smol", both, 240),
        *_index_and_scores(sizes, device, smol, work),
        *_sae_trainings(sizes, device, smol, work),
        # after the eager steps: a compile's first run is the likeliest to overrun what is left
        ("build-compiled", [*smol_build, "--precisions", "bf16", "--compiled_collector", "--no_process",
                            "--out", str(out / "build_compiled.json")], 150),
        ("callback", _callback(sizes, device, smol, out), 150),
        ("sae-synthetic", _synthetic(sizes, device, out), 540),
    ]  # fmt: skip
    if sizes.big_shape:  # last: the most expensive, and the first to go when time runs short
        big_build = [*build, "--model", str(big), "--tokens", str(sizes.big_tokens), "--precisions", "bf16"]
        todo.append(_model("model-big", sizes.big_shape, big, device))
        todo.append(("build-1b", [*big_build, "--out", str(out / "build_1b.json")], 200))
    return todo


def _model(name: str, shape: str, folder: Path, device: str) -> Step:
    return name, [sys.executable, str(BENCH / "random_model.py"), shape, str(folder), "--device", device], 120


def _bench_build(sizes: Sizes, device: str) -> list[str]:
    cmd = [sys.executable, str(BENCH / "bench_build.py"), "--device", device]
    cmd += ["--token_batch_size", str(sizes.token_batch), "--repeats", str(sizes.repeats)]
    return [*cmd, "--process_repeats", "1", "--floors", *sizes.floors]


def _index_and_scores(sizes: Sizes, device: str, model: Path, work: Path) -> list[Step]:
    """The index of bf16 rows stored as fp16 with TrackStar's statistics, then both scorings."""
    index = work / "run-index"
    cmd = [*ASSAY, "build", str(index), "--model", str(model), "--dataset", "abc-tunes", "--device", device]
    cmd += ["--precision", "bf16", "--store_dtype", "float16", "--preconditioner", "trackstar", "--overwrite"]
    cmd += ["--token_batch_size", str(sizes.token_batch)]
    cmd += ["--max_samples", str(sizes.index_samples)] if sizes.index_samples else []
    todo: list[Step] = [("index", cmd, 240)]
    for mode in ("trackstar", "inner"):
        cmd = [*ASSAY, "score", str(work / f"run-score-{mode}"), "--index", str(index)]
        cmd += ["--query_dataset", "abc-tunes", "--query_max_samples", str(sizes.queries), "--mode", mode]
        todo.append((f"score-{mode}", [*cmd, "--device", device, "--overwrite"], 120))
    return todo


def _sae_trainings(sizes: Sizes, device: str, model: Path, work: Path) -> list[Step]:
    todo: list[Step] = []
    for compiled in (False, True):
        name = "sae-compiled" if compiled else "sae"
        cmd = [*ASSAY, "sae", "train", str(work / f"run-{name}"), "--model", str(model)]
        cmd += ["--dataset", "abc-tunes", "--hookpoint", sizes.sae_hookpoint, "--architecture", "topk"]
        cmd += ["--training_tokens", str(sizes.sae_tokens), "--precision", "bf16", "--device", device]
        cmd += ["--browser_latents", "0", "--overwrite", "--compile" if compiled else "--no-compile"]
        todo.append((name, cmd, 150))
    return todo


def _callback(sizes: Sizes, device: str, model: Path, out: Path) -> list[str]:
    batch, seq_len = sizes.callback_batch
    cmd = [sys.executable, str(BENCH / "bench_callback.py"), "--model", str(model), "--device", device]
    cmd += ["--steps", str(sizes.callback_steps), "--batch_size", str(batch), "--seq_len", str(seq_len)]
    return [*cmd, "--normalizers", "adafactor", "--alternate", "--out", str(out / "callback.json")]


def _synthetic(sizes: Sizes, device: str, out: Path) -> list[str]:
    cmd = [sys.executable, str(BENCH / "sae_synthetic_stream.py"), "--device", device, "--out", str(out)]
    cmd += [*sizes.synthetic, "--seconds", str(sizes.synthetic_seconds)]
    if SAELENS_COPY.is_dir():  # SAELens for this step alone (its W&B stub must not reach Trainer)
        cmd += ["--saelens_path", str(SAELENS_COPY)]
    return cmd


def selected(name: str, only: list[str]) -> bool:
    """Whether a step runs: every step but the standalone ones when `only` is empty; else the
    steps named, with the model and index steps when a named step needs them."""
    if not only:
        return name not in STANDALONE
    if name in only:
        return True
    return name.startswith(("model-", "index")) and any(o not in STANDALONE for o in only)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes: checks the steps run (e.g. on the CPU)")
    ap.add_argument("--only", nargs="*", default=[], help="run only the steps named (and what they need)")
    ap.add_argument("--peer_python", default="", help="a python with bergson: timed beside assay build")
    ap.add_argument(
        "--synthetic_seconds", type=float, default=None, help="training seconds per SAE in sae-synthetic"
    )
    ap.add_argument(
        "--budget",
        type=float,
        default=540,
        help="seconds for the whole check, counted from gpu_check.sh's "
        "start when it ran this (GPU_CHECK_START): each step is cut to what is left",
    )
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path("/tmp/assay-gpu")
    work.mkdir(parents=True, exist_ok=True)
    info = machine()
    print(header(info), flush=True)
    results: dict = {"machine": info, "device": args.device, "smoke": args.smoke, "steps": {}}
    # the budget counts from gpu_check.sh's start (GPU_CHECK_START), wheel installs included
    deadline = float(os.environ.get("GPU_CHECK_START", time.time())) + args.budget
    sizes = SMOKE if args.smoke else Sizes()
    if args.synthetic_seconds is not None:
        sizes = replace(sizes, synthetic_seconds=args.synthetic_seconds)
    for name, cmd, limit in steps(sizes, args.device, args.out, work, args.peer_python):
        if not selected(name, args.only):
            continue
        left = deadline - time.time()
        if left < 20:
            results["steps"][name] = {"cmd": cmd, "rc": None, "skipped": "out of time"}
            continue
        run_step(name, cmd, int(min(limit, left)), args.out, results)
    (args.out / "gpu_check.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
    failed = [n for n, r in results["steps"].items() if r["rc"] not in (0, None)]
    ran = sum(r["rc"] is not None for r in results["steps"].values())
    print(f"gpu check: {ran} of {len(results['steps'])} steps ran; failed: {failed or 'none'}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
