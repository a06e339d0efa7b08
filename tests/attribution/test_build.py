"""`assay build` end to end: index format, resume equality, invariance, normalizers, statistics."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import assay
from assay.attribution import build as build_mod
from assay.attribution.build import collect, setup_from_index
from assay.cli import main
from assay.core.config import DataConfig
from assay.core.errors import AssayError
from assay.lm.data import load_examples
from tests.helpers import write_word_texts


def _build(out, model_dir, data, *extra) -> int:
    args = ["build", str(out), "--model", str(model_dir), "--dataset", str(data), "--precision", "fp32"]
    return main([*args, "--projection_dim", "4", *extra])


def _rows(path) -> np.ndarray:
    return np.asarray(assay.open_index(path).gradients)


@pytest.fixture
def many_jsonl(tmp_path):
    """24 texts of varied length: enough for several token batches."""
    return write_word_texts(tmp_path / "many.jsonl", 24, 40)


def test_index_format_and_api(tmp_path, tiny_model_dir, texts_jsonl, capsys):
    out = tmp_path / "idx"
    assert _build(out, tiny_model_dir, texts_jsonl, "--preconditioner", "trackstar") == 0
    index = assay.open_index(out)
    n = len(index.ids)
    assert isinstance(index.gradients, np.memmap) and index.gradients.dtype == np.float32
    assert index.gradients.shape == (n, index.meta["dim"]) and n == 6
    assert list(index.ids) == list(range(6)) and index.meta["modules"][0]["shape"] == [4, 4]
    assert sum(s.stop - s.start for s in index.modules.values()) == index.dim == 14 * 16
    assert not any("lm_head" in m for m in index.modules)
    # rows are the collector's gradients of the same examples (an independent re-computation)
    setup = setup_from_index(index, device="cpu")
    _, examples = load_examples(DataConfig(dataset=str(texts_jsonl)), setup.tokenizer)
    again = collect(setup, examples, token_batch_size=64)
    np.testing.assert_allclose(np.asarray(index.gradients), again, rtol=1e-5, atol=1e-6)
    assert np.all(index.token_counts == examples.num_loss_tokens()) and np.all(index.losses > 0)
    assert index.row_norms is not None and index.row_norms.dtype == np.float32
    np.testing.assert_allclose(
        index.row_norms, np.linalg.norm(np.asarray(index.gradients), axis=1), rtol=1e-6
    )
    # preconditioner statistics: fp32 sums of g gᵀ over the (whole, here) sample
    sums, count = index.preconditioner_stats()
    assert count == 6
    for name, cols in index.modules.items():
        x = torch.from_numpy(np.array(index.gradients[:, cols])).double()
        assert sums[name].dtype == torch.float32
        ref = x.T @ x  # fp64 reference
        assert float((sums[name].double() - ref).norm() / ref.norm()) <= 1e-6


def test_refuses_to_overwrite_and_rejects_incomplete(tmp_path, tiny_model_dir, texts_jsonl, capsys):
    out = tmp_path / "idx"
    assert _build(out, tiny_model_dir, texts_jsonl) == 0
    assert _build(out, tiny_model_dir, texts_jsonl) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert _build(out, tiny_model_dir, texts_jsonl, "--overwrite") == 0
    (tmp_path / "never.part").mkdir()
    with pytest.raises(AssayError, match="not finished"):
        assay.open_index(tmp_path / "never")


@pytest.mark.parametrize("torn_file", [False, True])
def test_resume_after_kill_equals_uninterrupted(tmp_path, tiny_model_dir, many_jsonl, monkeypatch, torn_file):
    whole = tmp_path / "whole"
    assert _build(whole, tiny_model_dir, many_jsonl, "--token_batch_size", "64") == 0
    calls = {"n": 0}
    real = build_mod._to_store

    def dies_on_third(*args, **kw):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt  # like a kill between batches
        return real(*args, **kw)

    monkeypatch.setattr(build_mod, "_to_store", dies_on_third)
    cut = tmp_path / "cut"
    assert _build(cut, tiny_model_dir, many_jsonl, "--token_batch_size", "64") == 130
    progress = json.loads((tmp_path / "cut.part" / "progress.json").read_text())
    assert progress["batches_done"] == 2 and progress["num_batches"] > 3
    if torn_file:  # killed while a row file was being created: start the rows afresh
        (tmp_path / "cut.part" / "gradients.npy").write_bytes(b"\x93NUMPY torn")
    monkeypatch.setattr(build_mod, "_to_store", real)
    assert _build(cut, tiny_model_dir, many_jsonl, "--token_batch_size", "64") == 0
    assert json.loads((cut / "run.json").read_text())
    np.testing.assert_array_equal(_rows(cut), _rows(whole))
    np.testing.assert_array_equal(assay.open_index(cut).losses, assay.open_index(whole).losses)
    np.testing.assert_array_equal(assay.open_index(cut).row_norms, assay.open_index(whole).row_norms)


def test_token_batch_size_invariance(tmp_path, tiny_model_dir, many_jsonl):
    assert _build(tmp_path / "a", tiny_model_dir, many_jsonl, "--token_batch_size", "48") == 0
    assert _build(tmp_path / "b", tiny_model_dir, many_jsonl, "--token_batch_size", "1024") == 0
    a, b = _rows(tmp_path / "a"), _rows(tmp_path / "b")
    assert np.linalg.norm(a - b) <= 1e-5 * np.linalg.norm(b)


def test_keep_freed_memory_switches_the_allocator_after_loading_and_keeps_the_rows(
    tmp_path, tiny_model_dir, many_jsonl, monkeypatch
):
    steps: list[str] = []

    def recorded(name, fn):
        def call(*args, **kwargs):
            steps.append(name)
            return fn(*args, **kwargs)

        monkeypatch.setattr(build_mod, name, call)

    for name in ("load_model", "reuse_freed_memory", "write_rows"):
        recorded(name, getattr(build_mod, name))
    assert _build(tmp_path / "returned", tiny_model_dir, many_jsonl) == 0
    assert steps == ["load_model", "write_rows"]  # the default hands freed blocks back
    steps.clear()
    assert _build(tmp_path / "kept", tiny_model_dir, many_jsonl, "--keep_freed_memory") == 0
    # the load's transient copies are freed under the default policy; only the loop keeps memory
    assert steps == ["load_model", "reuse_freed_memory", "write_rows"]
    np.testing.assert_array_equal(_rows(tmp_path / "kept"), _rows(tmp_path / "returned"))


def test_float16_store_and_overflow_is_loud():
    rows = torch.tensor([[1.0, -2.5, 3e-3]])
    assert build_mod._to_store(rows, "float16").dtype == np.float16
    with pytest.raises(AssayError, match="float16"):
        build_mod._to_store(torch.tensor([[7e4, 0.0]]), "float16")


def test_lora_index_holds_only_adapter_modules(tmp_path, tiny_model_dir, texts_jsonl):
    out = tmp_path / "lora"
    assert _build(out, tiny_model_dir, texts_jsonl, "--lora_rank", "2") == 0
    index = assay.open_index(out)
    assert index.modules and all(".lora_A." in m or ".lora_B." in m for m in index.modules)
    assert index.meta["model"]["lora"]["rank"] == 2
    setup = setup_from_index(index, device="cpu")  # the same seeded adapter: fingerprints agree
    assert list(setup.modules) == list(index.modules)


@pytest.mark.parametrize("kind", ["adafactor", "adam"])
def test_estimated_normalizer_is_saved_and_reused(tmp_path, tiny_model_dir, texts_jsonl, kind):
    out = tmp_path / kind
    assert _build(out, tiny_model_dir, texts_jsonl, "--normalizer", kind, "--normalizer_samples", "4") == 0
    index = assay.open_index(out)
    tensors = index.normalizer_tensors()
    assert tensors and all(t.dtype == torch.float32 for t in tensors.values())
    setup = setup_from_index(index, device="cpu")  # queries get the index's normalizer, not a new one
    assert setup.normalizer is not None and setup.normalizer.kind == kind
    _, examples = load_examples(DataConfig(dataset=str(texts_jsonl)), setup.tokenizer)
    again = collect(setup, examples, token_batch_size=64)
    rows = np.asarray(index.gradients)
    assert np.linalg.norm(rows - again) <= 1e-5 * np.linalg.norm(rows)
