"""How long torch's idle CPU threads spin before they sleep: briefly, unless the user chose.

torch's CPU kernels run on an OpenMP thread pool (GNU libgomp in the pip wheels). By default an
idle libgomp thread spins 300,000 times before it sleeps. On a quiet machine that saves a wake-up
per parallel region; beside any other busy process it is ruinous: a spinning thread burns the
time slice that the thread it waits for needs, and a small model's step has thousands of
parallel regions, each of which can then wait a scheduler tick. Sleeping at once
(OMP_WAIT_POLICY=PASSIVE) is the cure under contention but costs every region a wake-up on a
quiet machine. A spin of 10,000 keeps the quiet speed and most of the cure. Measured with
`bench/bench_contention.py` (docs/BENCHMARKS.md, "Beside other work"), `assay build` on a
2.2M-parameter Llama beside one busy process: 18.6 s spinning 300,000, 8.1 s spinning 10,000,
6.0 s passive; quiet: 4.9 s, 4.9 s, 5.7 s.

libgomp reads the setting once, when torch loads it, so `short_spin` must run before
`import torch`: the `assay` entry point calls it first. A wait policy or spin count the user set
in the environment is kept; library users (notebooks, scripts) choose for their own process.
"""

from __future__ import annotations

import os

WAIT_POLICY = "OMP_WAIT_POLICY"
SPIN_COUNT = "GOMP_SPINCOUNT"
SHORT_SPIN = "10000"


def short_spin() -> None:
    """Let idle OpenMP threads spin 10,000 times before they sleep (GOMP_SPINCOUNT), unless the
    environment already sets a wait policy or a spin count."""
    if WAIT_POLICY not in os.environ and SPIN_COUNT not in os.environ:
        os.environ[SPIN_COUNT] = SHORT_SPIN
