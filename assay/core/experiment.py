"""Experiments: folders of stages (each a run folder of its own), written in place.

An experiment's stages refer to each other by path (a retrain names the full run whose order
it replays), so its folder is not renamed at the end like a run folder: it is finished when
it holds run.json, and a rerun with the same settings resumes at the first unfinished stage.
A rerun with other settings is refused, naming the first setting that differs.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from assay.core.console import note
from assay.core.distributed import Distributed
from assay.core.errors import AssayError
from assay.core.runs import (
    CONFIG_FILE,
    DONE_FILE,
    LOCK_FILE,
    RunFolder,
    first_difference,
    lock_file,
    read_json,
    refuse_inputs_inside,
    write_json,
)

STAGES_FILE = "stages.json"


def open_experiment(
    out: str | Path, command: str, cfg: Any, overwrite: bool, free: Iterable[str] = (), extend: bool = False
) -> Path:
    """Create or resume the experiment folder OUT (rank 0 only). Settings named in `free` (and
    --overwrite) may change between a run and its resumption; any other change is refused. With
    `extend`, a finished experiment may be continued with other free settings (e.g. more methods
    validated against a ground truth made once) instead of being refused."""
    root = Path(out).resolve()
    folder = RunFolder(root, command, cfg, overwrite)
    refuse_inputs_inside(root, folder.record["config"])
    if root.exists() and not (root / CONFIG_FILE).exists() and not (root / DONE_FILE).exists():
        raise AssayError(f"{root} exists and is not an assay {command} experiment; choose another folder")
    _lock_experiment(root)  # before anything is removed or written: one process per experiment
    if (root / DONE_FILE).exists() and not (extend and not overwrite):
        if not overwrite:
            raise AssayError(f"{root} holds a finished experiment; pass --overwrite to redo it from scratch")
        for entry in root.iterdir():  # all but the lock this process holds
            if entry.name != LOCK_FILE:
                shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
    if (root / CONFIG_FILE).exists():
        saved = read_json(root / CONFIG_FILE)
        if saved.get("command") != command:
            raise AssayError(f"{root} holds an assay {saved.get('command')} experiment, not {command}")
        changed = first_difference(saved["config"], folder.record["config"], {*folder.free, *free})
        if changed:
            raise AssayError(
                f"{root} holds an experiment made with another {changed}; rerun it with its own settings "
                f"to resume (`assay replay {root}` does), or choose another folder"
            )
        note(f"resuming the experiment in {root}")
    root.mkdir(parents=True, exist_ok=True)
    write_json(root / CONFIG_FILE, folder.record)
    return root


_HELD: dict[Path, int] = {}
"""Experiment folders this process holds the lock of (their descriptors): a resumed experiment
in the same process (a notebook, a test) takes its own lock again."""


def _lock_experiment(root: Path) -> None:
    """Hold the exclusive lock on ROOT/.lock for this process (released when it ends or the
    experiment finishes); a second process is refused in one line."""
    if root in _HELD:
        return
    root.mkdir(parents=True, exist_ok=True)
    busy = f"is running the experiment in {root}; wait for it to finish, or choose another folder"
    _HELD[root] = lock_file(root / LOCK_FILE, busy)


def finish_experiment(root: Path) -> None:
    """Mark the experiment finished (rank 0) and release its lock."""
    write_json(root / DONE_FILE, {"finished": time.strftime("%Y-%m-%dT%H:%M:%S%z")})
    fd = _HELD.pop(root.resolve(), None)
    if fd is not None:
        (root / LOCK_FILE).unlink(missing_ok=True)
        os.close(fd)


class Stages:
    """Run each stage once: a stage whose folder holds a finished run is skipped.

    Under torchrun every rank runs every stage (the stages are rank-aware); rank 0 decides which
    are finished, so all ranks skip the same ones, and records the times in stages.json.
    """

    def __init__(self, root: Path):
        self.path = root / STAGES_FILE
        self.times: dict[str, float] = read_json(self.path) if self.path.exists() else {}

    def run(self, name: str, folder: Path, fn: Callable[..., Any], *args: Any) -> None:
        dist = Distributed.current()
        if dist.broadcast_object((folder / DONE_FILE).exists()):
            return
        note(f"--- stage {name}")
        start = time.perf_counter()
        fn(*args)
        self.times[name] = time.perf_counter() - start
        if dist.is_main:
            write_json(self.path, self.times)
