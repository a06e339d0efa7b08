"""Sources of index rows for the scoring kernel, and the per-row caches computed from them.

A `RowSource` hands out rows in chunks: `ArrayRows` over a numpy array or a memmapped .npy (read
through windows of one read-only mapping, `FileWindows`), `TensorRows` over an in-memory tensor.
`row_norms` and `base_sq_norms` read a source once for the per-row numbers scoring reuses.
"""

from __future__ import annotations

import mmap
import warnings
from typing import Protocol

import numpy as np
import torch

from assay.attribution.precondition import Whitening
from assay.core.errors import AssayError
from assay.core.precision import STATS_DTYPE


class RowSource(Protocol):
    """Rows of gradients, read in chunks."""

    num_rows: int
    dim: int

    def read_raw(self, start: int, stop: int, slot: int = 0) -> torch.Tensor:
        """Rows start..stop [stop-start, D] in their stored float dtype.

        The result may live in buffer `slot` until that slot is read again.
        """
        ...

    def read(self, start: int, stop: int, slot: int = 0) -> torch.Tensor:
        """Rows start..stop as fp32 (same buffer rule)."""
        ...


class ArrayRows:
    """Rows of a numpy array or memmap (fp16, fp32 or fp64).

    A memmap over a whole file is read through its own read-only mapping of the file, one window
    of rows per buffer slot: the window's pages are mapped in one call when it is read and
    unmapped when its slot is read again, so resident memory stays at a few chunks however
    large the file is, and the rows are used where the page cache holds them (no copy).
    """

    def __init__(self, array: np.ndarray):
        if array.ndim != 2:
            raise AssayError(f"gradient rows must be a 2-d array, got shape {array.shape}")
        if array.dtype not in (np.float16, np.float32, np.float64):
            raise AssayError(f"unsupported gradient dtype {array.dtype}")
        self.array = array
        self.num_rows, self.dim = (int(s) for s in array.shape)
        self._file = _backing_file(array)
        self._map: FileWindows | None = None
        if self._file is not None:
            self._map = FileWindows(*self._file, array.dtype, self.num_rows * self.dim)
        self._slots: dict[int, np.ndarray] = {}

    def read_raw(self, start: int, stop: int, slot: int = 0) -> torch.Tensor:
        if self._map is not None:
            return self._map.rows(start * self.dim, stop * self.dim, slot).view(stop - start, self.dim)
        n = stop - start
        raw = self._buffer(slot, n)[:n]
        raw[:] = self.array[start:stop]
        return torch.from_numpy(raw)

    def read(self, start: int, stop: int, slot: int = 0) -> torch.Tensor:
        return self.read_raw(start, stop, slot).to(STATS_DTYPE)

    def _buffer(self, slot: int, n: int) -> np.ndarray:
        """The [n, D] stored-dtype buffer of this slot, grown when needed."""
        have = self._slots.get(slot)
        if have is None or have.shape[0] < n:
            have = self._slots[slot] = np.empty((n, self.dim), self.array.dtype)
        return have


MADV_POPULATE_READ = 22  # Linux ≥ 5.14; Python's mmap module does not name it


