"""The command line: help from docstrings, one-line errors, replay of saved configs."""

import json
import os
import subprocess
import sys

import pytest

from assay.cli import COMMANDS, main


def _run(capsys, *args):
    code = main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_help_lists_every_command(capsys):
    code, out, _ = _run(capsys)
    assert code == 0
    for name in COMMANDS:
        assert name in out


def test_command_help_documents_flags_from_docstrings(capsys):
    with pytest.raises(SystemExit):
        main(["eval", "--help"])
    out = capsys.readouterr().out
    assert "--max_samples" in out and "Keep only the first N examples" in out
    assert "--precision" in out and "bf16-pure" in out


@pytest.mark.parametrize(
    "args, message",
    [
        (["eval", "o", "--dataset", "missing.jsonl"], "not found"),
        (["eval", "o", "--dataset", "DATA", "--text_column", "body"], "no column 'body'"),
        (
            ["eval", "o", "--dataset", "DATA", "--filter_column", "group", "--filter_value", "x"],
            "no row whose 'group' is 'x'",
        ),
        (["eval", "o", "--model", "./no-such-model"], "'./no-such-model': no such folder"),
        (["eval", "o", "--dataset", "DATA", "--completion_column", "c"], "--prompt_column"),
        (["nonsense"], "unknown command"),
    ],
)
def test_bad_input_is_one_clear_line(capsys, tmp_path, texts_jsonl, tiny_model_dir, args, message):
    args = [str(texts_jsonl) if a == "DATA" else a for a in args]
    args = [str(tmp_path / a) if a == "o" else a for a in args]
    if "--model" not in args and args[0] == "eval":
        args += ["--model", str(tiny_model_dir)]
    code, _, err = _run(capsys, *args)
    assert code == 2
    lines = err.strip().splitlines()
    assert message in lines[-1] and lines[-1].startswith("assay ")
    assert "Traceback" not in err


def test_usage_errors_name_the_flags_without_their_help(capsys):
    code, _, err = _run(capsys, "eval", "o", "--max_sample", "3")
    line = err.strip().splitlines()[-1]
    assert code == 2 and "Perhaps you meant: --max_samples" in line
    assert "Keep only the first" not in line  # the suggestion's help text stays in --help
    code, _, err = _run(capsys, "eval", "o", "--token_batch_size", "abc")
    line = err.strip().splitlines()[-1]
    assert code == 2 and "--token_batch_size" in line and "forward batch" not in line
    code, _, err = _run(capsys, "eval", "--model", "m")
    line = err.strip().splitlines()[-1]
    assert code == 2 and line.startswith("assay eval: error: Missing from assay eval: OUT (see")


def test_unknown_precision_exits_nonzero_without_traceback(tmp_path, texts_jsonl):
    proc = subprocess.run(
        [sys.executable, "-m", "assay", "eval", str(tmp_path / "o"), "--precision", "fp8"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode != 0 and "fp8" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("args", [["sae", "train", "--help"], ["--help"], ["--version"]])
def test_output_into_a_closed_pipe_is_no_traceback(args):
    """`assay score --help | head -1`: once stdout's reader has gone, writing the rest meets a
    closed pipe; that ends the process with 141 (128 + SIGPIPE), quietly. The read end is closed
    before the process starts, so every write meets it (no race with the reader)."""
    read, write = os.pipe()
    os.close(read)
    try:
        proc = subprocess.run(
            [sys.executable, "-c", "from assay.cli import entry; raise SystemExit(entry())", *args],
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
        )
    finally:
        os.close(write)
    assert proc.returncode == 141 and "Traceback" not in proc.stderr, proc.stderr


def test_eval_then_replay_reproduces(capsys, tmp_path, texts_jsonl, tiny_model_dir):
    out = tmp_path / "ev"
    args = ["eval", str(out), "--model", str(tiny_model_dir), "--dataset", str(texts_jsonl)]
    assert main([*args, "--precision", "fp32"]) == 0
    first = json.loads((out / "summary.json").read_text())
    assert main(args + ["--precision", "fp32"]) == 2  # finished: refuses to overwrite
    assert main(["replay", str(out), "--out", str(tmp_path / "again")]) == 0
    again = json.loads((tmp_path / "again" / "summary.json").read_text())
    assert again["mean_loss"] == pytest.approx(first["mean_loss"], rel=1e-6)
    saved = json.loads((tmp_path / "again" / "config.json").read_text())
    assert saved["config"]["runtime"]["precision"] == "fp32"
