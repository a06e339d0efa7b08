"""trust_remote_code only from the command line: a received index or run folder whose JSON turns
it on never runs the code its model folder ships (a marker file proves whether it ran)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from assay.attribution import index as ix
from assay.attribution.build import BuildConfig, build_index
from assay.cli import main
from assay.core.config import DataConfig, ModelConfig, RuntimeConfig
from assay.core.runs import config_from_dict, config_to_dict


def arm(model_dir: Path, marker: Path) -> None:
    """Make `model_dir` a model that ships code: auto_map names a module in the folder that writes
    `marker` when it is imported (and then defines a plain Llama under another model type)."""
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg["model_type"] = "markerllama"
    cfg["auto_map"] = {"AutoConfig": "marker.MarkerConfig", "AutoModelForCausalLM": "marker.MarkerModel"}
    (model_dir / "config.json").write_text(json.dumps(cfg))
    (model_dir / "marker.py").write_text(
        "from pathlib import Path\n"
        f"Path({str(marker)!r}).write_text('ran')\n"
        "from transformers import LlamaConfig, LlamaForCausalLM\n"
        "class MarkerConfig(LlamaConfig):\n    model_type = 'markerllama'\n"
        "class MarkerModel(LlamaForCausalLM):\n    config_class = MarkerConfig\n"
    )


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [line for line in err.strip().splitlines() if ": error" in line]
    assert len(lines) == 1
    return lines[0]


def test_config_from_dict_never_turns_it_on():
    cfg = BuildConfig(out="o", model=ModelConfig(trust_remote_code=True))
    saved = config_to_dict(cfg)
    assert saved["model"]["trust_remote_code"] is True
    assert config_from_dict(BuildConfig, saved).model.trust_remote_code is False
    assert config_from_dict(BuildConfig, saved, trust_remote_code=True).model.trust_remote_code is True


def test_score_on_a_received_index_does_not_run_its_model_code(tmp_path, tiny_model_dir, texts_jsonl, capsys):
    model_dir = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model_dir)
    index = tmp_path / "index"
    build_index(
        BuildConfig(
            out=str(index),
            model=ModelConfig(model=str(model_dir)),
            data=DataConfig(dataset=str(texts_jsonl)),
            runtime=RuntimeConfig(precision="fp32"),
            projection_dim=4,
        )
    )
    # what a received index could say: its saved config turns remote code on, and its model
    # folder now ships code (checksums rewritten to match, as a crafted folder would have them)
    marker = tmp_path / "MARKER"
    arm(model_dir, marker)
    meta = json.loads((index / ix.META_FILE).read_text())
    meta["config"]["model"]["trust_remote_code"] = True
    (index / ix.META_FILE).write_text(json.dumps(meta))
    ix.write_checksums(index, meta)
    code = main(["score", str(tmp_path / "out"), "--index", str(index), "--query_text", "To be, or not"])
    assert code == 2 and not marker.exists()
    assert "--trust_remote_code" in _one_error_line(capsys)


def test_replay_does_not_run_model_code_unless_asked(tmp_path, tiny_model_dir, texts_jsonl, capsys):
    model_dir = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model_dir)
    run = tmp_path / "ev"
    args = ["eval", str(run), "--model", str(model_dir), "--dataset", str(texts_jsonl), "--precision", "fp32"]
    assert main(args) == 0
    saved = json.loads((run / "config.json").read_text())
    saved["config"]["model"]["trust_remote_code"] = True  # a received run folder
    (run / "config.json").write_text(json.dumps(saved))
    marker = tmp_path / "MARKER"
    arm(model_dir, marker)
    capsys.readouterr()
    assert main(["replay", str(run), "--out", str(tmp_path / "again")]) == 2
    assert not marker.exists()
    assert "pass --trust_remote_code" in _one_error_line(capsys)
    # the command line alone may allow it
    assert main(["replay", str(run), "--out", str(tmp_path / "again"), "--trust_remote_code"]) == 0
    assert marker.exists()


@pytest.mark.parametrize("flag", [[], ["--trust_remote_code"]])
def test_eval_asks_for_the_flag_by_name(tmp_path, tiny_model_dir, texts_jsonl, capsys, flag):
    model_dir = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model_dir)
    marker = tmp_path / "MARKER"
    arm(model_dir, marker)
    args = ["eval", str(tmp_path / "ev"), "--model", str(model_dir), "--dataset", str(texts_jsonl)]
    code = main([*args, "--precision", "fp32", *flag])
    assert (code == 0) == bool(flag) and marker.exists() == bool(flag)
    if not flag:
        assert "ships its own code" in _one_error_line(capsys)
