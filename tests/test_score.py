"""`assay score` on assay-tiny with real ABC tunes: self-attribution, a planted near-duplicate, outputs."""

from __future__ import annotations

import json

import numpy as np
import pytest

from assay.attribution.build import BuildConfig, run_build
from assay.attribution.score import ScoreConfig, run_score
from assay.cli import main
from assay.core.config import DataConfig, ModelConfig, RuntimeConfig
from assay.core.data import load_table

MODEL = "assay-tiny"
NUM_TUNES = 150
MAX_LENGTH = 128


def near_duplicate(tune: str) -> str:
    """The same tune under another title and reference number: early tokens differ, the body not."""
    lines = tune.splitlines()
    out = [
        ("X: 9999" if ln.startswith("X:") else "T: A Copy Of It" if ln.startswith("T:") else ln)
        for ln in lines
    ]
    assert out != lines
    return "\n".join(out)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("score-tiny")
    train = load_table(DataConfig(dataset="abc-tunes", max_samples=NUM_TUNES))
    query = load_table(
        DataConfig(
            dataset="abc-tunes",
            split="eval",
            filter_column="collection",
            filter_value="oneill",
            max_samples=1,
        )
    )["text"][0]
    texts = list(train["text"]) + [near_duplicate(query)]  # the planted row has id NUM_TUNES
    data = root / "train.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    cfg = BuildConfig(
        out=str(root / "index"),
        model=ModelConfig(model=MODEL),
        data=DataConfig(dataset=str(data), max_length=MAX_LENGTH),
        runtime=RuntimeConfig(precision="fp32"),
        preconditioner="trackstar",
    )
    run_build(cfg)
    return root, data, texts, query


def self_rank_rate(root, data, texts, mode: str) -> float:
    """Fraction of training examples whose top proponent is themselves (or an identical text)."""
    out = root / f"self-{mode}"
    run_score(
        ScoreConfig(out=str(out), index=str(root / "index"), query_dataset=str(data), mode=mode, top_k=1)
    )
    hits = []
    for rec in map(json.loads, (out / "top.jsonl").read_text().splitlines()):
        top_id = rec["proponents"][0][0]
        hits.append(top_id == rec["query"] or texts[top_id] == texts[rec["query"]])
    assert len(hits) == len(texts)
    return float(np.mean(hits))


def test_self_attribution_trackstar(setup):
    root, data, texts, _ = setup
    rate = self_rank_rate(root, data, texts, "trackstar")
    assert rate >= 0.95, rate


def test_planted_near_duplicate_is_top_proponent(setup):
    root, _, _, query = setup
    for mode in ("trackstar", "cosine"):
        out = root / f"planted-{mode}"
        run_score(ScoreConfig(out=str(out), index=str(root / "index"), query_text=(query,), mode=mode))
        rec = json.loads((out / "top.jsonl").read_text())
        assert rec["query"] == "text:0"
        assert rec["proponents"][0][0] == NUM_TUNES, (mode, rec["proponents"][:3])


def test_cli_outputs_and_table(setup, capsys):
    root, data, texts, query = setup
    out = root / "cli"
    args = ["score", str(out), "--index", str(root / "index"), "--query_dataset", str(data)]
    args += [
        "--query_max_samples",
        "3",
        "--query_text",
        query,
        "--top_k",
        "5",
        "--save_scores",
        "--show",
        "2",
    ]
    assert main(args) == 0
    stdout = capsys.readouterr().out
    records = [json.loads(line) for line in (out / "top.jsonl").read_text().splitlines()]
    assert [r["query"] for r in records] == [0, 1, 2, "text:0"]
    for r in records:
        assert len(r["proponents"]) == len(r["opponents"]) == 5
        values = [v for _, v in r["proponents"]]
        assert values == sorted(values, reverse=True) and r["proponents"][0][1] > r["opponents"][0][1]
    scores = np.load(out / "scores.npy", allow_pickle=False)
    assert scores.shape == (4, NUM_TUNES + 1) and scores.dtype == np.float32
    assert np.allclose(scores.max(axis=1), [r["proponents"][0][1] for r in records], rtol=1e-6)
    queries = [json.loads(line) for line in (out / "queries.jsonl").read_text().splitlines()]
    assert queries[3] == {"query": "text:0", "text": query}
    assert "query text:0:" in stdout and "A Copy Of It" in stdout  # the planted tune's text is shown
    summary = json.loads((out / "summary.json").read_text())
    assert 0.0 < summary["mix"] < 1.0 and summary["num_rows"] == NUM_TUNES + 1


def test_aggregates_agree_with_per_query_scores(setup):
    root, data, _, _ = setup
    full = {}
    for agg in ("none", "mean", "max"):
        out = root / f"agg-{agg}"
        cfg = ScoreConfig(
            out=str(out), index=str(root / "index"), query_dataset=str(data), query_max_samples=4,
            aggregate=agg, save_scores=True, mix=0.3,
        )  # fmt: skip
        run_score(cfg)
        full[agg] = np.load(out / "scores.npy")
    np.testing.assert_allclose(full["mean"][0], full["none"].mean(0), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(full["max"][0], full["none"].max(0), rtol=1e-6)
