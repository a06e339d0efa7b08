"""Run folders: written atomically, self-describing, resumable, never silently replaced.

A command writes into `OUT.part/` and renames it to `OUT/` when it finishes, so a folder
without `.part` is always whole. `config.json` holds the command, its resolved config and
the package version, so any run can be replayed (`assay replay OUT`). An interrupted run
leaves `OUT.part/`; rerunning the same command with the same config resumes it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
import types
import typing
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from assay.core.errors import AssayError

CONFIG_FILE = "config.json"
DONE_FILE = "run.json"


def package_version() -> str:
    """The installed assay version (or "dev" when running from a bare checkout)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("assay")
    except PackageNotFoundError:
        return "dev"


def write_json(path: Path, obj: Any) -> None:
    """Write JSON atomically: a reader sees the old file or the new one, never half."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, default=str) + "\n")
    os.replace(tmp, path)


def write_jsonl(path: Path, records: list[dict[str, Any]]) -> None:
    """Write one JSON object per line, atomically (standard JSON: NaN and inf are refused)."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        for record in records:
            f.write(json.dumps(record, allow_nan=False) + "\n")
    os.replace(tmp, path)


def read_json(path: Path) -> Any:
    """Read a JSON file, with a clear error when it is missing or broken."""
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise AssayError(f"missing file {path}") from None
    except json.JSONDecodeError as e:
        raise AssayError(f"{path} is not valid JSON ({e})") from None


def config_to_dict(cfg: Any) -> dict[str, Any]:
    """A dataclass config as plain JSON data."""
    return json.loads(json.dumps(dataclasses.asdict(cfg), default=str))


def config_from_dict(cls: type, data: dict[str, Any]) -> Any:
    """Rebuild a (nested) dataclass config from `config_to_dict` output.

    A field missing from `data` takes the class's `LEGACY_DEFAULTS` entry when it has one (what
    runs did before the field existed, so an old config replays as it ran), else its default.
    """
    hints = typing.get_type_hints(cls)
    legacy = getattr(cls, "LEGACY_DEFAULTS", {})
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name in data:
            kwargs[f.name] = _from_json(hints[f.name], data[f.name])
        elif f.name in legacy:
            kwargs[f.name] = legacy[f.name]
    return cls(**kwargs)


def _from_json(tp: Any, value: Any) -> Any:
    tp = _strip_annotated(tp)
    if dataclasses.is_dataclass(tp) and isinstance(value, dict):
        return config_from_dict(tp, value)  # type: ignore[arg-type]
    if typing.get_origin(tp) is tuple and isinstance(value, list):
        return tuple(value)
    if typing.get_origin(tp) in (typing.Union, types.UnionType) and isinstance(value, dict):
        for arg in typing.get_args(tp):
            if dataclasses.is_dataclass(_strip_annotated(arg)):
                return _from_json(arg, value)
    return value


def _strip_annotated(tp: Any) -> Any:
    while typing.get_origin(tp) is typing.Annotated:
        tp = typing.get_args(tp)[0]
    return tp


class RunFolder:
    """An output folder being written. `path` is the `.part` folder until `commit`."""

    def __init__(self, out: Path | str, command: str, cfg: Any, overwrite: bool = False):
        self.final = Path(out)
        self.path = self.final.with_name(self.final.name + ".part")
        self.command = command
        self.record: dict[str, Any] = {
            "command": command,
            "assay_version": package_version(),
            "config": config_to_dict(cfg),
        }
        self.overwrite = overwrite
        self.resumed = False

    def open(self) -> RunFolder:
        """Create `OUT.part/` (or resume it), refusing to clobber a finished run."""
        if (self.final / DONE_FILE).exists() and not self.overwrite:
            raise AssayError(
                f"{self.final} already holds a finished run; pass --overwrite to replace it "
                "or choose another output folder"
            )
        if self.final.exists() and not (self.final / DONE_FILE).exists() and not self.overwrite:
            raise AssayError(f"{self.final} exists and is not an assay run; choose another folder")
        if self.path.exists():
            self._check_resumable()
            self.resumed = True
        self.path.mkdir(parents=True, exist_ok=True)
        write_json(self.path / CONFIG_FILE, self.record)
        return self

    def _check_resumable(self) -> None:
        saved = self.path / CONFIG_FILE
        if not saved.exists():
            return
        old = read_json(saved).get("config")
        new: dict[str, Any] = dict(self.record["config"])  # type: ignore[call-overload]
        old.pop("overwrite", None), new.pop("overwrite", None)
        if old != new:
            raise AssayError(
                f"{self.path} holds an interrupted run with other settings; rerun with the "
                "same arguments to resume it, or delete that folder to start afresh"
            )

    def commit(self, summary: dict[str, Any] | None = None) -> Path:
        """Mark the run finished and move it into place in one rename."""
        done = {"finished": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **(summary or {})}
        write_json(self.path / DONE_FILE, done)
        old = self.final.with_name(self.final.name + ".replaced")
        if self.final.exists():
            os.replace(self.final, old)
        os.replace(self.path, self.final)
        shutil.rmtree(old, ignore_errors=True)
        return self.final


@contextmanager
def run_folder(out: Path | str, command: str, cfg: Any, overwrite: bool = False) -> Iterator[RunFolder]:
    """Open a run folder; commit it when the block finishes, keep `.part` if it fails.

    Under torchrun, rank 0 opens and commits the folder; every rank raises the same error if
    it cannot be opened, and inside the block each rank writes only its own files or rows.
    """
    from assay.core.distributed import Distributed

    dist = Distributed.current()
    run, error = RunFolder(out, command, cfg, overwrite), None
    if dist.is_main:
        try:
            run.open()
        except AssayError as e:
            error = str(e)
    error = dist.agree(error)
    if error:
        raise AssayError(error)
    run.resumed = bool(dist.broadcast_object(run.resumed))
    yield run
    dist.barrier()  # every rank's rows are on disk before rank 0 renames the folder
    if dist.is_main:
        run.commit()
    dist.barrier()


def load_run_config(run_dir: Path | str) -> dict[str, Any]:
    """The saved `config.json` of a finished or interrupted run."""
    run_dir = Path(run_dir)
    for candidate in (run_dir, run_dir.with_name(run_dir.name + ".part")):
        if (candidate / CONFIG_FILE).exists():
            return typing.cast(dict[str, Any], read_json(candidate / CONFIG_FILE))
    raise AssayError(f"{run_dir} is not an assay run folder (no {CONFIG_FILE})")
