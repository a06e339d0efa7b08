"""`assay build OUT --append --dataset NEW`: add rows to a finished index without rebuilding it.

The new rows are computed exactly as `assay build` computes rows (same model, checked by its
fingerprint; the index's projection, modules, precision and saved normalizer), into a staging
folder `OUT.append.part/` that resumes like any build. OUT is not touched while they are computed.
Then, in a few steps that each leave OUT a whole index (index.py's module docstring says why):

1. the staged rows are written into `OUT/gradients.npy` after the index's rows, and the file's
   header is set to the new row count (OUT's index.json still says the old one, so OUT still opens
   and verifies as the old index);
2. the new index is assembled in `OUT.append.part/next/`: the unchanged files hard-linked, ids,
   losses, token counts and norms extended, the TrackStar statistics updated, index.json with the
   new segment, checksums.json (the rows' chained digest carried on over the new rows only) and
   run.json (a new finish stamp) written afresh;
3. `next/` replaces OUT in two renames, as every command's output folder is committed.

A rerun of the same command after an interruption at any point finishes the job. Statistics are
updated exactly: when the saved sample was every row and the union is still within
--stats_samples, the new rows' Σ g gᵀ are added to the saved sums; otherwise the sums are taken
afresh over the union's seeded sample (at most --stats_samples rows read back), as a build of the
union would. K-FAC/EK-FAC factors are eigendecompositions of a curvature fitted by forward and
backward passes over a sample of the data; they cannot be updated from rows, so such an index is
refused. Ids: each appended example's id is its row id in NEW plus an offset (default: one more
than the index's largest id), recorded per segment in index.json; a clash is refused.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch

from assay.attribution import index as ix
from assay.attribution.build import BuildConfig, GradientSetup, write_rows
from assay.attribution.collector import linear_modules
from assay.attribution.normalizers import Normalizer, sample_positions
from assay.attribution.projection import Projector
from assay.core.config import DataConfig
from assay.core.console import note
from assay.core.distributed import Distributed
from assay.core.errors import AssayError
from assay.core.runs import (
    DONE_FILE,
    INPUTS_FILE,
    LOCK_FILE,
    RunFolder,
    abandon_on_failure,
    check_inputs,
    config_from_dict,
    config_to_dict,
    open_on_every_rank,
    read_json,
    write_json,
)
from assay.lm.data import Examples, example_hashes, examples_fingerprint, load_examples, tokenizer_fingerprint
from assay.lm.lean import keep_compute_casts
from assay.lm.models import load_model, load_sharded_model, load_tokenizer, setup_runtime

NEXT = "next"
COMMITTED = "committed.json"
SETTINGS = (
    "modules", "projection_dim", "projection_seed", "store_dtype", "normalizer", "preconditioner",
    "stats_samples", "runtime.seed", "runtime.attention", "model.lora_rank", "model.lora_alpha",
    "model.lora_modules", "data.max_length",
)  # fmt: skip
"""Settings that decide what a row is: --append takes the index's, and refuses another value."""
REWRITTEN = (
    ix.META_FILE, ix.IDS_FILE, ix.LOSSES_FILE, ix.TOKENS_FILE, ix.NORMS_FILE, ix.HASHES_FILE,
    ix.PRECONDITIONER_FILE, ix.CHECKSUMS_FILE, DONE_FILE, LOCK_FILE,
)  # fmt: skip


def staging_path(out: Path) -> Path:
    """Where an append into `out` is computed (OUT.append.part)."""
    return out.with_name(out.name + ".append.part")


def append_index(cfg: BuildConfig) -> dict[str, Any]:
    """Add the examples of cfg.data to the finished index in cfg.out (module docstring)."""
    out = Path(cfg.out)
    dist = Distributed.current()
    finished = dist.main_only(_recover, out)
    if finished is not None:
        return finished
    if not out.exists():  # before the model and the data load
        raise AssayError(
            f"--append: no index at {out} to add to; build it first (the same command without --append)"
        )
    index = ix.open_index(out)
    _refuse_curvature(index)
    cfg = appended_config(cfg, index.meta, out)
    with _staging(out, cfg) as run:
        setup, examples, hashes = _setup(cfg, index, run)
        ids = new_ids(index.ids, examples.ids, cfg.id_offset)
        _check_room(out, len(index) + len(examples))
        if dist.is_main:
            np.save(run.path / ix.IDS_FILE, ids)
            if hashes is not None:  # an index from before the hashes gets none
                np.save(run.path / ix.HASHES_FILE, hashes)
        summary = write_rows(setup, examples, run.path, cfg)
        dist.barrier()
        segment = {
            "rows": [len(index), len(index) + len(examples)],
            "data": dataclasses.asdict(cfg.data),
            "id_offset": int(ids[0] - examples.ids[0]),
            "dataset_fingerprint": examples_fingerprint(examples),
        }
        meta = commit(out, index, run.path, cfg, segment)
    return {**meta, **summary, "appended": len(examples)}


