"""Hand freed tensor memory back to the operating system (CPU processes on glibc)."""

from __future__ import annotations

import ctypes
import os
import sys

M_MMAP_THRESHOLD = -3  # mallopt parameter number (malloc.h)
MMAP_THRESHOLD_BYTES = 1 << 20


def return_freed_memory() -> None:
    """Serve every allocation of 1 MiB or more from its own mapping, returned to the OS when freed.

    glibc raises its mmap threshold after each large free (up to 32 MiB), so activation-sized
    tensors soon come from heap arenas, which fragment and keep freed memory, and a process's
    peak resident memory grows well past its live tensors (see bench/bench_build.py's peaks).
    Fixing the threshold, as the MALLOC_MMAP_THRESHOLD_ variable does, keeps the peak near the
    live peak. A threshold the user set in the environment is left alone; no-op off glibc.
    """
    if not sys.platform.startswith("linux") or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc (e.g. musl): its allocator already returns large blocks
        return
    libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
