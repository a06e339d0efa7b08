"""The on-disk gradient index: a memory-mapped [N, D] matrix plus JSON metadata.

Layout of an index folder (see docs/index-format.md):
    index.json                 metadata (modules and their column slices, projection, precision, ...)
    gradients.npy              [N, D] store dtype, row i = example ids[i]
    ids.npy / losses.npy / tokens.npy   [N] int64 / float32 / int64
    norms.npy                  [N] float32 L2 norm of each stored row (indexes built since it exists)
    normalizer.safetensors     optional, fp32
    preconditioner.safetensors optional, fp32 sums of g gᵀ per module + "__count__"
    kfac.safetensors           optional (--preconditioner kfac|ekfac): K-FAC eigenbases (+ EK-FAC Λ)
    checksums.json             size and sha256 of each file above, written when the build finishes

`open_index` verifies the folder before anything reads it: the files index.json says the build
made must be there (a normalizer or preconditioner silently missing would change every score),
each must have its recorded size, and its recorded hash — in full for files up to
FULL_HASH_BYTES, and for larger ones (the gradient rows of a big index) over a fixed sample of
blocks (the header, the first and last MiB, 64 blocks spread evenly), so opening stays cheap
whatever N is. `verify="full"` hashes every byte. The rows file's full digest is a chain with one
link per segment (its header, row count left out, seeds it), so an append hashes only the rows it
adds.

`gradients.npy` may be longer than the index: `assay build --append` writes the new rows past
the old ones and sets the header's row count before it swaps in the new index.json (see
attribution/append.py). So the number of rows is index.json's, the header supplies the dtype and
width, and the file's checksum covers its first `size` bytes with the header read as if it said
index.json's row count: an index stays whole however an append into it ends.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from assay.attribution.kfac import KronFactors, load_factors
from assay.attribution.normalizers import sample_positions
from assay.core.config import ModelSource
from assay.core.console import note
from assay.core.distributed import Distributed
from assay.core.errors import AssayError, first_line
from assay.core.paths import as_path
from assay.core.precision import STATS_DTYPE, full_precision
from assay.core.runs import DONE_FILE, read_json, write_json
from assay.lm.data import tokenizer_fingerprint
from assay.lm.models import STRICT_FINGERPRINT, fingerprint_as, read_architecture

META_FILE = "index.json"
GRADIENTS_FILE = "gradients.npy"
IDS_FILE = "ids.npy"
LOSSES_FILE = "losses.npy"
TOKENS_FILE = "tokens.npy"
HASHES_FILE = "hashes.npy"
"""[N] uint64 content hashes of the rows' examples (lm.data.example_hashes): what --append checks
new examples against. Absent from indexes built before it."""
NORMS_FILE = "norms.npy"
NORMALIZER_FILE = "normalizer.safetensors"
PRECONDITIONER_FILE = "preconditioner.safetensors"
KFAC_FILE = "kfac.safetensors"
MAX_STATS_DIM = 8192  # a [d, d] fp32 matrix per module: 256 MB at this size
CHECKSUMS_FILE = "checksums.json"
ROWS_DIGEST = "rows_sha256"  # the rows file's chained digest (rows_digest)
FORMAT_VERSION = 1
FULL_HASH_BYTES = 64 << 20
SAMPLE_BLOCKS, SAMPLE_BLOCK, SAMPLE_ENDS = 64, 64 << 10, 1 << 20
Verify = Literal["fast", "full", "none"]


@dataclass
class GradientIndex:
    """An opened index. `gradients` is a read-only memmap: rows are read on demand."""

    path: Path
    gradients: np.ndarray  # memmap [N, D]
    modules: dict[str, slice]  # module name -> columns
    ids: np.ndarray  # [N] int64
    losses: np.ndarray  # [N] float32 summed loss
    token_counts: np.ndarray  # [N] int64 loss-carrying tokens
    meta: dict[str, Any]
    row_norms: np.ndarray | None = None  # [N] float32 ‖stored row‖ (None: an index from before norms.npy)

    def __len__(self) -> int:
        return int(self.gradients.shape[0])

    @property
    def dim(self) -> int:
        return int(self.gradients.shape[1])

    def module_shapes(self) -> dict[str, tuple[int, int]]:
        """Stored block shape of each module ((p, p), or the weight's layout when raw)."""
        return {m["name"]: tuple(m["shape"]) for m in self.meta["modules"]}

    def preconditioner_stats(self) -> tuple[dict[str, torch.Tensor], int]:
        """Per-module fp32 [d_m, d_m] sums of g gᵀ over the stats sample, and the count summed."""
        path = self.path / PRECONDITIONER_FILE
        if not path.exists():
            raise AssayError(
                f"{self.path} has no preconditioner statistics; rebuild it with --preconditioner trackstar"
            )
        tensors = load_safetensors(path)
        if "__count__" not in tensors:
            raise AssayError(f"{path} is damaged (no __count__); rebuild the index")
        count = int(tensors.pop("__count__").item())
        return {k: v.to(torch.float32) for k, v in tensors.items()}, count

    def kfac_factors(self) -> KronFactors | None:
        """The K-FAC / EK-FAC factors the index was built with (None when it was built without)."""
        if self.meta.get("preconditioner") not in ("kfac", "ekfac"):
            return None
        path = self.path / KFAC_FILE
        if not path.exists():
            raise AssayError(
                f"{self.path} says it was built with {self.meta['preconditioner']} but has no {KFAC_FILE}"
            )
        try:
            return load_factors(path)
        except AssayError:
            raise
        except Exception as e:  # safetensors' own error for a torn or garbled file
            raise AssayError(f"{path} is damaged ({first_line(e)}); rebuild the index") from None

    def normalizer_tensors(self) -> dict[str, torch.Tensor]:
        """The fp32 normalizer tensors the index was built with (empty when built without one).
        An index that says it was normalized must have them: without them every query's gradient
        would be taken unnormalized and compared with normalized rows."""
        path = self.path / NORMALIZER_FILE
        if self.meta.get("normalizer", "none") == "none":
            return {}
        if not path.exists():
            raise AssayError(
                f"{self.path} says it was built with the {self.meta['normalizer']} normalizer but has no "
                f"{NORMALIZER_FILE}; restore that file or rebuild the index"
            )
        return load_safetensors(path)


def load_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file; a torn or garbled file is one line."""
    try:
        return dict(load_file(str(path)))
    except Exception as e:  # SafetensorError (no public type to catch), OSError, ...
        raise AssayError(f"{path} is damaged ({first_line(e)}); rebuild the index") from None


def module_slices(meta: dict[str, Any]) -> dict[str, slice]:
    return {m["name"]: slice(int(m["start"]), int(m["stop"])) for m in meta["modules"]}


def open_index(path: Path | str, verify: Verify = "fast") -> GradientIndex:
    """Open a finished index (memory-mapped), verified first (see the module docstring).
    Clear errors for incomplete, damaged or foreign folders, and for a `verify` not in Verify."""
    path = as_path(path, "open_index's path")
    if verify not in get_args(Verify):
        raise AssayError(f"unknown verify={verify!r}; choose one of {', '.join(map(repr, get_args(Verify)))}")
    if not path.exists():
        part = path.with_name(path.name + ".part")
        if part.exists():
            raise AssayError(
                f"{path} is not finished yet ({part} exists); rerun `assay build` to complete it"
            )
        raise AssayError(f"no index at {path}")
    if not (path / META_FILE).exists():
        raise AssayError(f"{path} is not a gradient index (no {META_FILE}); build one with `assay build`")
    if not (path / DONE_FILE).exists():
        raise AssayError(
            f"{path} has no {DONE_FILE}, so it is not a finished index (damaged or copied in part); "
            f"rebuild it with `assay replay {path} --overwrite`"
        )
    meta = read_json(path / META_FILE)
    if verify != "none":
        verify_files(path, meta, verify == "full")
    try:
        grads = open_rows(path / GRADIENTS_FILE, int(meta["num_examples"]), int(meta["dim"]))
        ids = np.load(path / IDS_FILE, allow_pickle=False)
        losses = np.load(path / LOSSES_FILE, allow_pickle=False)
        tokens = np.load(path / TOKENS_FILE, allow_pickle=False)
        norms = np.load(path / NORMS_FILE, allow_pickle=False) if (path / NORMS_FILE).exists() else None
    except (OSError, ValueError, EOFError) as e:  # missing, empty, torn or foreign .npy files
        raise AssayError(f"{path} is a damaged index: {first_line(e)}") from None
    if grads is None or ids.shape != (len(grads),):
        raise AssayError(f"{path} is a damaged index: shapes disagree with {META_FILE}")
    for name, arr in ((LOSSES_FILE, losses), (TOKENS_FILE, tokens), (NORMS_FILE, norms)):
        if arr is not None and arr.shape != (len(ids),):
            raise AssayError(f"{path} is a damaged index: {name} has {arr.shape}, not ({len(ids)},)")
    return GradientIndex(path, grads, module_slices(meta), ids, losses, tokens, meta, norms)


def read_npy_header(path: Path) -> tuple[int, tuple[int, ...], np.dtype, bytes]:
    """(data offset, shape, dtype, the header's bytes) of a C-order .npy file (ValueError if not one)."""
    with open(path, "rb") as f:
        version = np.lib.format.read_magic(f)
        fmt = np.lib.format
        read = fmt.read_array_header_1_0 if version == (1, 0) else fmt.read_array_header_2_0
        shape, fortran, dtype = read(f)
        offset = f.tell()
        f.seek(0)
        header = f.read(offset)
    if fortran:
        raise ValueError(f"{path.name} is in Fortran order")
    return offset, tuple(int(d) for d in shape), np.dtype(dtype), header


def open_rows(path: Path, rows: int, dim: int) -> np.memmap | None:
    """The first `rows` rows [rows, dim] of a .npy file, memory-mapped read-only (None when the file
    is not [>= rows or more being appended, dim] or too short). The header's row count may differ
    from `rows` while an append is under way (module docstring)."""
    offset, shape, dtype, _ = read_npy_header(path)
    if len(shape) != 2 or shape[1] != dim or os.path.getsize(path) < offset + rows * dim * dtype.itemsize:
        return None
    return np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=(rows, dim))


def header_for_rows(header: bytes, shape: tuple[int, ...], rows: int) -> bytes | None:
    """The same .npy header saying `rows` rows, of the same length (numpy pads its headers so the
    first dimension can grow in place), or None when it does not fit."""
    text = header.decode("latin1")
    old, new = f"'shape': {tuple(shape)!r}", f"'shape': {(rows, *shape[1:])!r}"
    start, end = text.find("{"), text.rfind("}")
    if start < 0 or end < start or old not in text[start : end + 1]:
        return None
    body = text[start : end + 1].replace(old, new, 1)
    pad = len(text) - 1 - start - len(body)  # spaces, then the final newline
    return None if pad < 0 else (text[:start] + body + " " * pad + "\n").encode("latin1")


def _canonical_header(path: Path, rows: int) -> bytes | None:
    """The rows file's header as it read when the index had `rows` rows (None: as it is)."""
    try:
        _, shape, _, header = read_npy_header(path)
    except (OSError, ValueError, EOFError):
        return None  # a broken header fails the checksum on its own
    return None if shape[:1] == (rows,) else header_for_rows(header, shape, rows)


def expected_files(meta: dict[str, Any]) -> list[str]:
    """The files a finished index must hold, given what index.json says it was built with."""
    names = [META_FILE, GRADIENTS_FILE, IDS_FILE, LOSSES_FILE, TOKENS_FILE]
    if meta.get("normalizer", "none") != "none":
        names.append(NORMALIZER_FILE)
    if keeps_stats(meta):
        names.append(PRECONDITIONER_FILE)
    if meta.get("preconditioner") in ("kfac", "ekfac"):
        names.append(KFAC_FILE)
    return names


def file_digest(
    path: Path, sampled: bool = False, size: int | None = None, header: bytes | None = None
) -> str:
    """sha256 (hex) of a file's size and bytes: every byte, or (`sampled`) the first and last
    SAMPLE_ENDS bytes and SAMPLE_BLOCKS blocks of SAMPLE_BLOCK bytes spread evenly. `size`: digest
    only the file's first `size` bytes (as if it ended there); `header`: read these bytes at its
    start instead of the file's own."""
    size = os.path.getsize(path) if size is None else size
    h = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:

        def read(start: int, length: int) -> bytes:
            data = os.pread(f.fileno(), max(min(length, size - start), 0), start)
            if header is not None and start < len(header):
                cut = header[start : start + len(data)]
                data = cut + data[len(cut) :]
            return data

        if not sampled:
            for start in range(0, size, 8 << 20):
                h.update(read(start, 8 << 20))
            return h.hexdigest()
        step = max(size - SAMPLE_BLOCK, 0) // (SAMPLE_BLOCKS - 1)
        spans = [(0, SAMPLE_ENDS), (max(size - SAMPLE_ENDS, 0), SAMPLE_ENDS)]
        for start, length in spans + [(k * step, SAMPLE_BLOCK) for k in range(SAMPLE_BLOCKS)]:
            h.update(read(start, length))
    return h.hexdigest()


def rows_digest(path: Path, meta: dict[str, Any], carried: dict[str, Any] | None = None) -> str:
    """The rows file's full digest: sha256 chained over its segments' row bytes, seeded by its header
    with the row count left out. `carried`: the entry checksums.json recorded for the index's
    first segments (an append), whose chain is carried on instead of hashed again."""
    offset, shape, dtype, header = read_npy_header(path)
    spans = [tuple(s["rows"]) for s in segments(meta)]
    row_bytes = int(np.prod(shape[1:])) * dtype.itemsize
    if carried and ROWS_DIGEST in carried and carried.get("rows") == spans[-1][0]:
        digest, spans = carried[ROWS_DIGEST], spans[-1:]
    else:
        digest = hashlib.sha256(header_for_rows(header, shape, 0) or header).hexdigest()
    with open(path, "rb") as f:
        for start, stop in spans:
            h = hashlib.sha256(digest.encode())
            for at in range(offset + start * row_bytes, offset + stop * row_bytes, 8 << 20):
                h.update(os.pread(f.fileno(), min(8 << 20, offset + stop * row_bytes - at), at))
            digest = h.hexdigest()
    return digest


def write_checksums(path: Path, meta: dict[str, Any], carried: dict[str, Any] | None = None) -> None:
    """Record the size and digests of every file the index holds (at the end of a build or an
    append): the full sha256 (the rows file's chained, `rows_digest`), and for files over
    FULL_HASH_BYTES also the sampled one `open_index` checks. `carried`: the checksums.json of the
    index an append extends."""
    names = expected_files(meta) + [n for n in (NORMS_FILE, HASHES_FILE) if (path / n).exists()]
    files: dict[str, dict[str, Any]] = {}
    for name in names:
        size = os.path.getsize(path / name)
        if name == GRADIENTS_FILE:
            before = (carried or {}).get("files", {}).get(name)
            rows = int(meta["num_examples"])
            files[name] = {"size": size, "rows": rows, ROWS_DIGEST: rows_digest(path / name, meta, before)}
        else:
            files[name] = {"size": size, "sha256": file_digest(path / name)}
        if size > FULL_HASH_BYTES:
            files[name]["sampled_sha256"] = file_digest(path / name, sampled=True)
    write_json(path / CHECKSUMS_FILE, {"format": "assay-index-checksums-v2", "files": files})


def verify_files(path: Path, meta: dict[str, Any], full: bool = False) -> None:
    """Refuse an index whose files are missing, resized or changed since it was built (one line).
    An index from before checksums.json is checked for its files' presence only."""
    for name in expected_files(meta):
        if not (path / name).is_file():
            raise AssayError(
                f"{path} is a damaged index: index.json says it was built with {name}, which is "
                f"missing; restore it or rebuild the index (`assay replay {path} --overwrite`)"
            )
    if not (path / CHECKSUMS_FILE).exists():
        return
    recorded = read_json(path / CHECKSUMS_FILE).get("files", {})
    for name, want in recorded.items():
        file = path / name
        if not file.is_file():
            raise AssayError(f"{path} is a damaged index: {name} is missing; rebuild the index")
        size = os.path.getsize(file)
        grows = name == GRADIENTS_FILE  # rows an append writes past the index's (module docstring)
        if size != want["size"] and not (grows and size > want["size"]):
            raise AssayError(
                f"{path} is a damaged index: {name} has {size:,} bytes, {want['size']:,} when built; "
                "rebuild the index"
            )
        sampled = not full and "sampled_sha256" in want
        if ROWS_DIGEST in want and not sampled:
            digest, key = _rows_digest_or_none(file, meta), ROWS_DIGEST
        else:
            header = _canonical_header(file, int(meta["num_examples"])) if grows else None
            digest = file_digest(file, sampled, want["size"], header)
            key = "sampled_sha256" if sampled else "sha256"
        if digest != want[key]:
            raise AssayError(
                f"{path} is a damaged index: {name} changed since it was built (checksum); rebuild the "
                f"index (`assay replay {path} --overwrite`)"
            )


def _rows_digest_or_none(path: Path, meta: dict[str, Any]) -> str | None:
    try:
        return rows_digest(path, meta)
    except (OSError, ValueError, EOFError):
        return None  # a broken header: "changed since it was built"


def index_fingerprint(model: torch.nn.Module, meta: dict[str, Any]) -> str:
    """The model's fingerprint of the kind the index recorded (an index from before byte
    fingerprints is checked with the older, weaker one, and says so)."""
    version = int(meta["model"].get("fingerprint_version", 1))
    if version < STRICT_FINGERPRINT:
        note("this index records the older model fingerprint (weight sums): rebuild it for the strict check")
    return fingerprint_as(model, version)


def check_tokenizer(meta: dict[str, Any], tokenizer: Any, path: Path) -> None:
    """Refuse a tokenizer other than the one the index was built with (one line)."""
    if tokenizer_fingerprint(tokenizer) != meta["model"]["tokenizer_fingerprint"]:
        raise AssayError(f"the tokenizer differs from the one {path} was built with")


def check_architecture(meta: dict[str, Any], source: ModelSource, path: Path) -> None:
    """Refuse, before its weights load, a model whose config gives another shape than the model
    the index was built with (one line); the fingerprint, once loaded, checks every weight. An
    index from before architectures were recorded, or a config that does not read alone, passes."""
    built = meta["model"].get("architecture")
    have = read_architecture(source) if built else None
    if have is None:
        return
    for key, value in built.items():
        if key in have and have[key] != value:
            raise AssayError(
                f"model {source.model!r} is not the one {path} was built with: its {key} is "
                f"{have[key]!r}, the index's model's {value!r}"
            )


def save_preconditioner_stats(folder: Path, meta: dict[str, Any], samples: int, seed: int) -> None:
    """Per-module fp32 Σ g gᵀ over a seeded sample of the stored rows, autocast off."""
    check_stats_dims(meta)
    Distributed.current().barrier()  # every rank's rows are on disk
    grads = np.load(folder / GRADIENTS_FILE, mmap_mode="r")
    rows = sample_positions(grads.shape[0], samples, seed)
    sums = preconditioner_sums(grads, rows, meta)
    if Distributed.current().is_main:
        write_preconditioner(folder, sums, len(rows))


def _too_wide_for_stats(meta: dict[str, Any]) -> list[str]:
    """Modules too wide for a [d, d] statistics matrix."""
    return [m["name"] for m in meta["modules"] if m["stop"] - m["start"] > MAX_STATS_DIM]


def keeps_stats(meta: dict[str, Any]) -> bool:
    """Whether the index saves TrackStar's per-module Σ g gᵀ: with --preconditioner trackstar always;
    with kfac / ekfac when every module fits (an index of raw gradients of real layers does not,
    and needs none: its curvature is the factors)."""
    preconditioner = meta.get("preconditioner", "none")
    return preconditioner == "trackstar" or (preconditioner != "none" and not _too_wide_for_stats(meta))


def check_stats_dims(meta: dict[str, Any]) -> None:
    """Refuse modules too wide for a [d, d] statistics matrix (one line)."""
    too_big = _too_wide_for_stats(meta)
    if too_big:
        raise AssayError(
            f"module {too_big[0]} has too many columns for a preconditioner; use --projection_dim"
        )


def preconditioner_sums(grads: np.ndarray, rows: np.ndarray, meta: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Per-module fp32 [d, d] Σ g gᵀ over the rows `grads[rows]`, in chunks of 1024 in order, autocast
    off. Under torchrun every rank sums its share of the chunks and all get the total."""
    dist = Distributed.current()
    sums = {m["name"]: torch.zeros(m["stop"] - m["start"], m["stop"] - m["start"]) for m in meta["modules"]}
    with full_precision("cpu"):
        for i in dist.interleave(range(0, len(rows), 1024)):  # each rank sums its chunks
            chunk = torch.from_numpy(np.asarray(grads[rows[i : i + 1024]], dtype=np.float32))  # [n, D]
            for m in meta["modules"]:
                x = chunk[:, m["start"] : m["stop"]].to(STATS_DTYPE)
                sums[m["name"]] += x.T @ x
    for total in sums.values():
        dist.all_reduce_(total)  # fp32 sums over ranks
    return sums


def write_preconditioner(folder: Path, sums: dict[str, torch.Tensor], count: int) -> None:
    """preconditioner.safetensors: the sums and "__count__", written atomically."""
    tensors = {**sums, "__count__": torch.tensor(float(count), dtype=STATS_DTYPE)}
    tmp = folder / (PRECONDITIONER_FILE + ".tmp")  # atomic: never half a file under its name
    save_file(tensors, str(tmp))
    tmp.replace(folder / PRECONDITIONER_FILE)


def segments(meta: dict[str, Any]) -> list[dict[str, Any]]:
    """The datasets the index's rows come from, in row order: {"rows": [start, stop], "data": the
    DataConfig, "id_offset": added to the dataset's row ids}. One for an index never appended to."""
    whole = {"rows": [0, int(meta["num_examples"])], "data": meta.get("data"), "id_offset": 0}
    return list(meta.get("segments") or [whole])