def _refuse_curvature(index: ix.GradientIndex) -> None:
    kind = index.meta.get("preconditioner")
    if kind in ("kfac", "ekfac"):
        raise AssayError(
            f"{index.path} holds {kind} curvature, fitted by passes over a sample of its data, which rows "
            "cannot update exactly: build the union of the datasets instead of appending"
        )


def _flat(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def appended_config(cfg: BuildConfig, meta: dict[str, Any], out: Path) -> BuildConfig:
    """The settings the new rows are computed with: the index's, with the new data and the flags
    that only decide where and how fast it runs (--token_batch_size: the index's unless given). A
    row-deciding flag set to neither its default nor the index's value is refused (one line)."""
    saved = config_from_dict(BuildConfig, meta["config"], trust_remote_code=cfg.model.trust_remote_code)
    given, default = _flat(config_to_dict(cfg)), _flat(config_to_dict(BuildConfig(out=cfg.out)))
    have = _flat(config_to_dict(saved))
    for key in SETTINGS:
        if given[key] != default[key] and given[key] != have[key]:
            flag = key.split(".")[-1]
            raise AssayError(
                f"--{flag} {given[key]!r} differs from {out}'s ({have[key]!r}); --append computes rows "
                "with the index's settings: drop the flag or give the index's value"
            )
    if cfg.runtime.precision not in ("auto", meta["precision"]):
        raise AssayError(f"--precision {cfg.runtime.precision} differs from {out}'s ({meta['precision']})")
    model = saved.model
    if given["model.model"] != default["model.model"]:  # the same model elsewhere: its fingerprint decides
        model = dataclasses.replace(model, model=cfg.model.model, tokenizer=cfg.model.tokenizer)
    runtime = dataclasses.replace(
        saved.runtime, precision=meta["precision"], device=cfg.runtime.device, threads=cfg.runtime.threads
    )
    data = dataclasses.replace(cfg.data, max_length=saved.data.max_length)
    batch = cfg.token_batch_size if given["token_batch_size"] != default["token_batch_size"] else None
    return dataclasses.replace(
        saved, out=cfg.out, model=model, data=data, runtime=runtime, fsdp=cfg.fsdp, compile=cfg.compile,
        overwrite=False, append=True, id_offset=cfg.id_offset,
        token_batch_size=batch or saved.token_batch_size,
    )  # fmt: skip


def new_ids(have: np.ndarray, source_ids: np.ndarray, id_offset: int | None) -> np.ndarray:
    """[k] int64 ids of the appended examples: their row ids plus the offset (default: one more than
    the largest id the index holds). Refuses ids the index already has (one line)."""
    offset = int(have.max()) + 1 if id_offset is None else id_offset
    ids = source_ids.astype(np.int64) + offset
    clash = np.intersect1d(ids, have)
    if clash.size:
        raise AssayError(
            f"{clash.size} of the appended ids (first: {int(clash[0])}) are already in the index: choose "
            f"--id_offset above {int(have.max())}, or leave it out"
        )
    return ids


def _setup(
    cfg: BuildConfig, index: ix.GradientIndex, run: RunFolder
) -> tuple[GradientSetup, Examples, np.ndarray | None]:
    """The index's model (fingerprint checked), modules, projection and saved normalizer, the new
    examples and their content hashes (None for an index that keeps none)."""
    dist = Distributed.current()
    _, policy = setup_runtime(cfg.runtime)
    tokenizer = load_tokenizer(cfg.model)
    _, examples = load_examples(cfg.data, tokenizer)
    meta = index.meta
    ix.check_tokenizer(meta, tokenizer, index.path)
    _refuse_duplicate(index, examples_fingerprint(examples))
    hashes = _refuse_held_examples(index, examples)
    ix.check_architecture(meta, cfg.model, index.path)
    if cfg.fsdp:
        model = load_sharded_model(cfg.model, policy, cfg.runtime.attention, dist)
    else:
        model = load_model(cfg.model, policy, cfg.runtime.attention)
    fingerprint = ix.index_fingerprint(model, meta)
    if fingerprint != meta["model"]["fingerprint"]:
        raise AssayError(
            f"model {cfg.model.model!r} is not the one {index.path} was built with (fingerprint)"
        )
    modules = linear_modules(model, cfg.modules)
    if list(modules) != list(index.modules):
        raise AssayError(f"the model's modules differ from the {len(index.modules)} {index.path} holds")
    stamp = (index.path / DONE_FILE).read_text()
    inputs = {"dataset": examples_fingerprint(examples), "model": fingerprint, "index": stamp}
    check_inputs(run, {**inputs, "tokenizer": tokenizer_fingerprint(tokenizer)})
    tensors = index.normalizer_tensors()
    normalizer = Normalizer(meta["normalizer"], tensors) if tensors else None
    projector = Projector(meta["projection_dim"], meta["projection_seed"])
    setup = GradientSetup(
        model, tokenizer, policy, modules, projector, normalizer, tokenizer.pad_token_id, fingerprint,
        compiled=cfg.compile,
    )  # fmt: skip
    keep_compute_casts(model, policy)  # from here on the model only collects gradients
    return setup, examples, hashes


def _refuse_duplicate(index: ix.GradientIndex, fingerprint: str) -> None:
    """Appending the examples the index already holds is a mistake (or a rerun of a finished append)."""
    inputs = index.path / INPUTS_FILE
    first = read_json(inputs).get("dataset") if inputs.exists() else None
    held = [first] + [s.get("dataset_fingerprint") for s in ix.segments(index.meta)[1:]]
    if fingerprint in held:
        raise AssayError(f"{index.path} already holds these examples (segment {held.index(fingerprint) + 1})")


def _refuse_held_examples(index: ix.GradientIndex, examples: Examples) -> np.ndarray | None:
    """The new examples' content hashes; those the index already holds (same tokens and loss
    positions, under any id) would be rows twice over: refused, naming them, before the model loads."""
    held_file = index.path / ix.HASHES_FILE
    if not held_file.exists():
        return None  # built before per-example hashes: only whole datasets are checked (above)
    hashes = example_hashes(examples)
    again = np.flatnonzero(np.isin(hashes, np.load(held_file, allow_pickle=False)))
    if again.size:
        first = ", ".join(str(int(examples.ids[i])) for i in again[:5]) + (", ..." if again.size > 5 else "")
        raise AssayError(
            f"{again.size} of the {len(examples)} new examples are already in {index.path} (row ids in "
            f"the new data: {first}); drop them from the data and append again"
        )
    return hashes


def _check_room(out: Path, rows: int) -> None:
    """Refuse (before any work) a rows file whose header cannot say `rows` rows in place."""
    _, shape, _, header = ix.read_npy_header(out / ix.GRADIENTS_FILE)
    if ix.header_for_rows(header, shape, rows) is None:
        raise AssayError(
            f"{out}/{ix.GRADIENTS_FILE} has no room in its header for {rows} rows (written by an old numpy); "
            "build the union of the datasets instead"
        )


@contextmanager
def _staging(out: Path, cfg: BuildConfig) -> Iterator[RunFolder]:
    """OUT.append.part as a locked, resumable run folder that is removed (never renamed) when done;
    kept with its work when interrupted. Every rank raises the same error if it cannot be opened."""
    dist = Distributed.current()
    run = open_on_every_rank(RunFolder(out.with_name(out.name + ".append"), "build", cfg))
    with abandon_on_failure(run):
        yield run
    run.close()
    if dist.is_main:
        shutil.rmtree(run.path, ignore_errors=True)
    dist.barrier()


def commit(
    out: Path, index: ix.GradientIndex, staged: Path, cfg: BuildConfig, segment: dict[str, Any]
) -> dict[str, Any]:
    """Steps 1-3 of the module docstring; returns the new index.json. Each step can be redone."""
    dist = Distributed.current()
    total = segment["rows"][1]
    if dist.is_main:
        grow_rows(out / ix.GRADIENTS_FILE, len(index), staged / ix.GRADIENTS_FILE)
    dist.barrier()
    meta = {**index.meta, "num_examples": total, "segments": [*_first_segment(index), segment]}
    stats = (
        union_stats(out, index, total, cfg) if index.meta.get("preconditioner", "none") != "none" else None
    )
    if dist.is_main:
        nxt = assemble(out, index, staged, meta, stats)
        (staged / COMMITTED).write_text((nxt / DONE_FILE).read_text())
        swap(out, nxt)
    dist.barrier()
    return meta


def _first_segment(index: ix.GradientIndex) -> list[dict[str, Any]]:
    """The index's segments, the first one with its dataset's fingerprint (from inputs.json)."""
    segs = ix.segments(index.meta)
    inputs = index.path / INPUTS_FILE
    if "dataset_fingerprint" not in segs[0] and inputs.exists():
        segs[0] = {**segs[0], "dataset_fingerprint": read_json(inputs).get("dataset")}
    return segs


def grow_rows(path: Path, rows: int, staged: Path, chunk_rows: int = 4096) -> None:
    """Write the staged rows after the first `rows` rows of the .npy file `path`, then set its header
    to the new count (same length). Bytes of the first `rows` rows are never written."""
    offset, shape, dtype, header = ix.read_npy_header(path)
    new = np.load(staged, mmap_mode="r")  # [k, D]
    if new.dtype != dtype or new.shape[1:] != tuple(shape[1:]):
        raise AssayError(f"{staged} does not hold rows of {path}'s dtype and width; delete it and rerun")
    grown = ix.header_for_rows(header, shape, rows + len(new))
    assert grown is not None and len(grown) == len(header)  # _check_room refused otherwise
    start = offset + rows * int(np.prod(shape[1:])) * dtype.itemsize
    with open(path, "r+b") as f:
        f.truncate(start + new.nbytes)  # drops what an abandoned append left past the rows
        f.seek(start)
        for i in range(0, len(new), chunk_rows):
            f.write(np.ascontiguousarray(new[i : i + chunk_rows]).tobytes())
        f.flush()
        os.fsync(f.fileno())
        f.seek(0)
        f.write(grown)
        f.flush()
        os.fsync(f.fileno())


def union_stats(
    out: Path, index: ix.GradientIndex, total: int, cfg: BuildConfig
) -> tuple[dict[str, torch.Tensor], int]:
    """The TrackStar sums of the union, exactly as a build of it would take them (module docstring).
    Runs on every rank (the sums are shared out and reduced)."""
    ix.check_stats_dims(index.meta)
    sums, count = index.preconditioner_stats()
    grads = ix.open_rows(out / ix.GRADIENTS_FILE, total, index.dim)  # the union: grown in place
    assert grads is not None
    n = len(index)
    if count == n and total <= cfg.stats_samples:  # the saved sample was every row; so is the union's
        new = ix.preconditioner_sums(grads, np.arange(n, total), index.meta)
        return {name: sums[name] + new[name] for name in new}, total
    rows = sample_positions(total, cfg.stats_samples, cfg.runtime.seed)
    note(f"statistics over the union's sample of {len(rows)} rows")
    return ix.preconditioner_sums(grads, rows, index.meta), len(rows)


def assemble(out: Path, index: ix.GradientIndex, staged: Path, meta: dict[str, Any], stats: Any) -> Path:
    """The new index in staged/next: unchanged files linked, the rest written; returns its path."""
    nxt = staged / NEXT
    shutil.rmtree(nxt, ignore_errors=True)
    nxt.mkdir()
    for file in out.iterdir():
        if file.is_file() and file.name not in REWRITTEN:
            _link_or_copy(file, nxt / file.name)
    for name in (ix.IDS_FILE, ix.LOSSES_FILE, ix.TOKENS_FILE, ix.NORMS_FILE, ix.HASHES_FILE):
        if (out / name).exists():
            old = np.load(out / name, allow_pickle=False)
            np.save(nxt / name, np.concatenate([old, np.load(staged / name, allow_pickle=False)]))
    if stats is not None:
        ix.write_preconditioner(nxt, *stats)
    write_json(nxt / ix.META_FILE, meta)
    before = out / ix.CHECKSUMS_FILE  # its rows' digest is carried on: only the new rows are hashed
    ix.write_checksums(nxt, meta, read_json(before) if before.exists() else None)
    done = read_json(out / DONE_FILE)
    appends = int(done.get("appends", 0)) + 1
    write_json(
        nxt / DONE_FILE, {**done, "finished": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "appends": appends}
    )
    return nxt


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:  # a filesystem without hard links
        shutil.copy2(src, dst)


def swap(out: Path, nxt: Path) -> None:
    """Put the new index in place of the old in two renames (as a run folder is committed)."""
    old = out.with_name(out.name + ".append.old")
    shutil.rmtree(old, ignore_errors=True)
    os.replace(out, old)
    os.replace(nxt, out)
    shutil.rmtree(old, ignore_errors=True)


def _recover(out: Path) -> dict[str, Any] | None:
    """Finish an append that was interrupted after its new index was assembled: the new index's
    metadata when that append is now complete, else None (nothing pending, or rows to compute)."""
    staged = staging_path(out)
    nxt, marker = staged / NEXT, staged / COMMITTED
    if not marker.exists():
        return None
    if not out.exists() and (nxt / DONE_FILE).exists():
        os.replace(nxt, out)  # killed between the two renames of `swap`
    if (out / DONE_FILE).exists() and (out / DONE_FILE).read_text() == marker.read_text():
        note(f"the interrupted append into {out} had finished; removing {staged}")
        shutil.rmtree(out.with_name(out.name + ".append.old"), ignore_errors=True)
        shutil.rmtree(staged, ignore_errors=True)
        meta = read_json(out / ix.META_FILE)
        start, stop = ix.segments(meta)[-1]["rows"]
        return {**meta, "appended": stop - start}
    return None


def segment_data(meta: dict[str, Any]) -> list[tuple[range, DataConfig, int]]:
    """(rows, dataset config, id offset) of each segment of an index."""
    return [(range(*s["rows"]), DataConfig(**s["data"]), int(s["id_offset"])) for s in ix.segments(meta)]
