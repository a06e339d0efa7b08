"""Two commands into one OUT: the second is refused while the first runs. A full disk: one line,
nothing that looks finished, never SIGBUS; the rerun resumes."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from pathlib import Path

import pytest

import assay
from assay.attribution import build as build_mod
from assay.cli import main
from assay.core import disk
from assay.core.disk import as_disk_full
from tests.helpers import write_word_texts

HOLD_LOCK = """
import sys, time
from assay.core.runs import RunFolder
from dataclasses import dataclass
@dataclass
class C:
    out: str
run = RunFolder(sys.argv[1], "build", C(out=sys.argv[1])).open()
print("locked", flush=True)
time.sleep(60)
"""


def _build(out, model_dir, data, *extra) -> list[str]:
    args = ["build", str(out), "--model", str(model_dir), "--dataset", str(data), "--precision", "fp32"]
    return [*args, "--projection_dim", "4", *extra]


def _error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err.strip().splitlines()[-1]


def test_a_second_command_into_the_same_out_is_refused(tmp_path, tiny_model_dir, texts_jsonl, capsys):
    out = tmp_path / "idx"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_LOCK, str(out)], stdout=subprocess.PIPE, text=True, cwd=Path.cwd()
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        assert main(_build(out, tiny_model_dir, texts_jsonl)) == 2
        err = _error_line(capsys)
        assert f"another assay process (pid {holder.pid}) is writing {out}.part" in err
        assert (tmp_path / "idx.part").is_dir()  # the first run's folder is left alone
    finally:
        holder.kill()
        holder.wait()
    assert main(_build(out, tiny_model_dir, texts_jsonl)) == 0  # the lock died with its process
    assert not (out / ".lock").exists()


def test_a_full_disk_when_the_rows_are_allocated_is_one_line(
    tmp_path, tiny_model_dir, texts_jsonl, monkeypatch, capsys
):
    def no_space(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(disk.os, "posix_fallocate", no_space)
    out = tmp_path / "idx"
    assert main(_build(out, tiny_model_dir, texts_jsonl)) == 2
    err = _error_line(capsys)
    assert err.startswith("assay build: error: no space left on device writing ")
    assert "gradients.npy" in err and "free " in err and " MB" in err
    assert not out.exists() and not (tmp_path / "idx.part" / "run.json").exists()
    monkeypatch.undo()
    assert main(_build(out, tiny_model_dir, texts_jsonl)) == 0  # the rerun resumes and finishes
    assert len(assay.open_index(out)) == 6


def test_a_full_disk_anywhere_in_a_run_is_one_line(
    tmp_path, tiny_model_dir, texts_jsonl, monkeypatch, capsys
):
    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "idx.part" / "x"))

    monkeypatch.setattr(build_mod, "save_preconditioner_stats", no_space)
    out = tmp_path / "idx"
    assert main(_build(out, tiny_model_dir, texts_jsonl, "--preconditioner", "trackstar")) == 2
    assert "no space left on device writing" in _error_line(capsys)
    assert not out.exists() and (tmp_path / "idx.part").exists()


def test_library_errors_that_wrap_a_full_disk_are_recognised(tmp_path):
    wrapped = RuntimeError("Error while serializing: IoError(Os { code: 28, kind: StorageFull })")
    assert "no space left on device writing" in str(as_disk_full(wrapped, tmp_path / "f"))
    assert as_disk_full(OSError(errno.EACCES, "denied"), tmp_path) is None


def _mount_tmpfs(folder: Path, size: str) -> bool:
    if os.geteuid() != 0:
        return False
    folder.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)], capture_output=True
    )
    return done.returncode == 0


def test_a_real_full_disk_is_one_line_not_sigbus(tmp_path, tiny_model_dir):
    """On a 1 MiB tmpfs the index's rows (about 2 MiB) do not fit: the build must say so in one
    line. Before the rows were preallocated it died of SIGBUS (exit -7) while writing them."""
    small = tmp_path / "small"
    if not _mount_tmpfs(small, "1m"):
        pytest.skip("needs root and a tmpfs mount")
    try:
        data = write_word_texts(tmp_path / "words.jsonl", 160, 8)
        args = _build(small / "idx", tiny_model_dir, data, "--projection_dim", "16", "--threads", "1")
        done = subprocess.run([sys.executable, "-m", "assay", *args], capture_output=True, text=True)
        assert done.returncode == 2, done.stderr[-2000:]
        last = done.stderr.strip().splitlines()[-1]
        assert (
            last.startswith("assay build: error: no space left on device writing ")
            and "Traceback" not in done.stderr
        )
        assert not (small / "idx").exists()
    finally:
        subprocess.run(["umount", str(small)], check=False)


HOLD_EXPERIMENT = """
import sys, time
from dataclasses import dataclass
from assay.core.experiment import open_experiment
@dataclass
class C:
    out: str
open_experiment(sys.argv[1], "coreset", C(out=sys.argv[1]), False)
print("locked", flush=True)
time.sleep(60)
"""


def test_an_experiment_runs_in_one_process_at_a_time(tmp_path):
    from dataclasses import dataclass

    from assay.core.errors import AssayError
    from assay.core.experiment import finish_experiment, open_experiment

    @dataclass
    class C:
        out: str

    root = tmp_path / "exp"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_EXPERIMENT, str(root)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        with pytest.raises(AssayError, match=f"another assay process \\(pid {holder.pid}\\)"):
            open_experiment(root, "coreset", C(out=str(root)), False)
    finally:
        holder.kill()
        holder.wait()
    first = open_experiment(root, "coreset", C(out=str(root)), False)
    assert open_experiment(root, "coreset", C(out=str(root)), False) == first  # resumed in-process
    finish_experiment(first)
    assert not (root / ".lock").exists()
