"""The command line a new user meets: --version, group help, replay on the common parser, choices
and only meaningful flags in --help, one line for bad rows, notes through `logging`, --quiet."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import pytest

from assay.cli import main
from assay.core import console
from assay.core.runs import package_version


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "assay", *args], capture_output=True, text=True)


def test_version_and_group_help(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"assay {package_version()}"
    assert main(["sae", "--help"]) == 0
    out = capsys.readouterr().out
    assert "sae train" in out and "sae eval" in out and "build" not in out
    assert main(["sae", "nonsense"]) == 2
    assert "assay sae --help" in capsys.readouterr().err


def test_replay_uses_the_common_parser(tmp_path, texts_jsonl, tiny_model_dir):
    done = _run("replay", "--help")
    assert done.returncode == 0 and "RUN_DIR" in done.stdout and "--trust_remote_code" in done.stdout
    run = tmp_path / "ev"
    assert main(["eval", str(run), "--model", str(tiny_model_dir), "--dataset", str(texts_jsonl)]) == 0
    for bad in (["--out"], ["--no_such_flag", "1"]):
        done = _run("replay", str(run), *bad)
        assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert not (tmp_path / "ev.part").exists()


def test_help_shows_choices_and_only_meaningful_flags(capsys):
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    demo = capsys.readouterr().out
    assert "bf16-pure" in demo  # --precision's choices
    with pytest.raises(SystemExit):
        main(["eval", "--help"])
    eval_help = capsys.readouterr().out
    assert "--lora_rank" not in eval_help and "--trust_remote_code" in eval_help
    assert "SmolLM2-135M-Instruct" in eval_help and "Q4_1" in eval_help
    with pytest.raises(SystemExit):
        main(["build", "--help"])
    assert "--lora_rank" in capsys.readouterr().out  # gradients of a fresh adapter: meaningful there


@pytest.mark.parametrize(
    "row, what",
    [
        ({"other": "x"}, "missing (null)"),
        ({"text": None}, "missing (null)"),
        ({"text": 7}, "a int, not text"),
    ],
)
def test_a_row_without_text_is_one_line(tmp_path, tiny_model_dir, capsys, row, what):
    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps({"text": "fine"}) + "\n" + json.dumps(row) + "\n")
    args = ["eval", str(tmp_path / "o"), "--model", str(tiny_model_dir), "--dataset", str(data)]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert f"row 1 has no text in column 'text' ({what})" in err.strip().splitlines()[-1]


def test_notes_go_through_logging_and_quiet_keeps_results(
    tmp_path, texts_jsonl, tiny_model_dir, capsys, caplog
):
    args = ["eval", str(tmp_path / "a"), "--model", str(tiny_model_dir), "--dataset", str(texts_jsonl)]
    with caplog.at_level(logging.INFO, logger="assay"):
        assert main(args) == 0
    assert any(r.name == "assay" and r.getMessage().startswith("precision:") for r in caplog.records)
    loud = capsys.readouterr()
    assert "precision:" in loud.err and "nats/token" in loud.out
    args[1] = str(tmp_path / "b")
    assert main([*args, "--quiet"]) == 0
    quiet = capsys.readouterr()
    assert "precision:" not in quiet.err and "nats/token" in quiet.out
    assert "%|" not in quiet.err  # no progress bars either
    console.install_cli_handler()  # back to the default for the tests that follow
    console.LOGGER.setLevel(logging.WARNING)  # what a notebook does to quieten assay
    assert console.quiet()
    console.install_cli_handler()
    assert not console.quiet()


def test_smollm2_is_not_downloaded_offline(tmp_path, monkeypatch, capsys):
    from assay.lm import models

    def no_download(*args, **kwargs):
        raise AssertionError(f"tried to download: {args}")

    monkeypatch.setenv("ASSAY_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(models.subprocess, "run", no_download)
    code = main(
        ["eval", str(tmp_path / "o"), "--model", "smollm2-135m", "--dataset", "abc-tunes", "--split", "eval"]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and "HF_HUB_OFFLINE=1" in err[-1] and "prepare_smollm2()" in err[-1]
    assert "SmolLM2-135M-Instruct" in err[-1] and "Q4_1" in err[-1]
