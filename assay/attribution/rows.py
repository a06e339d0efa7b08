"""Sources of index rows for the scoring kernel, and the per-row caches computed from them.

A `RowSource` hands out rows in chunks: `ArrayRows` over a numpy array or a memmapped .npy (read
through windows of one read-only mapping, `FileWindows`), `TensorRows` over an in-memory tensor.
The scoring kernel reads a file's rows a block at a time instead where it can (`FileBlocks`).
`row_norms` and `base_sq_norms` read a source once for the per-row numbers scoring reuses.
"""

from __future__ import annotations

import mmap
import os
import threading
import warnings
import weakref
from collections.abc import Iterator
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

    def release(self, slot: int) -> None:
        """Let go of what buffer `slot` holds (its rows are not used again)."""
        ...


class ArrayRows:
    """Rows of a numpy array or memmap (fp16, fp32 or fp64).

    A memmap over a whole file is read through its own read-only mapping of the file, one window
    of rows per buffer slot: the window's pages are mapped in one call when it is read and
    unmapped when the slot is released or read again, so resident memory stays at a few chunks
    however large the file is, and the rows are used where the page cache holds them (no copy).
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

    def release(self, slot: int) -> None:
        """Unmap the rows `slot` last read from the file now, not when the slot is read again."""
        if self._map is not None:
            self._map.release(slot)

    def file_blocks(self, start: int, stop: int) -> FileBlocks | None:
        """Rows start..stop to be read from the file block by block, or None where the rows are
        not a whole fp32 file (or the platform lacks `os.preadv`).

        fp16 rows are cast from the mapping instead: the cast is already the one copy into the
        cache, and an extra read into a buffer measured slower (docs/BENCHMARKS.md, "Scoring").
        """
        if self._map is None or self.array.dtype != np.float32 or not hasattr(os, "preadv"):
            return None
        return FileBlocks(self._map, start, stop, self.dim)

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
        self.fd = os.open(path, os.O_RDONLY)  # for `read_into`
        weakref.finalize(self, os.close, self.fd)

    def rows(self, a: int, b: int, slot: int) -> torch.Tensor:
        """Elements a..b as a 1-d tensor over the mapping (valid until the slot is read again)."""
        if b <= a:
            return torch.empty(0, dtype=self.dtype)
        self.release(slot)
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

    def release(self, slot: int) -> None:
        """Unmap the window `slot` holds, if any (its tensors must not be used after)."""
        if slot in self.windows:
            self._advise(mmap.MADV_DONTNEED, *self.windows.pop(slot))

    def read_into(self, out: memoryview, a: int) -> None:
        """Copy elements from a on into the bytes `out` (no mapping; safe from several threads)."""
        pos, done = self.offset + a * self.itemsize, 0
        while done < len(out):
            got = os.preadv(self.fd, [out[done:]], pos + done)
            if got <= 0:
                raise self._damaged()
            done += got

    def _check_size(self, end: int) -> None:
        if self.map.size() < end:  # the file's size now (the mapping keeps its own descriptor)
            raise self._damaged()

    def _damaged(self) -> AssayError:
        return AssayError(f"{self.path} is shorter than its header says: a damaged index")

    def _advise(self, advice: int, lo: int, hi: int) -> None:
        if hi > lo and hasattr(self.map, "madvise"):
            self.map.madvise(advice, lo, hi - lo)


class FileBlocks:
    """fp32 rows start..stop of a file, read a block at a time into a small buffer of the thread.

    Scoring a few queries is memory-bound. A block copied from the page cache into a cache-sized
    buffer is multiplied while it is still in the core's cache, so each row crosses the memory
    bus about once, and nothing is mapped: mapping a chunk's pages (`FileWindows`) costs a
    page-table update per 4 KiB on every pass. Which costs more, that or the copy, depends on
    the machine (`FileReads` times both).
    """

    def __init__(self, file: FileWindows, start: int, stop: int, dim: int):
        assert file.dtype == STATS_DTYPE
        self.file, self.start = file, start
        self.shape = (stop - start, dim)
        self.device = torch.device("cpu")

    def blocks(self, step: int) -> Iterator[tuple[int, torch.Tensor]]:
        """(offset, rows [≤ step, D]) in order; each block is valid until the next one."""
        num_rows, dim = self.shape
        buffer = thread_buffer("file_block", step, dim)
        view = buffer.numpy().data.cast("B")
        row_bytes = dim * self.file.itemsize
        for s in range(0, num_rows, step):
            c = min(step, num_rows - s)
            self.file.read_into(view[: c * row_bytes], (self.start + s) * dim)
            yield s, buffer[:c]


class FileReads:
    """How the scoring kernel reads an fp32 index file's chunks: a block at a time into a buffer
    (`FileBlocks`) or through the file's mapping (`FileWindows`). The first chunks are read each
    way in turn and timed; the rest go the faster way.

    Neither way is faster everywhere: the one copies every row from the page cache, the other
    maps its pages anew on every pass. Cached TrackStar on an fp32 index measured 0.77-0.96x the
    in-memory matmul by blocks against 1.35-1.58x mapped on AMD EPYC, and 1.63-1.76x by blocks
    against 1.19-1.32x mapped on an Intel Xeon with AMX (docs/BENCHMARKS.md, "Scoring"). Both ways
    hand the same rows to the same block GEMMs, so the choice changes no score.

    The trial is fair to both ways in three respects (on an AMD EPYC with AVX2 only, each unfairness
    chose the mapping, which then took twice the time of block reads):
    - it reads a group of one chunk per worker each way, so the chunks timed together are read
      alike: a chunk is timed under the contention of its own way, not the other's;
    - a mapped chunk's pages are unmapped before its time is taken (`release`), not charged to
      a later chunk;
    - a first group, read by blocks, is not timed: the pass's new threads are warming up.
    """

    WAYS = ("blocks", "mapped")
    TRIAL = 1
    """Groups (of one chunk per worker) timed each way before choosing; an index of fewer than
    twice the trial's chunks (12 on 2 workers) is read by blocks (too small for the trial to pay)."""

    def __init__(self, source: ArrayRows, chunks: int, workers: int = 1) -> None:
        self.source, self.group = source, max(1, workers)
        trial = (1 + len(self.WAYS) * self.TRIAL) * self.group  # the warm-up group, then the timed ones
        self.trial_chunks = trial if chunks >= 2 * trial else 0
        self.timed: dict[str, list[tuple[float, int]]] = {way: [] for way in self.WAYS}
        self._lock = threading.Lock()

    @classmethod
    def of(cls, source: RowSource, device: torch.device, chunks: int, workers: int = 1) -> FileReads | None:
        """The reads of `source` in `chunks` chunks on `workers` threads if it is a whole fp32 file
        scored on the CPU, else None (the source's own `read_raw`)."""
        if device.type != "cpu" or not isinstance(source, ArrayRows):
            return None
        return cls(source, chunks, workers) if source.file_blocks(0, 0) is not None else None

    def rows(self, chunk: int, start: int, stop: int, slot: int) -> tuple[str, FileBlocks | torch.Tensor]:
        """(the way, rows start..stop read that way) for chunk number `chunk`; mapped rows are
        valid until `slot` is read again."""
        way = self.way(chunk)
        blocks = self.source.file_blocks(start, stop) if way == "blocks" else None
        return way, blocks if blocks is not None else self.source.read_raw(start, stop, slot)

    def way(self, chunk: int) -> str:
        """How to read chunk number `chunk`: group by group in turn during the trial, then the way
        whose trial chunks took the less time per row (blocks until both have been timed)."""
        if chunk < self.trial_chunks:
            return self.WAYS[max(0, chunk // self.group - 1) % len(self.WAYS)]
        with self._lock:
            per_row = {way: sum(s for s, _ in t) / sum(r for _, r in t) for way, t in self.timed.items() if t}
        return min(per_row, key=per_row.__getitem__) if len(per_row) == len(self.WAYS) else self.WAYS[0]

    def record(self, chunk: int, way: str, seconds: float, rows: int) -> None:
        """Chunk number `chunk`'s time, kept if it was read in the trial's timed groups."""
        if self.group <= chunk < self.trial_chunks and rows > 0:
            with self._lock:
                self.timed[way].append((seconds, rows))


_thread_buffers = threading.local()


def thread_buffer(
    name: str, *shape: int, device: torch.device | None = None, dtype: torch.dtype = STATS_DTYPE
) -> torch.Tensor:
    """This thread's buffer `name` viewed as `shape`, grown when too small: no fresh allocation
    per block or chunk (on CPU each is a new mapping to fault in; see assay.core.memory)."""
    device = device or torch.device("cpu")
    numel = int(np.prod(shape))
    buf = getattr(_thread_buffers, name, None)
    if buf is None or buf.numel() < numel or buf.device != device or buf.dtype != dtype:
        buf = torch.empty(numel, dtype=dtype, device=device)
        setattr(_thread_buffers, name, buf)
    return buf[:numel].view(shape)


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

    def release(self, slot: int) -> None:
        pass  # slices of the tensor itself: nothing to let go of


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
