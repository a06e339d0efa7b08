"""No silent wrong answers from an index: what it claims must be there, damage is refused on open,
the model fingerprint sees any weight change, and non-finite rows never reach the results."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

import assay
from assay.attribution import build as build_mod
from assay.attribution import index as ix
from assay.attribution.build import BuildConfig, build_index, setup_from_index
from assay.attribution.kernel import ArrayRows, RunningTop, plan_queries, score_rows
from assay.attribution.options import ScoreOptions
from assay.attribution.score import score_index, top_records, train_texts
from assay.cli import main
from assay.core.config import DataConfig, ModelConfig, RuntimeConfig
from assay.core.errors import AssayError
from assay.lm.models import model_fingerprint
from tests.helpers import tiny_llama, write_word_texts


@pytest.fixture(scope="module")
def built(tmp_path_factory, tiny_model_dir):
    """An fp32 index with an Adafactor normalizer and TrackStar statistics, and its inputs."""
    root = tmp_path_factory.mktemp("trust")
    model_dir = root / "model"
    shutil.copytree(tiny_model_dir, model_dir)
    data = write_word_texts(root / "train.jsonl", 16, 20)
    cfg = BuildConfig(
        out=str(root / "index"),
        model=ModelConfig(model=str(model_dir)),
        data=DataConfig(dataset=str(data), max_length=32),
        runtime=RuntimeConfig(precision="fp32"),
        projection_dim=4,
        normalizer="adafactor",
        normalizer_samples=8,
        preconditioner="trackstar",
    )
    build_index(cfg)
    return root


@pytest.fixture
def copy(built, tmp_path) -> Path:
    """A private copy of the finished index, free to damage."""
    return Path(shutil.copytree(built / "index", tmp_path / "index"))


@pytest.mark.parametrize("name", [ix.NORMALIZER_FILE, ix.PRECONDITIONER_FILE])
def test_a_file_the_index_claims_is_required(copy, name):
    (copy / name).unlink()
    with pytest.raises(AssayError, match=f"built with {name}, which is missing"):
        assay.open_index(copy)


def test_queries_are_never_taken_without_the_index_normalizer(copy):
    (copy / ix.NORMALIZER_FILE).unlink()
    index = assay.open_index(copy, verify="none")  # even past the file check
    with pytest.raises(AssayError, match="built with the adafactor normalizer but has no normalizer"):
        setup_from_index(index, "cpu")


def test_model_fingerprint_changes_with_any_weight_change(tiny_tokenizer):
    model = tiny_llama(vocab_size=len(tiny_tokenizer))
    before = model_fingerprint(model)
    assert model_fingerprint(tiny_llama(vocab_size=len(tiny_tokenizer))) == before  # same weights, same hash
    weight = model.model.layers[0].mlp.up_proj.weight  # [64, 32]
    with torch.no_grad():
        total = weight.sum(dtype=torch.float64)
        weight.copy_(weight[torch.randperm(weight.shape[0], generator=torch.Generator().manual_seed(0))])
        assert weight.sum(dtype=torch.float64) == total  # what the old sum-based hash saw: unchanged
    permuted = model_fingerprint(model)
    assert permuted != before
    with torch.no_grad():
        bits = weight.view(torch.int32)
        bits[3, 5] ^= 1  # one flipped mantissa bit
    assert model_fingerprint(model) not in (before, permuted)


def test_fingerprint_survives_moving_the_folder_and_old_indexes_still_open(built, tmp_path, caplog):
    from assay.core.precision import PrecisionPolicy
    from assay.lm.models import legacy_fingerprint, load_model

    moved = Path(shutil.copytree(built / "model", tmp_path / "elsewhere"))
    fp32 = PrecisionPolicy.resolve("fp32", "cpu")
    here = load_model(ModelConfig(model=str(built / "model")), fp32)
    assert model_fingerprint(load_model(ModelConfig(model=str(moved)), fp32)) == model_fingerprint(here)
    index = assay.open_index(built / "index")  # an index from before version 2 of the fingerprint
    meta = json.loads(json.dumps(index.meta))
    del meta["model"]["fingerprint_version"]
    meta["model"]["fingerprint"] = legacy_fingerprint(here)
    index.meta = meta
    with caplog.at_level(logging.INFO, logger="assay"):
        setup_from_index(index, "cpu")
    assert "older model fingerprint" in caplog.text


def test_a_model_with_permuted_rows_is_refused(built, tmp_path, tiny_tokenizer):
    model_dir = tmp_path / "model"
    model = tiny_llama(vocab_size=len(tiny_tokenizer))  # the index's weights (seed 0) ...
    with torch.no_grad():
        w = model.model.layers[1].self_attn.q_proj.weight
        w.copy_(w.flip(0))  # ... with the rows of one matrix reversed: same sums, same shapes
    model.save_pretrained(model_dir)
    tiny_tokenizer.save_pretrained(model_dir)
    index = assay.open_index(built / "index")
    meta = json.loads(json.dumps(index.meta))
    meta["config"]["model"]["model"] = str(model_dir)
    index.meta = meta
    with pytest.raises(AssayError, match="is not the one"):
        setup_from_index(index, "cpu")


def test_a_non_finite_gradient_is_refused_at_build_naming_the_example(built, tmp_path, monkeypatch, capsys):
    real = build_mod.iter_gradients
    poisoned: dict[str, int] = {}

    def with_nan(setup, examples, batches, objective=None):
        for k, (positions, grads, values, batch) in enumerate(real(setup, examples, batches, objective)):
            if k == 1:
                grads[-1, 3] = float("nan")
                poisoned["id"] = int(examples.ids[positions[-1]])
            yield positions, grads, values, batch

    monkeypatch.setattr(build_mod, "iter_gradients", with_nan)
    data = str(built / "train.jsonl")
    args = ["build", str(tmp_path / "idx"), "--model", str(built / "model"), "--dataset", data]
    code = main([*args, "--precision", "fp32", "--projection_dim", "4", "--token_batch_size", "256"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and not (tmp_path / "idx").exists()
    assert f"example {poisoned['id']} has a non-finite gradient" in err[-1] and "Traceback" not in err


@pytest.mark.parametrize("mode", ["trackstar", "cosine", "inner"])
def test_a_nan_row_is_ranked_last_with_a_warning_never_written(copy, mode, caplog):
    grads = np.load(copy / ix.GRADIENTS_FILE, mmap_mode="r+")
    grads[2, 7] = np.nan  # a damaged row (past the checksum: opened with verify="none")
    grads.flush()
    del grads
    index = assay.open_index(copy, verify="none")
    queries = torch.from_numpy(np.array(index.gradients[[0, 5]], dtype=np.float32))
    opts = ScoreOptions(mode=mode, top_k=len(index), cache_norms=False)
    with caplog.at_level(logging.WARNING, logger="assay"):
        top, _ = score_index(index, queries, opts)
    assert "ranked last" in caplog.text and f"id {int(index.ids[2])}" in caplog.text
    assert top.non_finite_rows == 1
    records = top_records(index.ids, [0, 5], top, "none")
    for record in records:
        ids = [i for i, _ in record["proponents"]] + [i for i, _ in record["opponents"]]
        assert int(index.ids[2]) not in ids and all(np.isfinite(v) for _, v in record["proponents"])
        if mode != "inner":  # a row is its own best match under a cosine
            assert record["proponents"][0][0] == int(index.ids[0 if record["query"] == 0 else 5])
    json.dumps(records, allow_nan=False)  # standard JSON: what write_jsonl writes


def test_running_top_ranks_non_finite_scores_last():
    scores = torch.tensor([[0.5, float("nan"), 2.0, float("inf"), -1.0]])
    top = RunningTop(1, 5)
    top.update(scores, 0)
    result = top.result()
    assert result.top_rows[0, :3].tolist() == [2, 0, 4] and result.bottom_rows[0, :3].tolist() == [4, 0, 2]
    assert result.non_finite_rows == 2 and result.first_non_finite == 1
    rows = torch.randn(40, 6)
    rows[7] = float("nan")
    plan = plan_queries(rows[:2], "inner", "none")
    out = score_rows(ArrayRows(rows.numpy()), plan, top_k=40, chunk_rows=16)
    assert 7 not in out.top_rows[0, :39].tolist() and out.top_rows[0, 39] == 7


def _rewrite(path: Path, edit) -> None:
    data = bytearray(path.read_bytes())
    edit(data)
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "name, edit, message",
    [
        (ix.GRADIENTS_FILE, lambda d: d.__setitem__(slice(-8, -4), b"\x00\x00\x80\x3f"), "changed since"),
        (ix.NORMS_FILE, lambda d: d.__setitem__(slice(-4, None), b"\x00\x00\x80\x7f"), "changed since"),
        (
            ix.IDS_FILE,
            lambda d: d.__setitem__(slice(-8, None), (99999).to_bytes(8, "little")),
            "changed since",
        ),
        (ix.GRADIENTS_FILE, lambda d: d.__delitem__(slice(-100, None)), "bytes"),
        (ix.IDS_FILE, lambda d: d.clear(), "bytes"),
        (ix.NORMALIZER_FILE, lambda d: d.__delitem__(slice(len(d) // 2, None)), "bytes"),
    ],
)
def test_damage_is_refused_on_open_in_one_line(copy, name, edit, message):
    _rewrite(copy / name, edit)
    with pytest.raises(AssayError, match=message) as e:
        assay.open_index(copy)
    assert "\n" not in str(e.value) and "damaged index" in str(e.value)


def test_damage_past_the_checksums_is_still_one_line(copy):
    """Without checksums (an index from before them, or verify="none"), broken files still give
    one line, never a traceback."""
    (copy / ix.IDS_FILE).write_bytes(b"")
    with pytest.raises(AssayError, match="damaged index"):
        assay.open_index(copy, verify="none")
    shutil.copy(copy / ix.GRADIENTS_FILE, copy / "keep.npy")
    (copy / ix.GRADIENTS_FILE).write_bytes(b"")
    with pytest.raises(AssayError, match="damaged index"):
        assay.open_index(copy, verify="none")
    (copy / "keep.npy").rename(copy / ix.GRADIENTS_FILE)
    (copy / ix.CHECKSUMS_FILE).unlink()
    np.save(copy / ix.IDS_FILE, np.arange(16))  # the ids it had
    _rewrite(copy / ix.NORMALIZER_FILE, lambda d: d.__delitem__(slice(len(d) // 2, None)))
    index = assay.open_index(copy)
    with pytest.raises(AssayError, match="normalizer.safetensors is damaged"):
        setup_from_index(index, "cpu")
    _rewrite(copy / ix.PRECONDITIONER_FILE, lambda d: d.__setitem__(slice(0, 8), b"\xff" * 8))
    with pytest.raises(AssayError, match="preconditioner.safetensors is damaged"):
        index.preconditioner_stats()


def test_large_files_are_checked_on_a_sample_and_fully_on_request(copy, monkeypatch):
    monkeypatch.setattr(ix, "FULL_HASH_BYTES", 1024)  # every file counts as large
    monkeypatch.setattr(ix, "SAMPLE_ENDS", 256)
    monkeypatch.setattr(ix, "SAMPLE_BLOCK", 64)
    monkeypatch.setattr(ix, "SAMPLE_BLOCKS", 4)
    meta = json.loads((copy / ix.META_FILE).read_text())
    ix.write_checksums(copy, meta)
    assay.open_index(copy)
    size = (copy / ix.GRADIENTS_FILE).stat().st_size
    step = (size - 64) // 3
    outside = step + 200  # in no sampled block: the fast check cannot see it, the full one does
    assert 256 + 64 < outside < 2 * step and outside < size - 256
    _rewrite(copy / ix.GRADIENTS_FILE, lambda d: d.__setitem__(outside, d[outside] ^ 1))
    assay.open_index(copy)
    with pytest.raises(AssayError, match="changed since"):
        assay.open_index(copy, verify="full")
    _rewrite(copy / ix.GRADIENTS_FILE, lambda d: d.__setitem__(step + 10, d[step + 10] ^ 1))  # sampled
    with pytest.raises(AssayError, match="changed since"):
        assay.open_index(copy)


def test_ids_outside_the_dataset_are_one_note(built, caplog):
    index = assay.open_index(built / "index")
    with caplog.at_level(logging.INFO, logger="assay"):
        texts = train_texts(index, {0, 3, 99999, 123456})
    assert set(texts) == {0, 3} and all(texts.values())
    notes = [r.getMessage() for r in caplog.records if "not in" in r.getMessage()]
    assert len(notes) == 1 and "2 training ids (first: 99999)" in notes[0]


def test_advice_for_an_index_missing_run_json_works(copy, capsys):
    (copy / "run.json").unlink()
    with pytest.raises(AssayError, match="assay replay .* --overwrite") as e:
        assay.open_index(copy)
    advice = str(e.value).split("`")[1].split()  # ["assay", "replay", PATH, "--overwrite"]
    assert main(advice[1:]) == 0
    assert len(assay.open_index(copy)) == 16
