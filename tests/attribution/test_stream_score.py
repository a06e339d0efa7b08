"""`assay score --model M --dataset D` without an index: the same results as build-then-score, no
gradient of the corpus stored, resumable."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from assay.attribution import stream as stream_mod
from assay.cli import main
from tests.helpers import interrupt_on, write_word_texts

N = 24
FLAGS = ["--precision", "fp32", "--projection_dim", "4"]
QUERIES = ["--query_text", "the king and a folk tune", "my love of a jig", "--top_k", str(N)]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, tiny_model_dir):
    """(root, model dir, data, index built with TrackStar statistics over a 10-row sample)."""
    root = tmp_path_factory.mktemp("stream")
    data = write_word_texts(root / "data.jsonl", N, 30)
    args = ["build", str(root / "idx"), "--model", str(tiny_model_dir), "--dataset", str(data), *FLAGS]
    assert main([*args, "--preconditioner", "trackstar", "--stats_samples", "10"]) == 0
    return root, tiny_model_dir, data, root / "idx"


def _stream(out: Path, model: Path, data: Path, *extra: str) -> int:
    args = ["score", str(out), "--model", str(model), "--dataset", str(data), *FLAGS, "--stats_samples", "10"]
    return main([*args, *QUERIES, "--save_scores", *extra])


def _records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "top.jsonl").read_text().splitlines()]


@pytest.mark.parametrize(
    "extra, computed",
    [
        (["--stream_buffer_mib", "0"], N + 10),  # the sample computed twice: once for R_train
        (["--stream_buffer_mib", "1"], N),  # the sample's rows kept and scored after its pass
        (["--mode", "cosine"], N),  # no statistics needed
        (["--mode", "influence", "--aggregate", "mean"], N),
    ],
    ids=["trackstar-unbuffered", "trackstar-buffered", "cosine", "influence-mean"],
)
def test_streamed_scores_equal_build_then_score(corpus, tmp_path, extra, computed):
    root, model, data, index = corpus
    mode = [a for a in extra if a not in ("--stream_buffer_mib", "0", "1")]
    assert (
        main(["score", str(tmp_path / "indexed"), "--index", str(index), *QUERIES, "--save_scores", *mode])
        == 0
    )
    assert _stream(tmp_path / "streamed", model, data, *extra) == 0
    a, b = (np.load(tmp_path / n / "scores.npy") for n in ("indexed", "streamed"))
    assert a.shape == b.shape and a.shape[1] == N
    np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6 * np.abs(a).max())
    for ra, rb in zip(_records(tmp_path / "indexed"), _records(tmp_path / "streamed")):
        assert [i for i, _ in ra["proponents"][:5]] == [i for i, _ in rb["proponents"][:5]]
    texts = {n: (tmp_path / n / "texts.jsonl").read_text().splitlines() for n in ("indexed", "streamed")}
    for ta, tb in zip(*(map(json.loads, texts[n]) for n in ("indexed", "streamed"))):
        assert (
            ta["id"] == tb["id"]
            and ta["text"] == tb["text"]
            and ta["loss"] == pytest.approx(tb["loss"], 1e-5)
        )
    summary = json.loads((tmp_path / "streamed" / "summary.json").read_text())
    assert summary["gradients_computed"] == computed and summary["num_rows"] == N
    dim = json.loads((index / "index.json").read_text())["dim"]
    sizes = {p.name: p.stat().st_size for p in (tmp_path / "streamed").iterdir()}
    sizes.pop("preconditioner.safetensors", None)  # R_train's sums: d² per module, whatever N is
    assert max(sizes.values()) < N * dim * 4 / 4, sizes  # nothing of the corpus's gradients is kept


@pytest.mark.parametrize("where", [("_score", 4), ("_statistics_pass", 1)], ids=["scoring", "statistics"])
def test_an_interrupted_stream_resumes_to_the_same_result(corpus, tmp_path, monkeypatch, where):
    _, model, data, _ = corpus
    small = ["--token_batch_size", "64", "--stream_buffer_mib", "0"]  # several batches, none buffered
    assert _stream(tmp_path / "whole", model, data, *small) == 0
    interrupt_on(monkeypatch, stream_mod, *where)
    assert _stream(tmp_path / "cut", model, data, *small) == 130
    monkeypatch.undo()
    part = tmp_path / "cut.part"
    assert (part / stream_mod.STATE_FILE).exists() == (where[0] == "_score")
    assert _stream(tmp_path / "cut", model, data, *small) == 0
    assert _records(tmp_path / "cut") == _records(tmp_path / "whole")
    np.testing.assert_array_equal(
        np.load(tmp_path / "cut" / "scores.npy"), np.load(tmp_path / "whole" / "scores.npy")
    )
    np.testing.assert_array_equal(
        np.load(tmp_path / "cut" / "losses.npy"), np.load(tmp_path / "whole" / "losses.npy")
    )
    done = json.loads((tmp_path / "cut" / "summary.json").read_text())["gradients_computed"]
    assert done < N if where[0] == "_score" else done == N + 10


def test_stream_flags_are_checked_in_one_line(corpus, tmp_path, capsys):
    _, model, data, index = corpus
    for extra, message in (
        (["--search", "faiss"], "needs an index"),
        (["--index", str(index)], "--index and --model are different sources"),
    ):
        capsys.readouterr()
        assert _stream(tmp_path / "x", model, data, *extra) == 2
        err = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
        assert len(err) == 1 and message in err[0]
    # a corpus flag without --model would be ignored by a score over an index: refused instead
    args = ["score", str(tmp_path / "y"), "--index", str(index), *QUERIES, "--projection_dim", "8"]
    assert main(args) == 2
    assert "--projection_dim describes a corpus" in capsys.readouterr().err
