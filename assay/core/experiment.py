"""Experiments: folders of stages (each a run folder of its own), written in place.

An experiment's stages refer to each other by path (a retrain names the full run whose order
it replays), so its folder is not renamed at the end like a run folder: it is finished when
it holds run.json, and a rerun with the same settings resumes at the first unfinished stage.
A rerun with other settings is refused, naming the first setting that differs.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from assay.core.console import note
from assay.core.distributed import Distributed
from assay.core.errors import AssayError
from assay.core.runs import CONFIG_FILE, DONE_FILE, RunFolder, read_json, write_json

STAGES_FILE = "stages.json"


def open_experiment(
    out: str | Path, command: str, cfg: Any, overwrite: bool, free: Iterable[str] = ()
) -> Path:
    """Create or resume the experiment folder OUT (rank 0 only). Settings named in `free` (and
    --overwrite) may change between a run and its resumption; any other change is refused."""
    root = Path(out).resolve()
    folder = RunFolder(root, command, cfg, overwrite)
    if (root / DONE_FILE).exists():
        if not overwrite:
            raise AssayError(f"{root} holds a finished experiment; pass --overwrite to redo it from scratch")
        shutil.rmtree(root)
    if root.exists() and not (root / CONFIG_FILE).exists():
        raise AssayError(f"{root} exists and is not an assay {command} experiment; choose another folder")
    if (root / CONFIG_FILE).exists():
        saved = read_json(root / CONFIG_FILE)
        if saved.get("command") != command:
            raise AssayError(f"{root} holds an assay {saved.get('command')} experiment, not {command}")
        changed = _first_difference(saved["config"], folder.record["config"], {"overwrite", *free})
        if changed:
            raise AssayError(
                f"{root} holds an experiment made with another {changed}; rerun with the same settings "
                "to resume it, or choose another folder"
            )
        note(f"resuming the experiment in {root}")
    root.mkdir(parents=True, exist_ok=True)
    write_json(root / CONFIG_FILE, folder.record)
    return root


def _first_difference(
    old: dict[str, Any], new: dict[str, Any], free: set[str], prefix: str = ""
) -> str | None:
    """The flag-style name (--x) of the first setting that differs, looking into nested configs."""
    for key in sorted(set(old) | set(new)):
        if key in free:
            continue
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            found = _first_difference(a, b, free)
            if found:
                return found
        elif a != b:
            return f"--{key} ({a!r}, now {b!r})"
    return None


def finish_experiment(root: Path) -> None:
    """Mark the experiment finished (rank 0)."""
    write_json(root / DONE_FILE, {"finished": time.strftime("%Y-%m-%dT%H:%M:%S%z")})


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
