"""Scaling from 1 to N torchrun processes: `assay build` and `assay sae train` on assay-tiny.

Every configuration gets the same cores: 1 process x C threads against N processes x C/N
threads (OMP_NUM_THREADS), so the figure is what data parallelism buys over intra-op threads
on one machine. Reports the command's wall time (process start, model load and the run) and
its in-loop throughput (tokens/s, summed over ranks).

    python bench/bench_distributed.py --procs 1 2 --cores 2
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(nproc: int, threads: int, args: list[str]) -> tuple[float, str]:
    """(wall seconds, stdout) of `torchrun --nproc_per_node nproc -m assay ARGS`."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}"]
    cmd += ["--master_addr=127.0.0.1", f"--master_port={_port()}", "-m", "assay", *args]
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        sys.exit(f"failed: {' '.join(cmd)}\n{proc.stderr[-3000:]}")
    return wall, proc.stdout


def bench_build(nproc: int, threads: int, out: Path, a: argparse.Namespace) -> dict:
    args = ["build", str(out), "--model", a.model, "--dataset", "abc-tunes", "--max_samples", str(a.examples)]
    args += ["--precision", "fp32", "--projection_dim", "16", "--threads", str(threads)]
    wall, stdout = launch(nproc, threads, args)
    tok_s = float(re.findall(r"([\d,]+) tokens/s", stdout)[-1].replace(",", ""))
    return {"wall_s": wall, "tokens_per_s": tok_s}


def bench_sae(nproc: int, threads: int, out: Path, a: argparse.Namespace) -> dict:
    args = ["sae", "train", str(out), "--model", a.model, "--dataset", "shakespeare", "--precision", "fp32"]
    args += ["--hookpoint", "model.layers.2", "--training_tokens", str(a.sae_tokens)]
    args += ["--batch_tokens", "1024", "--eval_contexts", "0", "--threads", str(threads)]
    wall, _ = launch(nproc, threads, args)
    summary = json.loads((out / "summary.json").read_text())
    return {"wall_s": wall, "tokens_per_s": summary["tokens_per_s"] * nproc}  # rank 0's rate x ranks


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--procs", type=int, nargs="+", default=[1, 2])
    p.add_argument("--cores", type=int, default=os.cpu_count() or 1, help="cores shared by the processes")
    p.add_argument("--model", default="assay-tiny")
    p.add_argument("--examples", type=int, default=256, help="abc-tunes examples for build")
    p.add_argument("--sae_tokens", type=int, default=65_536, help="SAE training tokens")
    a = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, fn in (("build", bench_build), ("sae train", bench_sae)):
            base = None
            for n in a.procs:
                r = fn(n, max(1, a.cores // n), Path(tmp) / f"{name.replace(' ', '-')}-{n}", a)
                base = base or r
                r |= {"command": name, "procs": n, "threads_per_proc": max(1, a.cores // n)}
                r["speedup_wall"] = base["wall_s"] / r["wall_s"]
                r["speedup_tokens_per_s"] = r["tokens_per_s"] / base["tokens_per_s"]
                rows.append(r)
                print(json.dumps(r), flush=True)
    print("\n| command | processes x threads | wall s | tokens/s (in loop) | speed-up wall | speed-up loop |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['command']} | {r['procs']} x {r['threads_per_proc']} | {r['wall_s']:.1f} | "
            f"{r['tokens_per_s']:,.0f} | {r['speedup_wall']:.2f} | {r['speedup_tokens_per_s']:.2f} |"
        )


if __name__ == "__main__":
    main()
