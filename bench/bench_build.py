"""Benchmark `assay build` against its two yardsticks, side by side in one run.

1. The floor: the fastest plain forward+backward with parameter gradients (a training step minus
   the optimizer) over the very same examples and token batches at the same precision, among
   attention paths and batch layouts timed side by side (`--floors`, see bench/floors.py: eager or
   SDPA attention, padded with a mask, padded causal without one, packed padding-free).
2. The peer: bergson 2.5.1's `build` on the same model folder, tunes, projection and token
   batch (from a separate venv, `--peer_python`), whole process.

For each precision it reports the collection loop's tokens/s next to the floor's (medians of
alternating, warmed-up runs), the whole-process wall time and peak memory (max RSS) of
`assay build` and of `bergson build`, and per-example cosine of bf16 rows against fp32 rows.

    .venv/bin/python bench/bench_build.py --model smollm2-135m --tokens 6000 --repeats 3 \
        --peer_python .venv-peers/bin/python

Tokens are the real (non-padding) tokens of the batches; every side sees the same examples in the
same token batches. The header names the CPU and its ISA features (bench/machine.py).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

import numpy as np
import torch

from assay.attribution.build import GradientSetup, iter_gradients
from assay.attribution.collector import GradientCollector, linear_modules
from assay.attribution.projection import Projector
from assay.core.config import DataConfig, ModelConfig
from assay.core.memory import return_freed_memory
from assay.core.precision import PrecisionPolicy
from assay.lm.data import bucket_length, load_examples, load_table, token_batches
from assay.lm.lean import keep_compute_casts
from assay.lm.models import load_model, load_tokenizer, resolve_model_path

sys.path.insert(0, str(Path(__file__).parent))
from floors import (  # noqa: E402
    FLOORS,
    available,
    floor_batches,
    floor_pass,
    load_floor_models,
    time_alternating,
)
from machine import header, machine  # noqa: E402
from profiling import profile_table  # noqa: E402
from variants import forced_mask, norm_output_cast, plain_rotary_embedding  # noqa: E402


def pick_tunes(
    tokenizer, target_tokens: int, max_length: int, folder: Path, dataset: str = "abc-tunes"
) -> tuple[Path, int]:
    """The first texts (ABC tunes, train split, by default) that fit `max_length`, until
    `target_tokens`; as jsonl."""
    _, examples = load_examples(DataConfig(dataset=dataset, max_length=10**6), tokenizer)
    table = load_table(DataConfig(dataset=dataset))
    chosen, total = [], 0
    for i in range(len(examples)):
        n = int(examples.lengths[i])
        if n > max_length:
            continue
        chosen.append(table[int(i)]["text"])
        total += n
        if total >= target_tokens:
            break
    path = folder / "tunes.jsonl"
    with open(path, "w") as f:
        for text in chosen:
            f.write(json.dumps({"text": text}) + "\n")
    return path, len(chosen)


def collect_pass(setup, examples, positions_list) -> np.ndarray:
    rows = np.zeros((len(examples), setup.collector().dim), dtype=np.float32)
    for positions, grads, _, _ in iter_gradients(setup, examples, positions_list):
        rows[positions] = grads.cpu().numpy()
    return rows


class Fp32ProjectionSetup(GradientSetup):
    """The collector that casts every layer input and output gradient to fp32 before projecting
    (the default projects bf16 ones by a bf16 GEMM against the exact signs)."""

    def collector(self) -> GradientCollector:
        return GradientCollector(
            self.model,
            self.modules,
            self.projector,
            self.policy,
            self.normalizer,
            project_in_compute_dtype=False,
        )


@dataclass
class LoopOptions:
    """What the in-process loop benchmark times."""

    precision: str = "fp32"
    token_batch_size: int = 2048
    repeats: int = 3
    """Alternated timed rounds (after one warm-up round)."""
    p: int = 16
    fp32_projection: bool = False
    """Also time the collector that casts bf16 inputs to fp32 before projecting."""
    floors: tuple[str, ...] = ("sdpa", "sdpa-causal")
    device: str = "cpu"
    masked_collector: bool = False
    """Also time the collector given the padding mask (what it ran before assay.lm.padding)."""
    padded_collector: bool = False
    """Also time the collector on right-padded batches (what it ran before assay.lm.packing)."""
    compiled_collector: bool = False
    """Also time the collector with its elementwise steps compiled (`assay build --compile`); the
    warm-up round takes the compilation."""
    plain_rotary_collector: bool = False
    """Also time the collector with transformers' own rotary embedding (before `lean._Rotary`)."""
    norm_cast_collector: bool = False
    """Also time the collector with each norm's output cast once (`variants.norm_output_cast`)."""
    statistic: str = "median"
    """median, or min (on a loaded machine the least disturbed round)."""
    profile_rows: int = 0
    """After timing, print torch.profiler's costliest ops of one floor pass and one of ours."""


