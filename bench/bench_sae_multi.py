"""Several SAEs from one pass of the language model vs one run per SAE: wall time and peak memory.

  .venv/bin/python bench/bench_sae_multi.py --out /tmp/multi --hookpoints model.layers.1 model.layers.2 \
      model.layers.3

Runs `assay sae train` once with --hookpoints (and --sweep_k when given), then once per SAE
alone, each in its own process (peak resident memory from the OS), interleaved `--repeats`
times; prints one JSON line per run and a summary line with the ratios. The SAEs of the
combined run equal the separate runs' (tests/sae/test_sae_train.py), so only cost differs. Figures
on a shared machine are provisional.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


def run(cmd: list[str]) -> dict[str, float]:
    """Wall seconds and peak RSS (MiB) of one child process (its own rusage, from wait4)."""
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - started
    if status != 0:
        raise SystemExit(f"failed ({status}): {' '.join(cmd)}")
    return {"seconds": seconds, "peak_mib": usage.ru_maxrss / 1024}  # ru_maxrss: KiB on Linux


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--model", default="assay-tiny")
    p.add_argument("--hookpoints", nargs="+", default=["model.layers.1", "model.layers.2", "model.layers.3"])
    p.add_argument("--sweep_k", nargs="*", type=int, default=[])
    p.add_argument("--tokens", type=int, default=204_800)
    p.add_argument("--precision", default="fp32")
    p.add_argument("--repeats", type=int, default=1)
    args = p.parse_args()
    base = [sys.executable, "-m", "assay", "sae", "train", "--model", args.model, "--dataset", "shakespeare"]
    base += ["--training_tokens", str(args.tokens), "--precision", args.precision, "--eval_contexts", "0"]
    base += ["--overwrite"]
    ks = args.sweep_k or [None]
    cpu = next(
        (ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), ""
    )
    for r in range(args.repeats):
        combined = base + [str(args.out / f"combined-{r}"), "--hookpoints", *args.hookpoints]
        combined += ["--sweep_k", *map(str, args.sweep_k)] if args.sweep_k else []
        rows: list[dict[str, Any]] = [
            {"run": "combined", "saes": len(args.hookpoints) * len(ks), **run(combined)}
        ]
        for hook in args.hookpoints:
            for k in ks:
                alone = base + [str(args.out / f"alone-{r}-{hook}-{k}"), "--hookpoint", hook]
                alone += ["--k", str(k)] if k else []
                rows.append({"run": f"alone {hook}" + (f" k={k}" if k else ""), "saes": 1, **run(alone)})
        for row in rows:
            print(json.dumps({**row, "repeat": r}), flush=True)
        separate = sum(row["seconds"] for row in rows[1:])
        summary = {
            "repeat": r,
            "combined_s": rows[0]["seconds"],
            "separate_s": separate,
            "speedup": separate / rows[0]["seconds"],
            "load_avg": os.getloadavg(),
            "cpu": cpu or platform.processor(),
            "threads": os.environ.get("OMP_NUM_THREADS", "default"),
            "combined_peak_mib": rows[0]["peak_mib"],
            "largest_alone_peak_mib": max(row["peak_mib"] for row in rows[1:]),
        }
        print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
