"""`assay` commands on a quiet machine and beside other work, under OpenMP wait policies.

torch's CPU kernels run on an OpenMP thread pool (GNU libgomp in the pip wheels) whose idle
threads spin before they sleep. When another process holds one of the cores, a spinning thread
burns the time slice the thread it waits for needs, and every parallel region (thousands per
training step on a small model) can wait a scheduler tick. This script measures that: each
command is run whole-process, alternating the settings, first quiet and then beside `--busy`
single-threaded busy loops (a stand-in for the user's other work), and prints wall-time medians.

Settings (`--policies`): `default` is libgomp's own (idle threads spin 300,000 times, then
sleep: what a process gets where nothing sets OMP_WAIT_POLICY, and what `assay` ran with before
it chose a policy), spelled GOMP_SPINCOUNT=300000 so that `assay` keeps it; `passive` sleeps at
once (OMP_WAIT_POLICY=PASSIVE); `spin1k` ... `spin100k` spin that many times first;
`assay` passes the environment as given (assay's own choice: `assay.core.threads`).

    python bench/bench_contention.py --repeats 3 -- assay build /tmp/b --model /tmp/tiny-2m \\
        --dataset tunes.jsonl --overwrite

The header names the CPU and ISA features (bench/machine.py).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

from machine import header, machine

POLICIES = {
    "default": {"GOMP_SPINCOUNT": "300000"},
    "passive": {"OMP_WAIT_POLICY": "PASSIVE"},
    "spin1k": {"GOMP_SPINCOUNT": "1000"},
    "spin3k": {"GOMP_SPINCOUNT": "3000"},
    "spin10k": {"GOMP_SPINCOUNT": "10000"},
    "spin30k": {"GOMP_SPINCOUNT": "30000"},
    "spin100k": {"GOMP_SPINCOUNT": "100000"},
    "assay": {},
}
BUSY_LOOP = "while True: pass"


@contextmanager
def busy(n: int) -> Iterator[None]:
    """`n` single-threaded busy processes for the duration of the block."""
    procs = [subprocess.Popen([sys.executable, "-c", BUSY_LOOP]) for _ in range(n)]
    try:
        time.sleep(0.5 if n else 0)
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()


def wall(cmd: list[str], env: dict[str, str]) -> float:
    start = time.perf_counter()
    res = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if res.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{res.stderr[-2000:]}")
    return time.perf_counter() - start


def command(args: list[str]) -> list[str]:
    """`assay ...` as `python -m assay ...` with this interpreter (the venv the script runs in)."""
    if args and args[0] == "assay":
        return [sys.executable, "-m", "assay", *args[1:]]
    if not args or shutil.which(args[0]) is None and not os.path.exists(args[0]):
        raise SystemExit(f"no command to run: {' '.join(args) or '(none)'}; give it after --")
    return args


def _runs(times: list[float]) -> str:
    return " ".join(f"{x:.1f}" for x in times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--policies", nargs="+", default=["default", "passive", "assay"], choices=list(POLICIES))
    ap.add_argument("--repeats", type=int, default=3, help="runs per setting and load, alternated")
    ap.add_argument("--busy", nargs="+", type=int, default=[0, 1], help="competing busy processes")
    ap.add_argument("--out", default="", help="write the results as JSON here")
    ap.add_argument("cmd", nargs=argparse.REMAINDER, help="the command, after --")
    args = ap.parse_args()
    cmd = command([a for a in args.cmd if a != "--"])
    info = machine()
    print(header(info), flush=True)
    print("command:", " ".join(cmd), flush=True)
    env0 = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    wall(cmd, env0)  # warm the page cache and any caches the command fills
    results: dict[str, dict[str, list[float]]] = {}
    for n in args.busy:
        times: dict[str, list[float]] = {p: [] for p in args.policies}
        with busy(n):
            for _ in range(args.repeats):
                for policy in args.policies:
                    times[policy].append(wall(cmd, {**env0, **POLICIES[policy]}))
        results[f"busy{n}"] = times
        cells = ", ".join(f"{p} {statistics.median(t):.2f} s ({_runs(t)})" for p, t in times.items())
        print(f"{n} busy process(es): {cells}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"machine": info, "command": cmd, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
