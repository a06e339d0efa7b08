"""A local file is one split, `train`: another --split is refused (never silently ignored), and
nothing reports the training file's own rows as held out."""

from __future__ import annotations

import json

import pytest

from assay.cli import main
from assay.core.config import DataConfig, ModelConfig, QueryConfig, RuntimeConfig
from assay.core.errors import AssayError
from assay.lm.data import load_table
from assay.training import finetune as ft


def test_a_file_is_one_split(texts_jsonl):
    assert len(load_table(DataConfig(dataset=str(texts_jsonl)))) == 6
    with pytest.raises(AssayError, match="single file, read whole as one split, 'train' \\(not 'eval'\\)"):
        load_table(DataConfig(dataset=str(texts_jsonl), split="eval"))


def test_eval_refuses_a_split_a_file_does_not_have(tmp_path, texts_jsonl, tiny_model_dir, capsys):
    args = ["eval", str(tmp_path / "o"), "--model", str(tiny_model_dir), "--dataset", str(texts_jsonl)]
    assert main([*args, "--split", "no_such_split"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "'no_such_split'" in err[-1] and "a file of their own" in err[-1]
    assert not (tmp_path / "o.part").exists()


def test_queries_from_a_file_are_the_whole_file(texts_jsonl):
    assert QueryConfig(query_dataset=str(texts_jsonl)).data_config(64).split == "train"
    assert QueryConfig(query_dataset="abc-tunes").data_config(64).split == "eval"
    with pytest.raises(AssayError, match="single file"):
        load_table(QueryConfig(query_dataset=str(texts_jsonl), query_split="eval").data_config(64))


def _cfg(data, **kw) -> ft.FinetuneConfig:
    return ft.FinetuneConfig(out="o", data=DataConfig(dataset=str(data)), **kw)


def test_finetune_never_calls_the_training_file_held_out(tmp_path, texts_jsonl):
    held = tmp_path / "held.jsonl"
    held.write_text(json.dumps({"text": "held out"}) + "\n")
    assert ft.eval_data_config(_cfg(texts_jsonl)) is None  # the training rows themselves
    other = ft.eval_data_config(_cfg(texts_jsonl, eval_dataset=str(held)))
    assert other is not None and other.dataset == str(held) and other.split == "train"
    carved = ft.eval_data_config(_cfg(texts_jsonl, eval_filter_column="group", eval_filter_value="g1"))
    assert carved is not None and carved.dataset == str(texts_jsonl) and carved.filter_value == "g1"
    bundled = ft.eval_data_config(ft.FinetuneConfig(out="o", data=DataConfig(dataset="abc-tunes")))
    assert bundled is not None and bundled.split == "eval"
    odd = ft.eval_data_config(_cfg(texts_jsonl, eval_dataset=str(held), eval_split="validation"))
    with pytest.raises(AssayError, match="single file"):
        load_table(odd)


def test_finetune_on_a_file_says_it_has_no_held_out_loss(tmp_path, texts_jsonl, tiny_model_dir, capsys):
    cfg = ft.FinetuneConfig(
        out=str(tmp_path / "ft"),
        model=ModelConfig(model=str(tiny_model_dir)),
        data=DataConfig(dataset=str(texts_jsonl)),
        runtime=RuntimeConfig(precision="fp32"),
        save_every=0,
    )
    from assay.core.console import install_cli_handler

    install_cli_handler()
    summary = ft.finetune(cfg)
    assert summary["eval_loss"] is None
    assert "no held-out loss" in capsys.readouterr().err
