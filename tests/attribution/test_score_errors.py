"""`assay score` refuses what it cannot score correctly, with one clear line."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from assay.attribution import build as build_mod
from assay.attribution import index as ix
from assay.attribution.build import BuildConfig, build_index, setup_from_index
from assay.attribution.index import check_architecture, open_index
from assay.attribution.options import ScoreOptions
from assay.attribution.projection import Projector
from assay.attribution.score import check_compatible
from assay.cli import main
from assay.commands.score import ScoreConfig, run_score
from assay.core.config import DataConfig, ModelConfig, QueryConfig, RuntimeConfig
from assay.core.errors import AssayError
from tests.helpers import make_tokenizer, tiny_llama


@pytest.fixture(scope="module")
def built(tmp_path_factory, tiny_model_dir):
    root = tmp_path_factory.mktemp("score-errors")
    model_dir = root / "model"
    shutil.copytree(tiny_model_dir, model_dir)
    data = root / "train.jsonl"
    data.write_text(
        "".join(f'{{"text": "X:{i}\\nT:Tune {i}\\nK:G\\nGAB cBA|d2 e{i % 7}"}}\n' for i in range(24))
    )
    cfg = BuildConfig(
        out=str(root / "index"),
        model=ModelConfig(model=str(model_dir)),
        data=DataConfig(dataset=str(data), max_length=32),
        runtime=RuntimeConfig(precision="fp32"),
        preconditioner="trackstar",
    )
    build_index(cfg)
    return root, model_dir, data


def _score_cfg(root, data, **query) -> ScoreConfig:
    queries = QueryConfig(**{"query_dataset": str(data), "query_split": "train", **query})
    return ScoreConfig(out=str(root / "out"), index=str(root / "index"), queries=queries, overwrite=True)


def test_scores_with_the_index_settings(built):
    root, _, data = built
    summary = run_score(_score_cfg(root, data, query_max_samples=3, query_text=("X:9\nK:D\nABc",)))
    assert summary["num_queries"] == 4 and summary["num_rows"] == 24


def test_top_k_above_the_rows_is_said(built, caplog):
    root, _, data = built
    cfg = dataclasses.replace(
        _score_cfg(root, data, query_max_samples=1), options=ScoreOptions(mode="inner", top_k=30)
    )
    with caplog.at_level("INFO", logger="assay"):
        run_score(cfg)
    assert "--top_k 30 is above the index's 24 rows" in caplog.text
    top = [json.loads(line) for line in (root / "out" / "top.jsonl").read_text().splitlines()]
    assert len(top[0]["proponents"]) == len(top[0]["opponents"]) == 24  # every row, on each side
    for bad, message in ((0, "--top_k must be positive, got 0"), (-1, "--top_k must be positive")):
        with pytest.raises(AssayError, match=message):
            ScoreOptions(top_k=bad)
    with pytest.raises(AssayError, match="^--chunk_rows must be >= 0"):
        ScoreOptions(chunk_rows=-1)


def test_tokenizer_and_projection_mismatch_are_refused(built):
    root, _, _ = built
    index = open_index(root / "index")
    setup = setup_from_index(index, "cpu")
    check_compatible(index, setup)  # the index's own settings pass
    other_tok = dataclasses.replace(setup, tokenizer=make_tokenizer(vocab_size=280))
    with pytest.raises(AssayError, match="tokenizer differs"):
        check_compatible(index, other_tok)
    with pytest.raises(AssayError, match="projection p=8"):
        check_compatible(index, dataclasses.replace(setup, projector=Projector(8, 0)))
    fewer = dict(list(setup.modules.items())[:-1])
    with pytest.raises(AssayError, match="modules differ"):
        check_compatible(index, dataclasses.replace(setup, modules=fewer))


def test_empty_queries_are_refused(built, capsys):
    root, _, data = built
    with pytest.raises(AssayError, match="no row whose 'text' is 'nothing'"):
        run_score(_score_cfg(root, data, query_filter_column="text", query_filter_value="nothing"))
    with pytest.raises(AssayError, match="--query_dataset"):
        ScoreConfig(out=str(root / "o"), index=str(root / "index"))
    with pytest.raises(AssayError, match="empty"):
        QueryConfig(query_text=("  ",))
    capsys.readouterr()
    code = main(["score", str(root / "o"), "--index", str(root / "index"), "--query_text", ""])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err == ["assay score: error: a --query_text is empty; give the text to attribute"]


def test_changed_model_is_refused(built, tiny_tokenizer, capsys):
    root, model_dir, data = built
    tiny_llama(1, vocab_size=len(tiny_tokenizer)).save_pretrained(model_dir)  # same architecture, new weights
    with pytest.raises(AssayError, match="is not the one"):
        run_score(_score_cfg(root, data, query_max_samples=2))
    capsys.readouterr()
    code = main(["score", str(root / "o2"), "--index", str(root / "index"), "--query_text", "X:1\nK:G\nABc"])
    err = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert (
        code == 2
        and len(err) == 1
        and err[0].startswith("assay score: error: model")
        and "not the one" in err[0]
    )


@contextlib.contextmanager
def _model_folder_swapped(model_dir: Path, monkeypatch) -> Iterator[Path]:
    """The built model's folder moved aside (yielded) for the test to fill its place, put back
    after; loading the model's weights meanwhile fails the test."""

    def no_load(*_args, **_kwargs):
        raise AssertionError("the model's weights were loaded")

    kept = model_dir.with_name(model_dir.name + "-kept")
    shutil.move(model_dir, kept)
    monkeypatch.setattr(build_mod, "load_model", no_load)
    try:
        yield kept
    finally:
        shutil.rmtree(model_dir, ignore_errors=True)
        shutil.move(kept, model_dir)