def loop_benchmark(model_name: str, data: Path, opt: LoopOptions) -> dict:
    """Alternate every floor variant and the collector over the same examples and batches;
    tokens/s of each by `opt.statistic` over rounds. The floor is the fastest variant."""
    return_freed_memory()  # as the `assay` command does; the floors share the process
    policy = PrecisionPolicy.resolve(opt.precision, opt.device)
    tokenizer = load_tokenizer(ModelConfig(model=model_name))
    _, examples = load_examples(DataConfig(dataset=str(data)), tokenizer)
    positions_list = token_batches(examples, opt.token_batch_size)
    pad = tokenizer.pad_token_id
    tokens = int(examples.lengths.sum())
    runnable = [f for f in opt.floors if available(f, policy.device) is None]
    models = load_floor_models(model_name, runnable, policy)
    # the collector's own copy, as `assay build` has it: frozen weights kept as their autocast casts
    collected = load_model(ModelConfig(model=model_name), policy)
    keep_compute_casts(collected, policy)
    setup = GradientSetup(
        collected, tokenizer, policy, linear_modules(collected), Projector(opt.p), None, pad
    )
    passes = {}
    for name in runnable:
        batches = floor_batches(FLOORS[name], examples, positions_list, pad, policy.device)
        passes[f"floor:{name}"] = partial(floor_pass, models[FLOORS[name].attention], batches, policy)
    rows: dict[str, np.ndarray] = {}

    def collect(
        key: str, s: GradientSetup, masked: bool = False, plain_rotary: bool = False, norm_cast: bool = False
    ) -> None:
        with forced_mask(masked), plain_rotary_embedding(plain_rotary), norm_output_cast(norm_cast):
            rows[key] = collect_pass(s, examples, positions_list)

    passes["ours"] = partial(collect, "ours", setup)
    if opt.masked_collector:  # the mask only exists in padded batches
        passes["masked"] = partial(collect, "masked", replace(setup, packed=False), True)
    if opt.padded_collector:
        passes["padded"] = partial(collect, "padded", replace(setup, packed=False))
    if opt.compiled_collector:
        passes["compiled"] = partial(collect, "compiled", replace(setup, compiled=True))
    if opt.plain_rotary_collector:
        passes["plain_rotary"] = partial(collect, "plain_rotary", setup, plain_rotary=True)
    if opt.norm_cast_collector:
        passes["norm_cast"] = partial(collect, "norm_cast", setup, norm_cast=True)
    bf16_inputs = policy.compute_dtype == torch.bfloat16  # the only inputs the default projects as they are
    if opt.fp32_projection and bf16_inputs:
        passes["fp32_projection"] = partial(collect, "fp32_projection", Fp32ProjectionSetup(**vars(setup)))
    times = time_alternating(passes, opt.repeats)
    stat = min if opt.statistic == "min" else statistics.median
    tok_s = {name: tokens / stat(t) for name, t in times.items()}
    floor = max((f"floor:{n}" for n in runnable), key=lambda n: tok_s[n])
    for name in (floor, "ours") if opt.profile_rows else ():
        print(f"profile of one {name} pass ({opt.precision}):", flush=True)
        print(profile_table(passes[name], policy.device, opt.profile_rows), flush=True)
    extra: dict = {}
    if "fp32_projection" in times:
        extra["fp32_projection_tok_s"] = tok_s["fp32_projection"]
        extra["min_cosine_to_fp32_projection"] = float(cosines(rows["ours"], rows["fp32_projection"]).min())
    for variant in ("masked", "padded", "compiled", "plain_rotary", "norm_cast"):
        if variant in times:
            extra[f"{variant}_collector_tok_s"] = tok_s[variant]
            extra[f"{variant}_max_rel_diff"] = float(
                np.abs(rows[variant] - rows["ours"]).max() / max(np.abs(rows["ours"]).max(), 1e-30)
            )
    return {
        **extra,
        "precision": opt.precision,
        "statistic": opt.statistic,
        "tokens": tokens,
        "padded_tokens": int(
            sum(len(b) * bucket_length(int(examples.lengths[b].max())) for b in positions_list)
        ),
        "batches": len(positions_list),
        "floors_tok_s": {n.split(":", 1)[1]: v for n, v in tok_s.items() if n.startswith("floor:")},
        "floors_skipped": {n: available(n, policy.device) for n in opt.floors if n not in runnable},
        "floor": floor.split(":", 1)[1],
        "floor_tok_s": tok_s[floor],
        "ours_tok_s": tok_s["ours"],
        "ours_over_floor_time": tok_s[floor] / tok_s["ours"],
        "runs_s": times,
        "rows": rows["ours"],
    }


