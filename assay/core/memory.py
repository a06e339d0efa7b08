"""Process-wide memory settings (freed tensor memory back to the OS (glibc), import-time objects
out of the cyclic garbage collector) and a probe of a block's peak resident memory."""

from __future__ import annotations

import ctypes
import gc
import os
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

M_MMAP_THRESHOLD = -3  # mallopt parameter numbers (malloc.h)
M_TRIM_THRESHOLD = -1
MMAP_THRESHOLD_BYTES = 2 << 20
REUSE_LIMIT_BYTES = 1 << 30


def return_freed_memory() -> None:
    """Serve every allocation of 2 MiB or more from its own mapping, returned to the OS when freed.

    glibc raises its mmap threshold after each large free (up to 32 MiB), so activation-sized
    tensors soon come from heap arenas, which fragment and keep freed memory, and a process's
    peak resident memory grows well past its live tensors (see bench/bench_build.py's peaks).
    Fixing the threshold, as the MALLOC_MMAP_THRESHOLD_ variable does, keeps the peak near the
    live peak. Each mapping is zeroed and faulted in anew, though, so the threshold is a trade:
    at 2 MiB SmolLM2-135M's hidden-sized bf16 tensors (batches of up to ~1,800 tokens) come from
    the heap, and `assay build` ran 12-13% faster than at 1 MiB for a peak 0-10% higher
    (docs/BENCHMARKS.md, "The allocator's threshold"). A threshold the user set in the
    environment is left alone; no-op off glibc.
    """
    _mallopt({M_MMAP_THRESHOLD: MMAP_THRESHOLD_BYTES})


def reuse_freed_memory(limit: int = REUSE_LIMIT_BYTES) -> None:
    """Serve allocations up to `limit` bytes from the heap and keep what is freed there for reuse
    (glibc's mmap and trim thresholds): for loops that allocate the same large temporaries every
    step, such as SAE training, whose [tokens, latents] tensors (64 MiB at 4,096 x 4,096 fp32)
    are otherwise fresh mappings the kernel must fault in and zero at every use (above glibc's
    32 MiB dynamic ceiling even by default).
    The opposite trade of `return_freed_memory`; a threshold set in the environment is left alone.
    """
    _mallopt({M_MMAP_THRESHOLD: limit, M_TRIM_THRESHOLD: limit})


MATMUL_CACHE = "LRU_CACHE_CAPACITY"
"""ideep's per-shape cache of oneDNN matmul set-ups (torch's bf16/fp16 CPU matmuls), default 1024."""
SMALL_MATMUL_CACHE = "1"


def small_matmul_cache() -> None:
    """Keep one entry in ideep's cache of matmul set-ups (LRU_CACHE_CAPACITY) unless the user set it.

    torch runs low-precision CPU matmuls through ideep, which keeps the set-up of every input
    shape it has seen. A run over length-bucketed batches sees a new shape every few batches, and
    the entries stay: on the random 2.1M-parameter Llama (`bench/bench_build.py`), `assay build
    --precision bf16` peaked 30–35 MB lower with one entry, at the same speed (there and on
    SmolLM2-135M, where the peak did not move). oneDNN's own primitive cache, below it, still
    serves repeated shapes. ideep reads the variable at its first matmul, so this must run
    before any; the `assay` commands call it first.
    """
    os.environ.setdefault(MATMUL_CACHE, SMALL_MATMUL_CACHE)


def _mallopt(settings: dict[int, int]) -> None:
    """glibc's mallopt(param, value) for each setting; nothing when the user set the mmap
    threshold in the environment, or off glibc (musl and others keep their own policy)."""
    if not sys.platform.startswith("linux") or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc (e.g. musl): its allocator already returns large blocks
        return
    for param, value in settings.items():
        libc.mallopt(param, value)


@contextmanager
def frozen_imports() -> Iterator[None]:
    """Freeze what the block imports out of Python's cyclic garbage collector.

    torch, transformers and datasets make millions of objects at import that live as long as
    the process, and every full collection walks all of them again: several times while a
    command sets a model up, and once more at interpreter shutdown. Collection
    is paused during the imports and their objects are frozen (gc.freeze), so later
    collections walk only what the command itself makes. For whole processes only: frozen
    objects are never collected, which suits imported modules, not a caller's objects.
    """
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        gc.enable()


class PeakResident:
    """The process's peak resident memory while a block runs (`with PeakResident() as peak: ...;
    peak.gb`), sampled from /proc/self/status every `interval` seconds by a daemon thread.

    Resident memory counts the pages of memory-mapped files as they are read (an index scored from
    disk), not only allocations. A peak shorter than the interval can be missed. Where /proc is
    missing, the process's lifetime peak (ru_maxrss) at the end of the block stands in.
    """

    def __init__(self, interval: float = 0.01):
        self.interval = interval
        self.gb = 0.0
        """Peak resident GB seen while the block ran."""
        self.start_gb = 0.0
        """Resident GB when the block began (the peak's growth is `gb - start_gb`)."""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> PeakResident:
        now = _resident_bytes()
        self.start_gb = self.gb = (now or 0) / 1024**3
        if now is not None:
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        else:
            import resource  # POSIX only; ru_maxrss is in KiB on Linux

            self.gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2

    def _sample(self) -> None:
        while True:
            self.gb = max(self.gb, (_resident_bytes() or 0) / 1024**3)
            if self._stop.wait(self.interval):
                self.gb = max(self.gb, (_resident_bytes() or 0) / 1024**3)
                return


def _resident_bytes() -> int | None:
    """VmRSS of this process, or None where /proc/self/status is missing."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None