def test_a_model_of_another_shape_is_refused_before_its_weights_load(built, tiny_tokenizer, monkeypatch):
    root, model_dir, data = built
    with _model_folder_swapped(model_dir, monkeypatch):
        tiny_llama(1, vocab_size=len(tiny_tokenizer), hidden_size=48).save_pretrained(model_dir)
        tiny_tokenizer.save_pretrained(model_dir)
        with pytest.raises(AssayError, match="its hidden_size is 48, the index's model's 32"):
            run_score(_score_cfg(root, data, query_max_samples=2))


def test_a_changed_tokenizer_is_refused_before_the_weights_load(built, monkeypatch):
    root, model_dir, data = built
    with _model_folder_swapped(model_dir, monkeypatch) as kept:
        shutil.copytree(kept, model_dir)
        make_tokenizer(vocab_size=280).save_pretrained(model_dir)
        with pytest.raises(AssayError, match="the tokenizer differs"):
            run_score(_score_cfg(root, data, query_max_samples=2))


def test_an_index_without_an_architecture_is_checked_by_fingerprint_alone(built, monkeypatch):
    root, model_dir, _ = built
    meta = open_index(root / "index").meta
    old = {**meta, "model": {k: v for k, v in meta["model"].items() if k != "architecture"}}
    with monkeypatch.context() as m:  # whatever the named model's config says, it is not read
        m.setattr(ix, "read_architecture", lambda _source: {"hidden_size": 999})
        check_architecture(old, ModelConfig(model=str(model_dir)), root / "index")
        with pytest.raises(AssayError, match="its hidden_size is 999"):
            check_architecture(meta, ModelConfig(model=str(model_dir)), root / "index")
    check_architecture(meta, ModelConfig(model=str(model_dir)), root / "index")  # the same shape
    check_architecture(meta, ModelConfig(model=str(root / "missing")), root / "index")  # no config


def test_missing_or_unfinished_index(tmp_path):
    with pytest.raises(AssayError, match="no index"):
        q = QueryConfig(query_text=("ABC",))
        run_score(ScoreConfig(out=str(tmp_path / "o"), index=str(tmp_path / "nope"), queries=q))
