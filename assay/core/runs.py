"""Run folders: written atomically, self-describing, resumable, never silently replaced.

A command writes into `OUT.part/` and renames it to `OUT/` when it finishes, so a folder
without `.part` is always whole. `config.json` holds the command, its resolved config and
the package version, so any run can be replayed (`assay replay OUT`). An interrupted run
leaves `OUT.part/`; rerunning the same command with the same config resumes it.

While a run writes, it holds an exclusive lock on `OUT.part/.lock` (`fcntl.flock`: released by
the kernel when the process dies, however it dies), so a second command into the same OUT is
refused instead of writing into the same files. A `.part` that holds no finished work (only its
config: the run failed its input checks) is free: the corrected command simply starts in it.
A resumed run must have the same settings, except those that only decide how fast it runs
(`free`), and the same inputs (`check_inputs`: fingerprints of the data, model and tokenizer).
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from assay.core.config_json import config_from_dict as config_from_dict
from assay.core.config_json import config_to_dict as config_to_dict
from assay.core.config_json import first_difference as first_difference
from assay.core.disk import as_disk_full
from assay.core.errors import AssayError

CONFIG_FILE = "config.json"
DONE_FILE = "run.json"
INPUTS_FILE = "inputs.json"
LOCK_FILE = ".lock"
PERFORMANCE_ONLY: tuple[str, ...] = ("overwrite", "threads", "compile", "keep_freed_memory")
"""Settings a run may resume under changed: --overwrite (what to do with a finished OUT),
--keep_freed_memory (where freed memory goes: no number changes), and --threads and --compile
(how many cores torch's kernels use, and whether elementwise steps run fused: the same
operations on the same data; a kernel may split or order a sum differently, so the work done
after the change can differ from an unchanged run at fp32 rounding, exactly as two fresh runs
with those settings differ)."""
BOOKKEEPING = (CONFIG_FILE, INPUTS_FILE, LOCK_FILE)
"""What a `.part` holds before any work is done."""


PART = ".part"
"""Suffix of a run folder while it is written (`OUT.part/` until it is renamed `OUT/`)."""


def final_location(path: Path | str) -> Path:
    """Where `path` will be once the runs it lies in have finished: every `NAME.part` component
    that is a run being written (it holds a config.json) read as `NAME`. For messages: a stage of
    a larger run (`assay demo`'s) writes inside its parent's `.part`, which is renamed at the end."""
    parts, shown = Path(path).parts, []
    for i, part in enumerate(parts):
        writing = part.endswith(PART) and (Path(*parts[: i + 1]) / CONFIG_FILE).exists()
        shown.append(part[: -len(PART)] if writing else part)
    return Path(*shown)


def package_version() -> str:
    """The installed assay version (or "dev" when running from a bare checkout)."""
    from importlib.metadata import PackageNotFoundError, version  # lazy: --version and run records only

    try:
        return version("assay")
    except PackageNotFoundError:
        return "dev"


def _writer_tmp(path: Path) -> Path:
    """A temporary name beside `path` that is this process's and thread's own: under torchrun
    every rank may write the same file, and with one shared name one rank's rename would take
    the other's file away (its own rename then fails)."""
    return path.with_name(f"{path.name}.{os.getpid()}-{threading.get_ident()}.tmp")


def write_json(path: Path, obj: Any) -> None:
    """Write JSON atomically: a reader sees the old file or the new one, never half; concurrent
    writers of one path each replace it whole (the last one stays)."""
    tmp = _writer_tmp(path)
    tmp.write_text(json.dumps(obj, indent=2, default=str) + "\n")
    _replace(tmp, path)


def write_jsonl(path: Path, records: list[dict[str, Any]]) -> None:
    """Write one JSON object per line, atomically (standard JSON: NaN and inf are refused)."""
    tmp = _writer_tmp(path)
    with open(tmp, "w") as f:
        for record in records:
            f.write(json.dumps(record, allow_nan=False) + "\n")
    _replace(tmp, path)


def _replace(tmp: Path, path: Path) -> None:
    """Move a written temporary file into place; on failure (e.g. `path` is a folder) remove it."""
    try:
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
        if path.is_dir():
            raise AssayError(f"{path} is a folder; give a file path to write the results to") from None
        raise


def read_json(path: Path) -> Any:
    """Read a JSON file, with a clear error when it is missing or broken."""
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise AssayError(f"missing file {path}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise AssayError(f"{path} is not valid JSON ({e})") from None


class RunFolder:
    """An output folder being written. `path` is the `.part` folder until `commit`.

    `free`: settings (field names) that may differ when resuming, besides PERFORMANCE_ONLY.
    `resumable=False`: the command keeps no partial work (it redoes everything when rerun), so
    an interrupted `.part` is always taken over whatever its settings.
    """

    def __init__(
        self,
        out: Path | str,
        command: str,
        cfg: Any,
        overwrite: bool = False,
        free: Iterable[str] = (),
        resumable: bool = True,
    ):
        self.final = Path(out)
        self.path = self.final.with_name(self.final.name + PART)
        self.command = command
        self.record: dict[str, Any] = {
            "command": command,
            "assay_version": package_version(),
            "config": config_to_dict(cfg),
        }
        self.overwrite = overwrite
        self.free = {*PERFORMANCE_ONLY, *free}
        self.resumable = resumable
        self.resumed = False
        self._lock_fd: int | None = None

    def open(self) -> RunFolder:
        """Lock and create `OUT.part/` (or resume it), refusing to clobber a finished run, a
        path that is not an assay run, or one that holds the run's own inputs."""
        self.check()  # before `.part` exists: a refused run leaves nothing behind
        created = self._lock()
        try:
            self.check()  # again, now that no other process can be writing OUT
            if self.final.exists() and not (self.final / DONE_FILE).exists() and not self.overwrite:
                raise AssayError(
                    f"{self.final} holds an unfinished assay run; pass --overwrite to replace it "
                    f"(`assay replay {self.final} --overwrite` reruns its config.json) or choose "
                    "another folder"
                )
            if not created and self.holds_work():
                self._check_resumable()
                self.resumed = self.resumable
            write_json(self.path / CONFIG_FILE, self.record)
        except BaseException:
            self.abandon()
            raise
        return self

    def check(self) -> None:
        """The refusals `open` makes, without taking the folder: a command whose first steps are
        costly (query gradients) calls it before them. `open` checks again under the lock."""
        refuse_inputs_inside(self.final, self.record["config"])
        if self.final.exists() and not is_run_folder(self.final):
            raise AssayError(
                f"{self.final} exists and is not an assay run; assay replaces only its own runs: "
                "move it away or choose another output folder"
            )
        if (self.final / DONE_FILE).exists() and not self.overwrite:
            raise AssayError(
                f"{self.final} already holds a finished run; pass --overwrite to replace it "
                "or choose another output folder"
            )

    def holds_work(self) -> bool:
        """Whether `.part` holds anything a rerun would reuse (more than its config and lock)."""
        if not self.path.is_dir():
            return False
        return any(p.name not in BOOKKEEPING and not p.name.endswith(".tmp") for p in self.path.iterdir())

    def _lock(self) -> bool:
        """Take the exclusive lock on `.part/.lock` (creating `.part`); True when `.part` is new."""
        for _ in range(5):  # the holder may commit (rename `.part`) between our open and our flock
            created = not self.path.exists()
            self.path.mkdir(parents=True, exist_ok=True)
            lock = self.path / LOCK_FILE
            fd = lock_file(
                lock, f"is writing {self.path}; wait for it to finish, or choose another output folder"
            )
            try:
                same = os.fstat(fd).st_ino == os.stat(lock).st_ino
            except FileNotFoundError:
                same = False
            if same:
                self._lock_fd = fd
                return created
            os.close(fd)
        raise AssayError(f"could not lock {self.path}: it keeps being replaced; is another assay running?")

    def close(self) -> None:
        """Release the lock (the kernel does it too when the process dies)."""
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def abandon(self) -> None:
        """After a failure: remove `.part` if it holds no work (nothing to resume; it must not
        stand in the way of the corrected command), keep it otherwise; release the lock."""
        if self._lock_fd is not None and self.path.is_dir() and not self.holds_work():
            shutil.rmtree(self.path, ignore_errors=True)
        self.close()

    def _check_resumable(self) -> None:
        if not self.resumable:
            return
        saved = self.path / CONFIG_FILE
        if not saved.exists():
            return
        old = read_json(saved)
        changed = first_difference(old.get("config") or {}, self.record["config"], self.free)
        if old.get("command", self.command) != self.command:
            changed = f"command (assay {old.get('command')})"
        if changed:
            raise AssayError(
                f"{self.path} holds an interrupted run with another {changed}; rerun it with its own "
                f"settings to resume (`assay replay {self.final}` does), or delete {self.path} to start "
                "afresh"
            )

    def check_inputs(self, inputs: dict[str, str]) -> None:
        """Record what the run reads (name -> fingerprint, e.g. "dataset", "model", "tokenizer") on
        its first start; when resuming, refuse to continue on inputs that changed since."""
        path = self.path / INPUTS_FILE
        if path.exists() and self.resumed:
            old = read_json(path)
            changed = [name for name, value in inputs.items() if name in old and old[name] != value]
            if changed:
                raise AssayError(
                    f"{self.path} was started on another {' and '.join(changed)}: the "
                    f"{changed[0]} changed since the interrupted run began; restore it to resume, "
                    f"or delete {self.path} to start afresh"
                )
        write_json(path, inputs)

    def commit(self, summary: dict[str, Any] | None = None) -> Path:
        """Mark the run finished and move it into place in one rename."""
        done = {"finished": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **(summary or {})}
        write_json(self.path / DONE_FILE, done)
        replace_folder(self.path, self.final)
        # the lock file moved with the folder: drop it, then release (a process that opened
        # `.part/.lock` before the rename is refused; one that comes later finds no `.part`)
        (self.final / LOCK_FILE).unlink(missing_ok=True)
        self.close()
        return self.final


def replace_folder(written: Path, final: Path) -> None:
    """Move the whole folder `written` to `final`: the folder there (if any) is set aside, the new
    one renamed into place, the old one deleted; `final` is never a mix of the two."""
    old = _writer_tmp(final.with_name(final.name + ".replaced"))
    if final.exists():
        os.replace(final, old)
    os.replace(written, final)
    shutil.rmtree(old, ignore_errors=True)


@contextmanager
def new_folder(final: Path | str) -> Iterator[Path]:
    """A fresh folder beside `final` to write into; when the block finishes it replaces `final`
    (`replace_folder`), when it fails it is removed (a full disk: one line). The caller decides
    beforehand whether `final` may be replaced."""
    final = Path(final).absolute()
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = _writer_tmp(final)
    tmp.mkdir()
    try:
        yield tmp
        replace_folder(tmp, final)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        full = as_disk_full(e, final)
        if full is not None:
            raise full from None
        raise


def is_run_folder(path: Path) -> bool:
    """Whether `path` is a folder assay wrote: a finished run, or one with its config.json."""
    return path.is_dir() and ((path / DONE_FILE).exists() or (path / CONFIG_FILE).exists())


def refuse_inputs_inside(out: Path, config: dict[str, Any]) -> None:
    """Refuse an output location that is, or holds, a path the run reads (a model, dataset or
    index named in its config): replacing OUT would delete that input."""
    target = Path(out).resolve()
    for key, value in _path_values(config):
        held = Path(value).expanduser()
        if not held.exists():
            continue
        held = held.resolve()
        if held == target or target in held.parents:
            where = "is" if held == target else "holds"
            raise AssayError(
                f"{out} {where} an input of this run (--{key} {value}): writing the results there "
                "would delete it; choose another output folder"
            )


def _path_values(config: Any, key: str = "") -> Iterator[tuple[str, str]]:
    """(option, value) of every non-empty string in a config, but its own output location."""
    if isinstance(config, dict):
        for name, value in config.items():
            if name != "out":
                yield from _path_values(value, name)
    elif isinstance(config, list):
        for value in config:
            yield from _path_values(value, key)
    elif isinstance(config, str) and config:
        yield key, config


def lock_file(lock: Path, busy: str) -> int:
    """A descriptor holding the exclusive flock on `lock` (created if missing), our pid written in
    it; when another process holds it: AssayError "another assay process (pid P) {busy}"."""
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise AssayError(f"another assay process (pid {holder}) {busy}") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    return fd


@contextmanager
def run_folder(
    out: Path | str,
    command: str,
    cfg: Any,
    overwrite: bool = False,
    free: Iterable[str] = (),
    resumable: bool = True,
) -> Iterator[RunFolder]:
    """Open a run folder; commit it when the block finishes, keep `.part` if it fails (removed
    when it holds no work). A full disk anywhere inside is one line (AssayError).

    Under torchrun, rank 0 opens, locks and commits the folder; every rank raises the same error
    if it cannot be opened, and inside the block each rank writes only its own files or rows.
    """
    from assay.core.distributed import Distributed  # lazy: loads torch; cli reads runs without it

    dist = Distributed.current()
    run = open_on_every_rank(RunFolder(out, command, cfg, overwrite, free, resumable))
    with abandon_on_failure(run):
        yield run
        dist.barrier()  # every rank's rows are on disk before rank 0 renames the folder
        if dist.is_main:
            run.commit()
    dist.barrier()


def open_on_every_rank(run: RunFolder) -> RunFolder:
    """Rank 0 opens (and locks) the folder; every rank raises the same error if it cannot, and
    every rank learns whether it resumed."""
    from assay.core.distributed import Distributed  # lazy: loads torch; cli reads runs without it

    dist = Distributed.current()
    error = None
    if dist.is_main:
        try:
            run.open()
        except AssayError as e:
            error = str(e)
    error = dist.agree(error)
    if error:
        run.abandon()
        raise AssayError(error)
    run.resumed = bool(dist.broadcast_object(run.resumed))
    return run


@contextmanager
def abandon_on_failure(run: RunFolder) -> Iterator[None]:
    """On any failure inside: leave the folder as `.part` (removed when it holds no work) and
    turn a full disk into one line."""
    try:
        yield
    except BaseException as e:
        run.abandon()
        full = as_disk_full(e, run.path)
        if full is not None:
            raise full from None
        raise


def check_inputs(run: RunFolder, inputs: dict[str, str]) -> None:
    """`RunFolder.check_inputs` on rank 0 under torchrun (every rank raises the same error)."""
    from assay.core.distributed import Distributed  # lazy: loads torch; cli reads runs without it

    dist = Distributed.current()
    error = None
    if dist.is_main:
        try:
            run.check_inputs(inputs)
        except AssayError as e:
            error = str(e)
    error = dist.agree(error)
    if error:
        raise AssayError(error)


def load_run_config(run_dir: Path | str) -> dict[str, Any]:
    """The saved `config.json` of a finished or interrupted run."""
    run_dir = Path(run_dir)
    for candidate in (run_dir, run_dir.with_name(run_dir.name + PART)):
        if (candidate / CONFIG_FILE).exists():
            saved = read_json(candidate / CONFIG_FILE)
            if not isinstance(saved, dict):
                raise AssayError(f"{candidate / CONFIG_FILE} is not a run's config (a JSON object)")
            return saved
    raise AssayError(f"{run_dir} is not an assay run folder (no {CONFIG_FILE})")
