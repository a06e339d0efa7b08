"""Reading run folders for the report: the saved config, the done record, optional outputs.

Every reader of an optional file returns None (or an empty list) when the file is absent or
unreadable, so a section shows what there is and says what is missing instead of failing.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from assay.core.errors import AssayError
from assay.core.runs import CONFIG_FILE, DONE_FILE

# How a container's stages are ordered: data -> attribution -> selection -> features -> the rest.
STAGE_ORDER = ("build", "score", "filter", "coreset", "sae train", "sae eval", "finetune", "eval")
SHOWS_OWN_STAGES = frozenset({"coreset"})
"""Commands whose view presents their nested runs itself (an experiment's retraining runs)."""


@dataclass
class Run:
    """A run folder: its path, the command that made it, its config and its done record."""

    path: Path
    command: str
    config: dict[str, Any]
    done: dict[str, Any] | None  # run.json (None while unfinished: OUT.part/)
    version: str = ""

    @property
    def finished(self) -> bool:
        return self.done is not None

    @property
    def name(self) -> str:
        return self.path.name.removesuffix(".part")

    def file(self, name: str) -> Path | None:
        p = self.path / name
        return p if p.exists() else None

    def json(self, name: str) -> Any:
        """A JSON file's content, or None when absent/broken."""
        p = self.file(name)
        if p is None:
            return None
        try:
            return json.loads(p.read_text())
        except (OSError, json.JSONDecodeError):
            return None

    def jsonl(self, name: str, limit: int | None = None) -> list[dict[str, Any]]:
        """The records of a JSONL file ([] when absent); broken lines (a killed writer) are skipped."""
        p = self.file(name)
        if p is None:
            return []
        out = []
        with open(p) as f:
            for line in f:
                line = line.strip()
                if not line:
                    continue
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    continue
                if limit is not None and len(out) >= limit:
                    break
        return out

    def npy(self, name: str) -> np.ndarray | None:
        p = self.file(name)
        if p is None:
            return None
        try:
            return np.load(p, mmap_mode="r", allow_pickle=False)
        except (OSError, ValueError):
            return None

    def children(self) -> list[Run]:
        """Run folders nested one level down (the stages of a demo or an experiment)."""
        found = []
        for sub in sorted(p for p in self.path.iterdir() if p.is_dir()):
            run = try_open_run(sub)
            if run is not None and run.path == sub:
                found.append(run)
        rank = {c: i for i, c in enumerate(STAGE_ORDER)}
        return sorted(found, key=lambda r: (rank.get(r.command, len(rank)), r.name))


def try_open_run(path: Path) -> Run | None:
    """The run at `path` (or `path.part`), or None when it is not a run folder."""
    for candidate in (path, path.with_name(path.name + ".part")):
        cfg_path = candidate / CONFIG_FILE
        if cfg_path.exists():
            try:
                record = json.loads(cfg_path.read_text())
            except (OSError, json.JSONDecodeError):
                return None
            if not isinstance(record, dict) or "command" not in record:
                return None
            done_path = candidate / DONE_FILE
            done = None
            if done_path.exists():
                try:
                    done = json.loads(done_path.read_text())
                except (OSError, json.JSONDecodeError):
                    done = {}
            return Run(
                candidate,
                str(record["command"]),
                record.get("config") or {},
                done,
                record.get("assay_version", ""),
            )
    return None


def open_run(path: Path | str) -> Run:
    """The run folder at `path`, or a one-line error saying what it is not."""
    path = Path(path)
    run = try_open_run(path)
    if run is None:
        if not path.exists() and not path.with_name(path.name + ".part").exists():
            raise AssayError(f"no such folder: {path}")
        raise AssayError(f"{path} is not an assay run folder (no {CONFIG_FILE} naming a command)")
    return run


def flat_config(config: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    """Nested config dicts as (dotted key, value) pairs for a settings table."""
    out: list[tuple[str, Any]] = []
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out += flat_config(value, name + ".")
        elif isinstance(value, list | tuple):
            out.append((name, ", ".join(str(v) for v in value)))
        else:
            out.append((name, value))
    return out
