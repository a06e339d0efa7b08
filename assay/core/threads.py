"""How torch's idle CPU threads wait: asleep, unless the user chose otherwise.

torch's CPU kernels run on an OpenMP thread pool (GNU libgomp in the pip wheels). By default an
idle libgomp thread spins (300,000 times) before it sleeps. On a quiet machine that saves a wake-up
per parallel region; beside any other busy process it is ruinous: a spinning thread burns the
time slice that the thread it waits for needs, and a small model's training step has thousands
of parallel regions, each of which can then wait a scheduler tick. Measured with
`bench/bench_contention.py` (docs/BENCHMARKS.md, "Beside other work"): `assay build` and
`assay demo` ran several times slower beside one single-threaded busy process with spinning
threads, and at about the quiet speed with sleeping ones.

libgomp reads its policy once, when torch loads it, so `sleep_idle_threads` must run before
`import torch`: the `assay` entry point calls it first. A policy or spin count the user set in the
environment is kept; library users (notebooks, scripts) choose for their own process.
"""

from __future__ import annotations

import os

WAIT_POLICY = "OMP_WAIT_POLICY"
SPIN_COUNT = "GOMP_SPINCOUNT"


def sleep_idle_threads() -> None:
    """Make idle OpenMP threads sleep at once (OMP_WAIT_POLICY=PASSIVE) unless the environment
    already sets a wait policy or libgomp's spin count."""
    if WAIT_POLICY not in os.environ and SPIN_COUNT not in os.environ:
        os.environ[WAIT_POLICY] = "PASSIVE"
