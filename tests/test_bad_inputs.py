"""Mistakes a user makes, each refused in one line before any work, and never at the cost of
their files: an output that is or holds an input, a path that is not assay's to replace, a
malformed selection, settings that cannot train, a device that does not exist."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

import numpy as np
import pytest
import torch

import assay
from assay.attribution import score as score_module
from assay.attribution.api import Gradients
from assay.attribution.index import GradientIndex
from assay.cli import main
from assay.core.config import DataConfig
from assay.core.errors import AssayError
from assay.core.runs import RunFolder, run_folder, write_json
from assay.lm.models import resolve_device
from assay.sae import saelens_format
from assay.sae.config import SaeArchConfig, SaeEvalConfig, SaeTrainConfig
from assay.sae.evaluate import metrics_path
from assay.selection.coreset import CoresetConfig
from assay.training.subset import read_ids, read_weights
from tests.helpers import make_sae


@dataclass
class _Cfg:
    out: str
    model: str = "gpt2"
    index: str = ""
    overwrite: bool = False


def _finished(out, cfg):
    with run_folder(out, "test", cfg) as run:
        (run.path / "model").mkdir()
        (run.path / "model" / "weights.bin").write_text("w")


def test_an_output_holding_an_input_is_refused_even_with_overwrite(tmp_path):
    out = tmp_path / "run"
    _finished(out, _Cfg(out=str(out)))
    for cfg in (_Cfg(out=str(out), model=str(out / "model")), _Cfg(out=str(out), index=str(out))):
        with pytest.raises(AssayError, match="an input of this run.*choose another output folder"):
            RunFolder(out, "test", cfg, overwrite=True).open()
    assert (out / "model" / "weights.bin").read_text() == "w"  # untouched
    with run_folder(out, "test", _Cfg(out=str(out), model=str(tmp_path / "other")), overwrite=True):
        pass  # an input elsewhere: --overwrite replaces the finished run as before
    assert not (out / "model").exists()


@pytest.mark.parametrize("kind", ["folder", "file"])
def test_overwrite_replaces_only_assay_runs(tmp_path, kind):
    out = tmp_path / "mine"
    if kind == "folder":
        out.mkdir()
        (out / "notes.txt").write_text("keep")
    else:
        out.write_text("keep")
    with pytest.raises(AssayError, match="is not an assay run; assay replaces only its own runs"):
        RunFolder(out, "test", _Cfg(out=str(out)), overwrite=True).open()
    assert (out / "notes.txt" if kind == "folder" else out).read_text() == "keep"
    assert not (tmp_path / "mine.part").exists()


def test_sae_eval_replaces_only_an_earlier_evaluation(tmp_path):
    sae = tmp_path / "sae"
    sae.mkdir()
    weights = sae / "sae_weights.safetensors"
    weights.write_bytes(b"\x00weights")
    for overwrite in (False, True):
        with pytest.raises(AssayError, match="not the metrics of an earlier `assay sae eval`"):
            metrics_path(SaeEvalConfig(sae_dir=str(sae), out=str(weights), overwrite=overwrite))
    with pytest.raises(AssayError, match="is a folder"):
        metrics_path(SaeEvalConfig(sae_dir=str(sae), out=str(tmp_path)))
    write_json(sae / "eval.json", {"sae": str(sae), "fvu": 0.1})
    with pytest.raises(AssayError, match="--overwrite"):
        metrics_path(SaeEvalConfig(sae_dir=str(sae)))
    assert metrics_path(SaeEvalConfig(sae_dir=str(sae), overwrite=True)) == sae / "eval.json"
    assert weights.read_bytes() == b"\x00weights"


def test_writing_results_over_a_folder_is_one_line_and_leaves_no_temporary(tmp_path):
    with pytest.raises(AssayError, match="is a folder"):
        write_json(tmp_path, {"a": 1})
    assert not list(tmp_path.parent.glob(f"{tmp_path.name}.*.tmp"))


@pytest.mark.parametrize(
    "name, text",
    [
        ("s.jsonl", '{"id": 1}\n{"text": "no id"}\n'),
        ("s.jsonl", '{"id": 1}\nnot json\n'),
        ("s.jsonl", '{"id": "a"}\n'),
        ("s.jsonl", '{"id": 1.5}\n'),
        ("s.txt", "1\nx\n"),
        ("s.json", '{"rows": [1, 2]}'),
        ("s.json", "[true, 2]"),
    ],
)
def test_a_malformed_selection_is_one_line(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(AssayError) as e:
        read_ids(path)
    assert str(path) in str(e.value) and "\n" not in str(e.value)


def test_selections_read_their_ids_and_weights(tmp_path):
    (tmp_path / "a.txt").write_text("3\n1\n 2\n")
    assert read_ids(tmp_path / "a.txt").tolist() == [3, 1, 2]
    np.save(tmp_path / "b.npy", np.array([4.0, 5.0]))
    assert read_ids(tmp_path / "b.npy").tolist() == [4, 5]
    path = tmp_path / "selection.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [{"id": 7, "weight": 2}, {"id": 8, "weight": 0.5}]))
    assert read_ids(path).tolist() == [7, 8] and read_weights(path) == {7: 2.0, 8: 0.5}
    path.write_text('{"id": 7, "weight": 2}\n{"id": 8}\n')
    with pytest.raises(AssayError, match='example 8 has no numeric "weight"'):
        read_weights(path)


def test_coreset_without_held_out_data_is_refused_before_training(tmp_path):
    pool = tmp_path / "pool.jsonl"
    pool.write_text('{"text": "a"}\n')
    with pytest.raises(AssayError, match="single file.*--eval_dataset FILE"):
        CoresetConfig(out=str(tmp_path / "c"), data=DataConfig(dataset=str(pool)))
    CoresetConfig(out=str(tmp_path / "c"), data=DataConfig(dataset=str(pool)), eval_dataset=str(pool))


@pytest.mark.parametrize(
    "bad",
    [
        {"learning_rate": -1.0},
        {"metrics_every": 0},
        {"lm_batch_contexts": 0},
        {"grad_clip": -1.0},
        {"checkpoint_every": -1},
        {"hookpoint": ""},
        {"hookpoint_out": " "},
    ],
)
def test_sae_settings_that_cannot_train_are_refused(bad):
    with pytest.raises(AssayError):
        SaeTrainConfig(out="o", **bad)


def test_k_beyond_the_latents_is_refused_where_k_counts():
    with pytest.raises(AssayError, match="--k 100 exceeds the SAE's 64 latents"):
        SaeArchConfig(architecture="topk", d_sae=64, k=100)
    with pytest.raises(AssayError, match="--aux_k must be positive"):
        SaeArchConfig(aux_k=-1)
    SaeArchConfig(architecture="relu", d_sae=16)  # relu ignores k (default 32)


@pytest.mark.parametrize("name", ["tpu", "cuda:x", "meta"])
def test_a_device_that_is_not_one_is_one_line(name):
    with pytest.raises(AssayError, match="--device cpu|not a device"):
        resolve_device(name)


@pytest.mark.parametrize(
    "saved, message",
    [
        ([1], "is not a run's config"),
        ({"command": "eval"}, "holds no settings"),
        ({"command": "eval", "config": {"model": {"model": 5}}}, r"--model 5 is not of type str"),
        ({"command": "eval", "config": {"runtime": {"seed": "abc"}}}, r"--seed 'abc' is not of type int"),
    ],
)
def test_a_damaged_config_json_is_one_line_on_replay(tmp_path, capsys, saved, message):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps(saved))
    assert main(["replay", str(run), "--out", str(tmp_path / "new")]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and re.search(message, err), err


def test_data_and_model_options_that_contradict_are_refused():
    from assay.core.config import ModelConfig

    with pytest.raises(AssayError, match="both 'text'"):
        DataConfig(prompt_column="text", completion_column="text")
    with pytest.raises(AssayError, match="give its --lora_rank"):
        ModelConfig(lora_modules=("q_proj",))
    with pytest.raises(AssayError, match="--context_length must be positive"):
        SaeEvalConfig(sae_dir="s", context_length=0)


def test_an_unreadable_optimizer_state_does_not_advise_unsafe_loading(tmp_path):
    from assay.attribution.normalizers import load_optimizer_state

    path = tmp_path / "state.pt"
    path.write_text('{"text": "not a checkpoint"}\n')
    with pytest.raises(AssayError, match="not an optimizer state") as e:
        load_optimizer_state(path, "adam", None, {})  # type: ignore[arg-type]
    assert "weights_only=False" not in str(e.value)


def test_score_refuses_its_output_before_computing_query_gradients(tmp_path, monkeypatch):
    from assay.commands import score as score_command

    out = tmp_path / "scores"
    out.write_text("mine")
    monkeypatch.setattr(score_command, "open_index", lambda path: None)
    monkeypatch.setattr(score_command, "prepare_queries", lambda *a: pytest.fail("gradients computed"))
    args = ["score", str(out), "--index", str(tmp_path / "idx"), "--query_text", "x", "--overwrite"]
    assert main(args) == 2 and out.read_text() == "mine"


# ---- the Python entry points (`import assay`) ------------------------------------------------------
def _one_line(call, match: str) -> None:
    with pytest.raises(AssayError, match=match) as e:
        call()
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "call, given, match",
    [
        ("finetune", {"out": "o"}, r"finetune's config must be an assay.FinetuneConfig\(...\), not a dict"),
        ("build_index", None, r"build_index's config must be an assay.BuildConfig\(...\), not None"),
        ("validate", "o", r"validate's config must be an assay.ValidateConfig\(...\), not a str"),
    ],
)
def test_an_entry_point_given_something_other_than_its_config_is_one_line(tmp_path, call, given, match):
    _one_line(lambda: getattr(assay, call)(given), match)


def _array_index(tmp_path, rows: int = 12, dim: int = 8):
    """A GradientIndex over random in-memory rows: two modules of dim/2 columns, no files."""
    grads = np.random.default_rng(0).standard_normal((rows, dim)).astype(np.float32)
    modules = {"a": slice(0, dim // 2), "b": slice(dim // 2, dim)}
    meta = {"projection_dim": dim // 2, "projection_seed": 0, "model": {"fingerprint": "f"}}
    ids, losses, tokens = np.arange(rows), np.zeros(rows, np.float32), np.ones(rows, np.int64)
    return GradientIndex(tmp_path, grads, modules, ids, losses, tokens, meta)


@pytest.mark.parametrize(
    "mode, queries, scores_out, match",
    [
        ("trackstar", "nan", None, r"query gradient 1 \(0-based\) holds inf/NaN"),
        ("cosine", "inf", None, r"query gradient 1 \(0-based\) holds inf/NaN"),
        ("inner", "ints", None, "must be a float tensor or numpy array"),
        ("inner", "list", None, "not a list"),
        ("inner", "wide", None, r"must be \[Q, 8\] \(or one row \[8\]\), got shape \[2, 9\]"),
        ("inner", "ok", np.zeros((3, 12), np.float32), r"\[A, N\] = \[2, 12\].*not float32 \[3, 12\]"),
        ("inner", "ok", np.zeros((2, 12), np.int64), "not int64 "),
        ("inner", "ok", [[0.0] * 12] * 2, "not list"),
    ],
)
def test_bad_queries_or_scores_out_are_one_line_before_any_work(
    tmp_path, monkeypatch, mode, queries, scores_out, match
):
    index = _array_index(tmp_path)
    q = torch.from_numpy(np.array(index.gradients[:2]))
    given = {
        "ok": q,
        "nan": torch.cat([q[:1], torch.full_like(q[:1], float("nan"))]),
        "inf": torch.cat([q[:1], torch.full_like(q[:1], float("inf"))]),
        "ints": q.long(),
        "list": q.tolist(),
        "wide": torch.zeros(2, 9),
    }[queries]
    monkeypatch.setattr(score_module, "whitening_for", lambda *a: pytest.fail("work began"))
    monkeypatch.setattr(score_module, "score_rows", lambda *a: pytest.fail("work began"))
    _one_line(lambda: assay.score_index(index, given, assay.ScoreOptions(mode=mode), scores_out), match)


def test_a_numpy_or_one_row_query_scores_as_the_tensor_query(tmp_path):
    index = _array_index(tmp_path)
    rows = np.array(index.gradients[:2])
    for mode in ("trackstar", "cosine"):
        options = assay.ScoreOptions(mode=mode, top_k=3)
        want, _ = assay.score_index(index, torch.from_numpy(rows), options)
        from_numpy, _ = assay.score_index(index, rows, options)
        one, _ = assay.score_index(index, torch.from_numpy(rows[1]), options)
        assert torch.equal(from_numpy.top_rows, want.top_rows)
        assert one.top_rows.shape == (1, 3) and one.top_rows[0, 0] == 1  # the row itself comes first


def test_score_refuses_non_finite_gradients_and_foreign_arguments():
    modules = {"a": slice(0, 4), "b": slice(4, 8)}
    train = Gradients(torch.randn(10, 8), modules, 4, 0)
    bad = Gradients(torch.randn(2, 8), modules, 4, 0)
    bad.rows[1, 3] = float("nan")
    _one_line(lambda: assay.score(bad, train), r"query gradient 1 \(0-based\) holds inf/NaN")
    _one_line(lambda: assay.score(train, bad), r"train gradient 1 \(0-based\) holds inf/NaN")
    _one_line(lambda: assay.score(train.rows, train), "queries must be the Gradients of collect_gradients")
    _one_line(lambda: assay.score(train, train, {"mode": "cosine"}), r"options must be an assay.ScoreOptions")


def test_load_factors_and_open_index_refuse_what_they_cannot_read_in_one_line(tmp_path):
    (tmp_path / "text.safetensors").write_text("not safetensors")
    _one_line(lambda: assay.load_factors(tmp_path / "text.safetensors"), "is not a readable assay K-FAC")
    _one_line(lambda: assay.load_factors(tmp_path / "missing.safetensors"), "no K-FAC factors at")
    _one_line(lambda: assay.load_factors(None), "must be a path")
    _one_line(
        lambda: assay.open_index(tmp_path, verify="bogus"), "unknown verify='bogus'.*'fast', 'full', 'none'"
    )
    _one_line(lambda: assay.open_index(None), "open_index's path must be a path")


def _sae_files(folder) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir()}


def test_save_sae_writes_only_new_folders_or_its_own_sae_with_overwrite(tmp_path):
    sae, other = make_sae("relu"), make_sae("relu", seed=1)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    (tmp_path / "file").write_text("keep")
    _one_line(lambda: assay.save_sae(mine, sae, {}), "holds notes.txt that save_sae did not write")
    _one_line(lambda: assay.save_sae(mine, sae, {}, overwrite=True), "choose a new or empty folder")
    _one_line(lambda: assay.save_sae(tmp_path / "file", sae, {}), "is a file")
    assert (mine / "notes.txt").read_text() == "keep" and (tmp_path / "file").read_text() == "keep"
    saved = assay.save_sae(tmp_path / "sae", sae)  # no metadata: fine
    first = _sae_files(saved)
    _one_line(lambda: assay.save_sae(saved, other, {}), "already holds an SAE; pass overwrite=True")
    assert _sae_files(saved) == first
    assay.save_sae(saved, other, {"hook_name": "h"}, overwrite=True)
    loaded, meta = assay.load_sae(saved)
    assert meta["hook_name"] == "h" and bool((loaded.W_enc == other.W_enc).all())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "mine", "sae"]  # no temporaries


def test_save_sae_refuses_bad_arguments_and_a_failed_write_leaves_no_trace(tmp_path, monkeypatch):
    sae = make_sae("relu", d_sae=32)
    _one_line(lambda: assay.save_sae(tmp_path / "a", sae, "meta"), "metadata must be a dict")
    _one_line(
        lambda: assay.save_sae(tmp_path / "a", sae, {}, [0.0]), r"log_densities must be a tensor \[32\]"
    )
    _one_line(lambda: assay.save_sae(None, sae), "must be a path")
    saved = assay.save_sae(tmp_path / "sae", sae, {})
    before = _sae_files(saved)

    def fails(*a, **k):
        raise OSError("disk failed")

    monkeypatch.setattr(saelens_format, "write_json", fails)  # after the weights are written
    for target in (tmp_path / "new", saved):
        with pytest.raises(OSError, match="disk failed"):
            assay.save_sae(target, make_sae("relu", d_sae=32, seed=1), {}, overwrite=True)
    assert _sae_files(saved) == before and sorted(p.name for p in tmp_path.iterdir()) == ["sae"]


def test_build_report_takes_one_folder_as_a_str(tmp_path):
    out = tmp_path / "run"
    _finished(out, _Cfg(out=str(out)))
    page = assay.build_report(str(out), tmp_path / "r.html").read_text()
    assert str(out) in page
    _one_line(lambda: assay.build_report([], tmp_path / "r.html"), "at least one run folder")