def summary_line(loop: dict) -> str:
    """One readable line: every floor's tokens/s, which is the floor, the collector against it."""
    floors = ", ".join(f"{n} {v:,.0f}" for n, v in loop["floors_tok_s"].items())
    skipped = "".join(f"; {n} skipped ({why})" for n, why in loop["floors_skipped"].items())
    return (
        f"{loop['precision']}: floors (tok/s) {floors}{skipped}; floor = {loop['floor']}; "
        f"assay build loop {loop['ours_tok_s']:,.0f} tok/s "
        f"= {loop['ours_over_floor_time']:.2f}x the floor's time; "
        f"padded/real tokens {loop['padded_tokens'] / loop['tokens']:.3f}"
        + "".join(
            f"; {label} {loop[f'{key}_collector_tok_s']:,.0f} tok/s"
            for key, label in (
                ("padded", "on padded batches"),
                ("compiled", "compiled"),
                ("plain_rotary", "with transformers' rotary"),
                ("norm_cast", "with each norm's output cast once"),
            )
            if f"{key}_collector_tok_s" in loop
        )
    )


def timed(cmd: list[str], env: dict | None = None) -> dict:
    """Whole-process wall time (s) and peak RSS (GB) through /usr/bin/time (wall time alone where
    it is missing, as on the GPU machine's image)."""
    have_time = Path("/usr/bin/time").exists()
    full = ["/usr/bin/time", "-f", "TIME %e %M", *cmd] if have_time else cmd
    start = time.perf_counter()
    res = subprocess.run(full, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - start
    if res.returncode != 0:
        print(f"{' '.join(cmd)} failed:\n{res.stderr[-3000:]}", file=sys.stderr)
        return {"error": res.stderr.strip().splitlines()[-1] if res.stderr.strip() else "failed"}
    if not have_time:
        return {"wall_s": wall}
    line = [ln for ln in res.stderr.splitlines() if ln.startswith("TIME ")][-1]
    wall_s, rss_kb = line.split()[1:]
    return {"wall_s": float(wall_s), "peak_gb": int(rss_kb) / 1024**2}


def build_commands(args, data: Path, precision: str, work: Path) -> tuple[list[str], list[str]]:
    """`assay build` and `bergson build` over the same tunes, model, projection and token batch."""
    ours_cmd = [
        sys.executable,
        "-m",
        "assay",
        "build",
        str(work / f"ours-{precision}"),
        "--model",
        args.model,
    ]
    ours_cmd += ["--dataset", str(data), "--precision", precision, "--projection_dim", str(args.p)]
    ours_cmd += ["--token_batch_size", str(args.token_batch_size), "--overwrite", "--threads", "0"]
    ours_cmd += ["--device", args.device] + [f"--{flag}" for flag in args.ours_flags]
    model_dir = resolve_model_path(args.model)
    peer_cmd = [
        args.peer_python,
        "-m",
        "bergson",
        "build",
        str(work / f"peer-{precision}"),
        "--model",
        model_dir,
    ]
    peer_cmd += ["--dataset", str(data), "--truncation", "--token_batch_size", str(args.token_batch_size)]
    peer_cmd += ["--projection_dim", str(args.p), "--overwrite", "--precision", _peer_precision(precision)]
    if _is_moe(model_dir):  # bergson collects fused experts only when told where they are
        peer_cmd += ["--moe_experts", "model.layers.*.mlp.experts"]
    return ours_cmd, peer_cmd


def _is_moe(model_dir: str) -> bool:
    path = Path(model_dir) / "config.json"
    config = json.loads(path.read_text()) if path.is_file() else {}
    return any(key in config for key in ("num_local_experts", "num_experts"))


def process_benchmark(args, data: Path, precision: str, work: Path) -> dict:
    """Alternating whole-process runs of `assay build` and (optionally) `bergson build`; with
    `--one_tune_process`, one more run of each over the first tune alone: what the process holds
    before the loop's working set (imports, model, tokenizer, one small batch)."""
    ours_cmd, peer_cmd = build_commands(args, data, precision, work)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    out: dict = {"ours": [], "peer": []}
    # the loop benchmark warms the tokenization cache and the page cache; without it, one untimed run
    ours_env = {**os.environ, **dict(kv.split("=", 1) for kv in args.ours_env)}
    if args.no_loop:
        timed(ours_cmd, ours_env)
    for _ in range(args.process_repeats):
        out["ours"].append(timed(ours_cmd, ours_env))
        if args.peer_python:
            out["peer"].append(timed(peer_cmd, env))
    if args.one_tune_process:
        one = work / "one-tune.jsonl"
        one.write_text(data.read_text().splitlines()[0] + "\n")
        (work / "one-tune").mkdir(exist_ok=True)
        ours_one, peer_one = build_commands(args, one, precision, work / "one-tune")
        out["ours_one_tune"] = timed(ours_one, ours_env)
        if args.peer_python:
            out["peer_one_tune"] = timed(peer_one, env)
    return out


def process_line(precision: str, runs: dict) -> str:
    """Median wall time and peak memory of each side's whole processes, and their ratios."""

    def median(side: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[side])

    line = f"{precision} whole process: assay build {median('ours', 'wall_s'):.2f} s, "
    line += f"{median('ours', 'peak_gb'):.3f} GB"
    if runs["peer"]:
        line += f"; bergson build {median('peer', 'wall_s'):.2f} s, {median('peer', 'peak_gb'):.3f} GB"
        line += f" (ratios {median('ours', 'wall_s') / median('peer', 'wall_s'):.2f}x time, "
        line += f"{median('ours', 'peak_gb') / median('peer', 'peak_gb'):.2f}x memory)"
    for side, name in (("ours_one_tune", "assay"), ("peer_one_tune", "bergson")):
        if "peak_gb" in runs.get(side, {}):
            line += f"; {name} on one tune {runs[side]['peak_gb']:.3f} GB"
    return line


def _peer_precision(precision: str) -> str:
    return "bf16" if precision.startswith("bf16") else precision  # bergson's bf16 = weights in bf16


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1) + 1e-30)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="assay-tiny")
    ap.add_argument("--dataset", default="abc-tunes", help="where the texts come from (train split)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (the loop and `assay build --device`)")
    ap.add_argument("--tokens", type=int, default=6000, help="ABC-tune tokens to collect")
    ap.add_argument("--max_length", type=int, default=512, help="skip tunes longer than this")
    ap.add_argument("--precisions", nargs="+", default=["fp32", "bf16"])
    ap.add_argument("--token_batch_size", type=int, default=2048)
    ap.add_argument("--p", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--process_repeats", type=int, default=2)
    ap.add_argument("--peer_python", default="", help="python of a venv with bergson 2.5.1")
    ap.add_argument(
        "--floors",
        nargs="+",
        default=["eager", "sdpa", "sdpa-causal", "sdpa-packed"],
        choices=list(FLOORS),
        help="plain forward+backward variants timed side by side (bench/floors.py); the fastest is the floor",
    )
    ap.add_argument("--no_process", action="store_true", help="skip whole-process runs")
    ap.add_argument("--no_loop", action="store_true", help="skip the in-process loop timing")
    ap.add_argument(
        "--one_tune_process",
        action="store_true",
        help="also run each side's whole process once over the first tune alone: the peak memory "
        "it holds before the loop's working set",
    )
    ap.add_argument(
        "--fp32_projection",
        action="store_true",
        help="also time the loop with every input cast to fp32 before projecting, and report "
        "the cosine of its rows to the default's",
    )
    ap.add_argument(
        "--ours_env", nargs="*", default=[], help="VAR=VALUE set for `assay build` only (e.g. allocator)"
    )
    ap.add_argument(
        "--ours_flags",
        nargs="*",
        default=[],
        help="flags added to `assay build`'s whole-process command (e.g. keep_freed_memory, without --)",
    )
    ap.add_argument(
        "--masked_collector",
        action="store_true",
        help="also time the collector given the padding mask (as before assay.lm.padding)",
    )
    ap.add_argument(
        "--padded_collector",
        action="store_true",
        help="also time the collector on right-padded batches (as before assay.lm.packing)",
    )
    ap.add_argument(
        "--compiled_collector",
        action="store_true",
        help="also time the collector with its elementwise steps compiled (assay build --compile)",
    )
    ap.add_argument(
        "--plain_rotary_collector",
        action="store_true",
        help="also time the collector with transformers' own rotary embedding (as before lean._Rotary)",
    )
    ap.add_argument(
        "--norm_cast_collector",
        action="store_true",
        help="also time the collector with each RMSNorm's output cast once to the autocast dtype "
        "(a probe of one cast per shared input; its rows differ from the default's)",
    )
    ap.add_argument(
        "--statistic",
        choices=["median", "min"],
        default="median",
        help="over the timed rounds; min is the least disturbed round on a loaded machine",
    )
    ap.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="ROWS",
        help="after timing, print torch.profiler's ROWS costliest ops (device self time) of one "
        "pass of the fastest floor and one of `assay build`'s loop",
    )
    ap.add_argument("--out", default="", help="write the results as JSON here")
    return ap


