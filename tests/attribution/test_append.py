"""`assay build OUT --append`: an index grown by a second dataset equals a build of the union.

Rows are computed one example per batch (--token_batch_size 1) so that an appended row and the
union build's row of the same example come from the same arithmetic: then they must be equal bit
for bit, and everything derived from them (statistics, scores) equal up to fp32 summation order.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

import assay
from assay.attribution import append as append_mod
from assay.attribution import build as build_mod
from assay.attribution import index as ix
from assay.attribution.score import index_cache_path, train_texts
from assay.cli import main
from assay.core.errors import AssayError
from tests.helpers import interrupt_on, tiny_llama, write_word_texts

FLAGS = ["--precision", "fp32", "--projection_dim", "4", "--token_batch_size", "1"]


def _build(out: Path, model: Path, data: Path, *extra: str) -> int:
    return main(["build", str(out), "--model", str(model), "--dataset", str(data), *FLAGS, *extra])


def _append(out: Path, data: Path, *extra: str) -> int:
    return main(["build", str(out), "--append", "--dataset", str(data), *extra])


def _split(root: Path) -> tuple[Path, Path, Path]:
    """union.jsonl (16 texts) = first.jsonl (its first 10 lines) + more.jsonl (the other 6)."""
    union = write_word_texts(root / "union.jsonl", 16, 24)
    lines = union.read_text().splitlines(keepends=True)
    (root / "first.jsonl").write_text("".join(lines[:10]))
    (root / "more.jsonl").write_text("".join(lines[10:]))
    return union, root / "first.jsonl", root / "more.jsonl"


@pytest.fixture(scope="module", params=[1000, 12], ids=["stats-add", "stats-resample"])
def grown(request, tmp_path_factory, tiny_model_dir):
    """(root, appended index, union index, stamp of the base index's cache key): with --stats_samples
    1000 the saved sums are extended; with 12 the union (16 rows) needs a new sample."""
    root = tmp_path_factory.mktemp(f"append{request.param}")
    union, first, more = _split(root)
    stats = ["--preconditioner", "trackstar", "--stats_samples", str(request.param)]
    assert _build(root / "union", tiny_model_dir, union, *stats) == 0
    assert _build(root / "grown", tiny_model_dir, first, *stats) == 0
    shutil.copytree(root / "grown", root / "base")  # the index before the append
    before = index_cache_path(assay.open_index(root / "grown"), "score-norms", "k", ".npy")
    assert _append(root / "grown", more) == 0
    return root, root / "grown", root / "union", before, request.param


def test_appended_index_equals_a_build_of_the_union(grown):
    root, grown_dir, union_dir, before, samples = grown
    a, u = assay.open_index(grown_dir, verify="full"), assay.open_index(union_dir)
    np.testing.assert_array_equal(np.asarray(a.gradients), np.asarray(u.gradients))
    for name in ("ids", "losses", "token_counts", "row_norms"):
        np.testing.assert_array_equal(getattr(a, name), getattr(u, name))
    hashes = [np.load(d / ix.HASHES_FILE) for d in (grown_dir, union_dir)]
    np.testing.assert_array_equal(*hashes)  # per-example content hashes, extended as rows are
    assert len(np.unique(hashes[0])) == 16
    assert np.load(grown_dir / ix.GRADIENTS_FILE, mmap_mode="r").shape == (16, a.dim)  # header grown too
    (sums_a, count_a), (sums_u, count_u) = a.preconditioner_stats(), u.preconditioner_stats()
    assert count_a == count_u == min(16, samples)
    for name, ref in sums_u.items():
        if samples < 16:  # the union's sample read back in the same order: the same fp32 sums
            np.testing.assert_array_equal(sums_a[name].numpy(), ref.numpy())
        else:  # saved sums + the new rows' sums: another fp32 summation order
            np.testing.assert_allclose(sums_a[name].numpy(), ref.numpy(), rtol=1e-5, atol=1e-6)
    segs = ix.segments(a.meta)
    assert [s["rows"] for s in segs] == [[0, 10], [10, 16]] and segs[1]["id_offset"] == 10
    assert index_cache_path(a, "score-norms", "k", ".npy") != before  # cached per-row numbers are stale
    assert not append_mod.staging_path(grown_dir).exists()


def test_the_rows_digest_is_carried_on_over_the_new_rows_only(grown, tmp_path, monkeypatch):
    """The appended index's recorded digest is the one hashing it whole gives, the append read no
    byte of the old rows to make it, and a changed old row still fails the full check."""
    root, grown_dir, _, _, _ = grown
    meta = json.loads((grown_dir / ix.META_FILE).read_text())
    recorded = json.loads((grown_dir / ix.CHECKSUMS_FILE).read_text())["files"][ix.GRADIENTS_FILE]
    path = grown_dir / ix.GRADIENTS_FILE
    assert recorded[ix.ROWS_DIGEST] == ix.rows_digest(path, meta)  # from scratch: every row
    before = json.loads((root / "base" / ix.CHECKSUMS_FILE).read_text())["files"][ix.GRADIENTS_FILE]
    offset, shape, dtype, _ = ix.read_npy_header(path)
    reads: list[int] = []
    pread = ix.os.pread
    monkeypatch.setattr(ix.os, "pread", lambda fd, n, at: reads.append(at) or pread(fd, n, at))
    assert ix.rows_digest(path, meta, before) == recorded[ix.ROWS_DIGEST]
    monkeypatch.undo()
    assert reads and min(reads) == offset + 10 * shape[1] * dtype.itemsize  # the first new row
    copy = tmp_path / "copy"
    shutil.copytree(grown_dir, copy)
    data = bytearray((copy / ix.GRADIENTS_FILE).read_bytes())
    data[offset + 5] ^= 1  # a byte of the first segment's first row
    (copy / ix.GRADIENTS_FILE).write_bytes(bytes(data))
    with pytest.raises(AssayError, match="changed since"):
        assay.open_index(copy, verify="full")


def test_scores_after_append_equal_scores_of_the_union(grown, tmp_path):
    root, grown_dir, union_dir, _, samples = grown
    if samples != 1000:
        pytest.skip("the resampled statistics are the union's bit for bit (checked above)")
    query = ["--query_text", "the king and a folk tune", "--query_text", "my love of a jig"]
    for name, index in (("a", grown_dir), ("u", union_dir)):
        args = [
            "score",
            str(tmp_path / name),
            "--index",
            str(index),
            *query,
            "--save_scores",
            "--top_k",
            "16",
        ]
        assert main(args) == 0
    sa, su = np.load(tmp_path / "a" / "scores.npy"), np.load(tmp_path / "u" / "scores.npy")
    np.testing.assert_allclose(sa, su, rtol=1e-5, atol=1e-6)
    for ra, ru in zip(*(_records(tmp_path / n) for n in ("a", "u"))):
        assert [i for i, _ in ra["proponents"]] == [i for i, _ in ru["proponents"]]
    texts = json.loads((tmp_path / "a" / "texts.jsonl").read_text().splitlines()[0])
    assert texts["text"]  # texts of both segments are found


def _records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "top.jsonl").read_text().splitlines()]


def test_texts_of_appended_rows_come_from_their_dataset(grown):
    _, grown_dir, union_dir, _, _ = grown
    ids = {2, 11, 15}
    assert train_texts(assay.open_index(grown_dir), ids) == train_texts(assay.open_index(union_dir), ids)


def test_mismatches_are_refused_in_one_line(grown, tmp_path, tiny_tokenizer, capsys):
    root, _, _, _, samples = grown
    if samples != 1000:
        pytest.skip("once is enough")
    base = Path(shutil.copytree(root / "base", tmp_path / "base"))
    other = tmp_path / "other-model"
    tiny_llama(1, vocab_size=len(tiny_tokenizer)).save_pretrained(other)
    tiny_tokenizer.save_pretrained(other)
    cases = [
        (["--model", str(other)], "is not the one"),
        (["--projection_dim", "8"], "--projection_dim 8 differs"),
        (["--precision", "bf16"], "--precision bf16 differs"),
        (["--id_offset", "3"], "already in the index"),
    ]
    for extra, message in cases:
        capsys.readouterr()
        assert _append(base, root / "more.jsonl", *extra) == 2
        err = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
        assert len(err) == 1 and message in err[0], (extra, err)
    assert _append(base, root / "first.jsonl") == 2
    assert "already holds these examples" in capsys.readouterr().err
    lines = (root / "union.jsonl").read_text().splitlines(keepends=True)
    (tmp_path / "overlap.jsonl").write_text("".join(lines[13:] + lines[7:9]))  # 2 held ones, last
    assert _append(base, tmp_path / "overlap.jsonl") == 2
    err = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert len(err) == 1 and "2 of the 5 new examples are already in" in err[0], err
    assert "row ids in the new data: 3, 4)" in err[0]
    assert len(assay.open_index(base)) == 10 and not append_mod.staging_path(base).exists()


def test_a_model_of_another_shape_is_refused_before_its_weights_load(
    grown, tmp_path, tiny_tokenizer, capsys, monkeypatch
):
    root, _, _, _, samples = grown
    if samples != 1000:
        pytest.skip("once is enough")
    base = Path(shutil.copytree(root / "base", tmp_path / "base"))
    other = tmp_path / "deeper"
    tiny_llama(1, vocab_size=len(tiny_tokenizer), num_hidden_layers=3).save_pretrained(other)
    tiny_tokenizer.save_pretrained(other)
    assert assay.open_index(base).meta["model"]["architecture"]["num_hidden_layers"] == 2

    def no_load(*_args, **_kwargs):
        raise AssertionError("the model's weights were loaded")

    monkeypatch.setattr(append_mod, "load_model", no_load)
    assert _append(base, root / "more.jsonl", "--model", str(other)) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert len(err) == 1 and "its num_hidden_layers is 3, the index's model's 2" in err[0], err


def test_curvature_indexes_are_refused(tmp_path, tiny_model_dir, texts_jsonl, capsys):
    assert _build(tmp_path / "k", tiny_model_dir, texts_jsonl, "--preconditioner", "kfac") == 0
    capsys.readouterr()
    assert _append(tmp_path / "k", texts_jsonl, "--id_offset", "100") == 2
    assert "kfac curvature" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("where", ["rows", "commit", "between-renames"])
def test_an_interrupted_append_leaves_the_old_index_and_resumes(grown, tmp_path, monkeypatch, where):
    root, _, union_dir, _, samples = grown
    if samples != 1000:
        pytest.skip("once is enough")
    base = Path(shutil.copytree(root / "base", tmp_path / "base"))
    old_rows = np.asarray(assay.open_index(base).gradients).copy()
    if where == "rows":
        interrupt_on(monkeypatch, build_mod, "_to_store", 3)
    elif where == "commit":
        interrupt_on(monkeypatch, append_mod, "swap", 1)
    else:

        def half_swap(out: Path, nxt: Path) -> None:  # killed after swap's first rename
            out.rename(out.with_name(out.name + ".append.old"))
            raise KeyboardInterrupt

        monkeypatch.setattr(append_mod, "swap", half_swap)
    assert _append(base, root / "more.jsonl") == 130
    monkeypatch.undo()
    if where != "between-renames":
        old = assay.open_index(base, verify="full")  # still the whole old index
        np.testing.assert_array_equal(np.asarray(old.gradients), old_rows)
    assert append_mod.staging_path(base).exists()
    assert _append(base, root / "more.jsonl") == 0
    done = assay.open_index(base, verify="full")
    np.testing.assert_array_equal(
        np.asarray(done.gradients), np.asarray(assay.open_index(union_dir).gradients)
    )
    assert not append_mod.staging_path(base).exists()
    assert not base.with_name(base.name + ".append.old").exists()


def test_appending_to_no_index_says_to_build_it_first(tmp_path, texts_jsonl, monkeypatch, capsys):
    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(append_mod, "load_tokenizer", no_load)
    assert _append(tmp_path / "none", texts_jsonl) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no index at" in err[0] and "without --append" in err[0]
    assert not (tmp_path / "none").exists()