class FileWindows:
    """Windows of a file's elements through one read-only mapping of the whole file.

    `rows(a, b, slot)` maps elements a..b with one madvise (instead of a page fault per 4 KiB)
    and drops the window the slot held before (its pages stay in the page cache). A read-only
    shared mapping costs no committed memory however large the file (a private writable one
    would, under strict overcommit); torch's tensors over it are never written.
    """

    def __init__(self, path: str, offset: int, dtype: np.dtype, count: int):
        self.path, self.offset, self.itemsize = path, offset, np.dtype(dtype).itemsize
        self.dtype = torch.from_numpy(np.empty(0, dtype)).dtype
        with open(path, "rb") as f:
            self.map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._check_size(offset + count * self.itemsize)
        with warnings.catch_warnings():  # torch warns once per process that the memory is read-only
            warnings.simplefilter("ignore", UserWarning)
            torch.frombuffer(self.map, dtype=torch.uint8, count=1)
        self.windows: dict[int, tuple[int, int]] = {}
        self.populate = True

    def rows(self, a: int, b: int, slot: int) -> torch.Tensor:
        """Elements a..b as a 1-d tensor over the mapping (valid until the slot is read again)."""
        if b <= a:
            return torch.empty(0, dtype=self.dtype)
        if slot in self.windows:
            self._advise(mmap.MADV_DONTNEED, *self.windows.pop(slot))
        lo = (self.offset + a * self.itemsize) // mmap.PAGESIZE * mmap.PAGESIZE
        hi = self.offset + b * self.itemsize
        self._check_size(hi)  # a page past the end of a mapped file would kill the process (SIGBUS)
        if self.populate:
            try:
                self.map.madvise(MADV_POPULATE_READ, lo, hi - lo)
            except (OSError, AttributeError):  # an older kernel (or no madvise): pages fault in as read
                self.populate = False
        self.windows[slot] = (lo, hi)
        first = self.offset + a * self.itemsize
        return torch.frombuffer(self.map, dtype=self.dtype, count=b - a, offset=first)

    def _check_size(self, end: int) -> None:
        if self.map.size() < end:  # the file's size now (the mapping keeps its own descriptor)
            raise AssayError(f"{self.path} is shorter than its header says: a damaged index")

    def _advise(self, advice: int, lo: int, hi: int) -> None:
        if hi > lo and hasattr(self.map, "madvise"):
            self.map.madvise(advice, lo, hi - lo)


def _backing_file(array: np.ndarray) -> tuple[str, int] | None:
    """(path, byte offset) when `array` is a whole memmap straight over a file, else None.

    A slice of a memmap keeps its parent's `offset`, so only an array whose base is the
    mmap object itself (as `np.load(..., mmap_mode="r")` returns) is read through the file.
    """
    if not isinstance(array, np.memmap) or not isinstance(array.base, mmap.mmap):
        return None
    if not array.flags.c_contiguous or array.filename is None:
        return None
    return str(array.filename), int(array.offset)


class TensorRows:
    """Rows of an in-memory torch tensor (the Python API's case)."""

    def __init__(self, tensor: torch.Tensor):
        if tensor.ndim != 2:
            raise AssayError(f"gradient rows must be [N, D], got shape {tuple(tensor.shape)}")
        self.tensor = tensor
        self.num_rows, self.dim = (int(s) for s in tensor.shape)

    def read_raw(self, start: int, stop: int, slot: int = 0) -> torch.Tensor:
        return self.tensor[start:stop]

    def read(self, start: int, stop: int, slot: int = 0) -> torch.Tensor:
        return self.tensor[start:stop].to(STATS_DTYPE)


def base_sq_norms(source: RowSource, whitening: Whitening, chunk_rows: int = 1024) -> np.ndarray:
    """[N] ‖(R_train + δI)^{-1/2} t‖² of every row in fp64: the query-independent part of ‖W t‖².

    fp64 because ‖W t‖² is this minus the query part, and for rows close to a query the two
    nearly cancel.
    """
    assert whitening.lowrank is not None
    mats = {n: m.double() for n, m in whitening.lowrank.base.items()}
    out = np.zeros(source.num_rows, dtype=np.float64)
    for start in range(0, source.num_rows, chunk_rows):
        stop = min(start + chunk_rows, source.num_rows)
        rows = source.read(start, stop).double()
        total = torch.zeros(stop - start, dtype=torch.float64)
        for name, m in mats.items():
            total += ((rows[:, whitening.slices[name]] @ m) ** 2).sum(1)
        out[start:stop] = total.numpy()
    return out


def row_norms(source: RowSource, chunk_rows: int = 8192) -> np.ndarray:
    """[N] fp32 ‖t‖ of every row (what a `Screen` bounds its error with)."""
    out = np.zeros(source.num_rows, dtype=np.float32)
    for start in range(0, source.num_rows, chunk_rows):
        stop = min(start + chunk_rows, source.num_rows)
        out[start:stop] = torch.linalg.vector_norm(source.read(start, stop), dim=1).numpy()
    return out
