"""A full disk as one line, never as a crash: reserved memory-mapped files and ENOSPC messages.

A write through a memory map to a sparse file allocates its blocks at the moment a page is
written back; when the disk is full then, the kernel has no way to report it but SIGBUS, which
kills the process without a word. `reserve` allocates a file's blocks when it is created, so a
full disk surfaces there, as an error that names the file and how much to free.
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from assay.core.errors import AssayError

MB = 1 << 20


def reserve(path: Path | str, size: int | None = None) -> None:
    """Allocate the blocks of `path` up to `size` bytes (default: its length), so no later write
    inside that length can find the disk full. One line (AssayError) when it is full already."""
    path = Path(path)
    size = os.path.getsize(path) if size is None else size
    if size <= 0:
        return
    with open(path, "r+b") as f:
        try:
            os.posix_fallocate(f.fileno(), 0, size)
        except OSError as e:
            if e.errno == errno.ENOSPC:
                missing = size - os.fstat(f.fileno()).st_blocks * 512  # bytes not yet allocated
                raise disk_full(path, missing) from None
            if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                raise
            # this filesystem cannot reserve blocks: writes proceed as before


def open_memmap_reserved(path: Path | str, dtype: Any, shape: tuple[int, ...]) -> Any:
    """A new .npy memmap (`np.lib.format.open_memmap` mode w+) whose blocks are all allocated."""
    arr = np.lib.format.open_memmap(path, mode="w+", dtype=dtype, shape=shape)
    reserve(path)
    return arr


def disk_full(path: Path | str, need: int | None = None) -> AssayError:
    """The one-line error for a full disk while writing `path` (`need`: bytes still missing)."""
    parent = Path(path).parent if Path(path).parent.exists() else Path(".")
    free = shutil.disk_usage(parent).free
    amount = f"free {max(need - free, 1) / MB:,.0f} MB" if need is not None else "free some space"
    return AssayError(
        f"no space left on device writing {path} ({free / MB:,.0f} MB free): {amount} "
        "and rerun the same command to resume"
    )


def as_disk_full(e: BaseException, where: Path | str) -> AssayError | None:
    """The one-line error when `e` is a full disk (an OSError with ENOSPC, or a library's error
    that wraps one, e.g. safetensors'), else None."""
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
        return disk_full(e.filename or where)
    text = str(e)
    if "No space left on device" in text or "StorageFull" in text:
        return disk_full(where)
    return None
