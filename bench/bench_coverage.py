"""Coverage-seeking selection at scale: facility, k-center, cluster-balanced, TypiClust on a memmap.

Writes N x D random clustered fp16 rows (default 100,000 x 3,584, like a projected gradient
index: 717 MB) to a memmap in a temporary folder, then runs each strategy at k (default 10,000)
in its own process, reading the memmap read-only, and prints seconds and peak memory: anonymous
memory (what the algorithm allocates) and file-backed pages of the memmap mapped into the
process (page cache, reclaimable), sampled every 50 ms.

    python bench/bench_coverage.py                      # the full-size run
    python bench/bench_coverage.py --rows 20000 --strategies kcenter

Clusters: 100 centres with Zipf-like sizes (the largest ~19% of rows, the smallest a few dozen);
a row is 0.65 x its centre + unit Gaussian noise, so rows of one cluster have cosine ~0.3 and
rows of different clusters ~0. "typical" (the top k by cosine with the mean row) is the baseline;
clusters_covered counts the clusters a selection has rows from. Timings depend on the machine
and on what else runs on it.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from machine import header  # noqa: E402

STRATEGIES = ("typical", "facility", "kcenter", "balanced", "typiclust")


def write_rows(path: Path, rows: int, dim: int, seed: int = 0) -> np.ndarray:
    """Clustered fp16 rows [rows, dim] written block by block (never all in memory); labels returned."""
    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, 101) ** 1.1
    labels = rng.choice(100, size=rows, p=weights / weights.sum())
    centres = rng.standard_normal((100, dim)).astype(np.float32)
    out = np.lib.format.open_memmap(path, mode="w+", dtype=np.float16, shape=(rows, dim))
    for start in range(0, rows, 8192):
        stop = min(start + 8192, rows)
        noise = rng.standard_normal((stop - start, dim), dtype=np.float32)
        out[start:stop] = 0.65 * centres[labels[start:stop]] + noise
    out.flush()
    del out
    return labels


class MemorySampler(threading.Thread):
    """Peak RssAnon and RssFile of this process, from /proc/self/status every 50 ms."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peak = {"RssAnon": 0, "RssFile": 0}
        self.stop = threading.Event()

    def sample(self) -> None:
        for line in Path("/proc/self/status").read_text().splitlines():
            key = line.split(":")[0]
            if key in self.peak:
                self.peak[key] = max(self.peak[key], int(line.split()[1]) * 1024)

    def run(self) -> None:
        while not self.stop.wait(0.05):
            self.sample()


def typical(x: np.ndarray, k: int) -> np.ndarray:
    """The baseline coverage must beat: the top k rows by cosine with the mean unit row (two passes)."""
    from assay.selection.similarity import Rows

    rows = Rows(x, "cosine")
    mean = sum(b.sum(0) for _, b in rows.blocks())  # [D]
    scores = torch.cat([b @ mean for _, b in rows.blocks()])  # [N]
    return scores.topk(k).indices.numpy()


def run_one(name: str, path: str, k: int, threads: int, labels_path: str) -> None:
    """Child process: one strategy on the memmap; prints one JSON line."""
    from assay.selection.coverage import Selection, select

    torch.set_num_threads(threads)
    x = np.load(path, mmap_mode="r")
    sampler = MemorySampler()
    sampler.start()
    t0 = time.perf_counter()
    sel = Selection(typical(x, k), None, {}) if name == "typical" else select(name, x, k, seed=0)
    seconds = time.perf_counter() - t0
    sampler.stop.set()
    sampler.sample()
    labels = np.load(labels_path)
    covered = len(np.unique(labels[sel.positions]))
    facts = {key: v for key, v in sel.details.items() if isinstance(v, (int, float, str))}
    print(
        json.dumps(
            {
                "strategy": name,
                "seconds": round(seconds, 1),
                "peak_anon_mb": round(sampler.peak["RssAnon"] / 2**20),
                "peak_file_mb": round(sampler.peak["RssFile"] / 2**20),
                "max_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
                "clusters_covered": covered,
                "selected": len(sel.positions),
                **facts,
            }
        ),
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--dim", type=int, default=3584)
    parser.add_argument("--k", type=int, default=10_000)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    parser.add_argument("--dir", default=None, help="where to write the memmap (default: a temp folder)")
    parser.add_argument("--child", nargs=3, metavar=("NAME", "PATH", "LABELS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        run_one(args.child[0], args.child[1], args.k, args.threads, args.child[2])
        return
    cores = os.cpu_count()
    print(f"{header()}; {cores} logical cores; {args.threads} threads asked for")
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        path, labels_path = Path(tmp) / "rows.npy", Path(tmp) / "labels.npy"
        t0 = time.perf_counter()
        np.save(labels_path, write_rows(path, args.rows, args.dim))
        size, took = path.stat().st_size / 2**20, time.perf_counter() - t0
        print(f"wrote {args.rows:,} x {args.dim:,} fp16 rows ({size:.0f} MiB) in {took:.0f} s")
        for name in args.strategies.split(","):
            cmd = [sys.executable, __file__, "--k", str(args.k), "--threads", str(args.threads)]
            out = subprocess.run(
                [*cmd, "--child", name, str(path), str(labels_path)], capture_output=True, text=True
            )
            if out.returncode != 0:
                print(f"{name}: failed\n{out.stderr}")
                continue
            print(out.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    main()