def main() -> None:
    args = parser().parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        tokenizer = load_tokenizer(ModelConfig(model=args.model))
        data, n = pick_tunes(tokenizer, args.tokens, args.max_length, work, args.dataset)
        info = machine()
        print(header(info), flush=True)
        print(f"model {args.model}: {n} ABC tunes, threads {torch.get_num_threads()}", flush=True)
        results = {"machine": info, "model": args.model, "tunes": n, "threads": info["threads"], "runs": []}
        rows = {}
        for precision in args.precisions:
            loop: dict = {"precision": precision}
            if not args.no_loop:
                opt = LoopOptions(
                    precision=precision,
                    token_batch_size=args.token_batch_size,
                    repeats=args.repeats,
                    p=args.p,
                    fp32_projection=args.fp32_projection,
                    floors=tuple(args.floors),
                    device=args.device,
                    masked_collector=args.masked_collector,
                    padded_collector=args.padded_collector,
                    compiled_collector=args.compiled_collector,
                    plain_rotary_collector=args.plain_rotary_collector,
                    norm_cast_collector=args.norm_cast_collector,
                    statistic=args.statistic,
                    profile_rows=args.profile,
                )
                loop = loop_benchmark(args.model, data, opt)
                rows[precision] = loop.pop("rows")
                print(json.dumps(loop), flush=True)
                print(summary_line(loop), flush=True)
            if not args.no_process:
                loop["process"] = process_benchmark(args, data, precision, work)
                print(json.dumps(loop["process"]), flush=True)
                runs = loop["process"]["ours"] + loop["process"]["peer"]
                if runs and all("peak_gb" in r for r in runs):  # one line of medians and ratios
                    print(process_line(precision, loop["process"]), flush=True)
            results["runs"].append(loop)
        if "fp32" in rows:
            for precision, r in rows.items():
                if precision != "fp32":
                    c = cosines(r, rows["fp32"])
                    q = np.quantile(c, [0, 0.05, 0.5])
                    results[f"cosine_{precision}_vs_fp32"] = {"min": q[0], "p5": q[1], "median": q[2]}
                    print(f"cosine {precision} vs fp32: min {q[0]:.4f} p5 {q[1]:.4f} median {q[2]:.4f}")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2, default=float) + "\n")


if __name__ == "__main__":
    main()
