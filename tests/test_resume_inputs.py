"""Resuming is safe: a run resumes only on the inputs it started on (dataset, model, tokenizer),
only with the settings it started with (performance-only ones may change; any other is named),
and a run that failed before doing any work leaves nothing in the way of the corrected command."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

import assay
from assay.attribution import build as build_mod
from assay.cli import main
from assay.training import finetune as ft
from tests.helpers import tiny_llama, write_word_texts


def _build_args(out, model_dir, data, *extra):
    args = ["build", str(out), "--model", str(model_dir), "--dataset", str(data), "--precision", "fp32"]
    return [*args, "--projection_dim", "4", "--token_batch_size", "64", *extra]


def _interrupted_build(monkeypatch, args) -> None:
    """Run `assay build` and stop it (as a kill would) after its second batch."""
    real, calls = build_mod._to_store, {"n": 0}

    def dies_on_third(*a, **kw):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real(*a, **kw)

    monkeypatch.setattr(build_mod, "_to_store", dies_on_third)
    assert main(args) == 130
    monkeypatch.setattr(build_mod, "_to_store", real)


@pytest.fixture
def inputs(tmp_path, tiny_model_dir):
    model_dir = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model_dir)
    return model_dir, write_word_texts(tmp_path / "data.jsonl", 16, 30)


def _last_error(capsys) -> str:
    lines = capsys.readouterr().err.strip().splitlines()
    assert "Traceback" not in "\n".join(lines)
    return lines[-1]


def test_build_resume_refuses_a_changed_dataset(tmp_path, inputs, monkeypatch, capsys):
    model_dir, data = inputs
    args = _build_args(tmp_path / "idx", model_dir, data)
    _interrupted_build(monkeypatch, args)
    original = data.read_text()
    rows = [json.loads(line) for line in original.splitlines()]
    data.write_text(
        "".join(json.dumps({"text": r["text"] + " reel"}) + "\n" for r in rows)
    )  # same rows count
    assert main(args) == 2
    err = _last_error(capsys)
    assert "was started on another dataset" in err and "idx.part" in err
    data.write_text(original)  # the original inputs: the run resumes and finishes
    assert main(args) == 0
    assert main(_build_args(tmp_path / "whole", model_dir, data)) == 0
    np.testing.assert_array_equal(
        np.asarray(assay.open_index(tmp_path / "idx").gradients),
        np.asarray(assay.open_index(tmp_path / "whole").gradients),
    )


def test_build_resume_refuses_changed_weights_or_tokenizer(
    tmp_path, inputs, monkeypatch, capsys, tiny_tokenizer
):
    model_dir, data = inputs
    args = _build_args(tmp_path / "idx", model_dir, data)
    _interrupted_build(monkeypatch, args)
    tiny_llama(3, vocab_size=len(tiny_tokenizer)).save_pretrained(model_dir)  # same architecture
    assert main(args) == 2
    assert "was started on another model" in _last_error(capsys)
    from tests.helpers import make_tokenizer

    tok_dir = tmp_path / "tok"
    make_tokenizer(vocab_size=290).save_pretrained(tok_dir)
    tiny_llama(0, vocab_size=len(tiny_tokenizer)).save_pretrained(model_dir)  # the weights it started on
    assert main([*args, "--tokenizer", str(tok_dir)]) == 2  # another flag: refused by name first
    assert "another --tokenizer" in _last_error(capsys)
    tiny_tokenizer.save_pretrained(model_dir)
    shutil.copy(tok_dir / "tokenizer.json", model_dir / "tokenizer.json")  # same flags, new vocabulary
    assert main(args) == 2
    err = _last_error(capsys)
    assert "another dataset and tokenizer" in err


def test_performance_only_settings_may_change_others_are_named(tmp_path, inputs, monkeypatch, capsys):
    model_dir, data = inputs
    args = _build_args(tmp_path / "idx", model_dir, data, "--threads", "1")
    _interrupted_build(monkeypatch, args)
    other = [a if a != "64" else "128" for a in args]  # --token_batch_size changes the batch plan
    assert main(other) == 2
    err = _last_error(capsys)
    assert "another --token_batch_size (64, now 128)" in err and f"assay replay {tmp_path / 'idx'}" in err
    # --threads decides how many cores compute the same operations, --compile whether fused
    # (and --keep_freed_memory where freed memory goes)
    threads2 = [*(a if a != "1" else "2" for a in args), "--compile", "--keep_freed_memory"]
    assert main(threads2) == 0
    config = json.loads((tmp_path / "idx" / "config.json").read_text())["config"]
    assert config["runtime"]["threads"] == 2 and config["compile"] is True
    assert config["runtime"]["keep_freed_memory"] is True
    assert main(_build_args(tmp_path / "whole", model_dir, data, "--threads", "1")) == 0
    # the same numbers up to fp32 rounding: torch's kernels may split a reduction over the cores
    # differently (measured ~3e-6 relative here), as two uninterrupted runs at 1 and 2 threads differ,
    # and a fused kernel may order a row's sum differently
    resumed = np.asarray(assay.open_index(tmp_path / "idx").gradients)
    whole = np.asarray(assay.open_index(tmp_path / "whole").gradients)
    np.testing.assert_allclose(resumed, whole, rtol=1e-4, atol=1e-6)


def test_replay_resumes_an_interrupted_run(tmp_path, inputs, monkeypatch):
    model_dir, data = inputs
    args = _build_args(tmp_path / "idx", model_dir, data)
    _interrupted_build(monkeypatch, args)
    assert main(["replay", str(tmp_path / "idx.part")]) == 0
    assert (tmp_path / "idx" / "run.json").exists() and not (tmp_path / "idx.part").exists()


@pytest.mark.parametrize("command", ["build", "eval", "finetune"])
def test_a_failed_input_check_leaves_nothing_in_the_way(tmp_path, inputs, command, capsys):
    model_dir, data = inputs
    out = tmp_path / "out"
    args = [command, str(out), "--model", str(model_dir), "--dataset", str(data), "--precision", "fp32"]
    if command == "finetune":
        args += ["--max_steps", "1", "--eval_split", ""]
    assert main([*args, "--text_column", "body"]) == 2
    assert "no column 'body'" in _last_error(capsys)
    assert not (tmp_path / "out.part").exists() and not out.exists()
    assert main([*args, "--max_samples", "4"]) == 0  # the corrected command (other settings) runs


def test_eval_keeps_no_partial_work_so_it_takes_over_its_part(tmp_path, inputs):
    model_dir, data = inputs
    part = tmp_path / "ev.part"
    part.mkdir()
    (part / "config.json").write_text(
        json.dumps({"command": "eval", "config": {"out": "x", "token_batch_size": 1}})
    )
    (part / "losses.jsonl").write_text("{}\n")  # left by an interrupted eval with other settings
    args = [
        "eval",
        str(tmp_path / "ev"),
        "--model",
        str(model_dir),
        "--dataset",
        str(data),
        "--precision",
        "fp32",
    ]
    assert main(args) == 0
    assert len((tmp_path / "ev" / "losses.jsonl").read_text().splitlines()) == 16


def test_finetune_resume_refuses_a_changed_dataset(tmp_path, inputs, monkeypatch, capsys):
    model_dir, data = inputs
    args = ["finetune", str(tmp_path / "ft"), "--model", str(model_dir), "--dataset", str(data)]
    args += [
        "--precision",
        "fp32",
        "--eval_split",
        "",
        "--effective_batch_size",
        "4",
        "--micro_batch_size",
        "4",
    ]
    args += ["--save_every", "1", "--log_every", "1", "--threads", "1"]

    def stop(step: int) -> None:
        if step == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(ft, "_after_step", stop)
    assert main(args) == 130
    monkeypatch.setattr(ft, "_after_step", lambda step: None)
    original = data.read_text()
    data.write_text(original.replace("king", "kong"))
    assert main(args) == 2
    assert "was started on another dataset" in _last_error(capsys)
    data.write_text(original)
    assert main([*args[:-2], "--threads", "2", "--save_every", "2"]) == 0  # both free on resume
    assert "resuming from step 2" in capsys.readouterr().err
