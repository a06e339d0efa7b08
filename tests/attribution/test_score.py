"""`assay score` on assay-tiny with real ABC tunes: self-attribution, a planted near-duplicate, outputs."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from assay.attribution.build import BuildConfig, build_index
from assay.attribution.index import open_index
from assay.attribution.score import ScoreOptions, score_index
from assay.cli import main
from assay.commands.score import ScoreConfig, prepare_queries, run_score
from assay.core.config import DataConfig, ModelConfig, QueryConfig, RuntimeConfig
from assay.lm.data import load_table

MODEL = "assay-tiny"
NUM_TUNES = 120
MAX_LENGTH = 96


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
    build_index(cfg)
    return root, data, texts, query


def test_self_attribution_trackstar(setup):
    """With the training set as queries, each example ranks itself first (>= 95%)."""
    root, _, texts, _ = setup
    index = open_index(root / "index")
    queries = torch.from_numpy(np.array(index.gradients, dtype=np.float32))  # [N, D]: every training row
    top, whitening = score_index(index, queries, ScoreOptions(mode="trackstar", top_k=1))
    assert whitening is not None and whitening.mix == pytest.approx(0.5)  # queries = train: R = R_train
    best = index.ids[top.top_rows[:, 0].numpy()]
    hits = [b == i or texts[b] == texts[i] for i, b in zip(index.ids, best)]  # identical texts tie
    assert np.mean(hits) >= 0.95, np.mean(hits)


def test_query_gradients_equal_index_rows(setup):
    """Queries are computed with exactly the index's settings: a training text as query = its row."""
    root, data, _, _ = setup
    index = open_index(root / "index")
    queries = QueryConfig(query_dataset=str(data), query_max_samples=5)
    _, queries, grads = prepare_queries(ScoreConfig(out="", index=str(index.path), queries=queries), index)
    positions = [index.ids.tolist().index(i) for i in queries.ids]
    rows = np.asarray(index.gradients[positions], dtype=np.float32)
    np.testing.assert_allclose(grads.numpy(), rows, rtol=1e-4, atol=1e-6 * np.abs(rows).max())


def test_the_python_route_of_docs_attribution_md(setup):
    """docs/attribution.md's "From Python" snippet for an index, as written there: the planted
    near-duplicate of the query is its first proponent."""
    import assay
    from assay.attribution.build import setup_from_index
    from assay.attribution.score import query_gradients
    from assay.lm.queries import load_queries

    root, _, _, query = setup
    index = assay.open_index(root / "index")
    gradient_setup = setup_from_index(index)
    queries = load_queries(
        QueryConfig(query_text=(query,)), index.meta["data"]["max_length"], gradient_setup.tokenizer
    )
    grads = query_gradients(gradient_setup, queries.examples, 2048)
    top, _ = assay.score_index(index, grads, assay.ScoreOptions(mode="trackstar", top_k=5))
    assert index.ids[top.top_rows[0].numpy()][0] == NUM_TUNES


def test_planted_near_duplicate_is_top_proponent(setup):
    root, _, _, query = setup
    for mode in ("trackstar", "cosine"):
        out = root / f"planted-{mode}"
        run_score(
            ScoreConfig(
                out=str(out),
                index=str(root / "index"),
                queries=QueryConfig(query_text=(query,)),
                options=ScoreOptions(mode=mode),
            )
        )
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


@pytest.fixture(scope="module")
def three_queries(setup):
    """Three training tunes as queries, their gradients computed once through the query path."""
    root, data, _, _ = setup
    index = open_index(root / "index")
    queries = QueryConfig(query_dataset=str(data), query_max_samples=3)
    return index, prepare_queries(ScoreConfig(out="", index=str(index.path), queries=queries), index)[2]


def test_aggregates_agree_with_per_query_scores(three_queries):
    index, grads = three_queries
    full = {}
    for agg in ("none", "mean", "max"):
        full[agg] = np.zeros((3 if agg == "none" else 1, len(index)), np.float32)
        score_index(index, grads, ScoreOptions(aggregate=agg, mix=0.3), scores_out=full[agg])
    np.testing.assert_allclose(full["mean"][0], full["none"].mean(0), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(full["max"][0], full["none"].max(0), rtol=1e-6)


def test_cached_row_norms_give_the_direct_scores(three_queries):
    """trackstar with few queries uses cached norms + Woodbury; it must equal whitening each row."""
    index, grads = three_queries
    got = {}
    for name, cache in (("direct", False), ("cached", True), ("cached-again", True)):
        got[name] = np.zeros((3, len(index)), np.float32)
        score_index(index, grads, ScoreOptions(cache_norms=cache), scores_out=got[name])
    np.testing.assert_allclose(got["cached"], got["direct"], rtol=1e-4, atol=1e-6)
    np.testing.assert_array_equal(got["cached-again"], got["cached"])


def test_faiss_search_matches_exact_on_the_index(setup):
    pytest.importorskip("faiss")
    root, _, _, query = setup
    found = {}
    for search in ("exact", "faiss"):
        out = root / f"search-{search}"
        options = ScoreOptions(mix=0.0, search=search, faiss_lists=8, faiss_probe=8)
        cfg = ScoreConfig(
            out=str(out), index=str(root / "index"), queries=QueryConfig(query_text=(query,)), options=options
        )
        run_score(cfg)
        found[search] = json.loads((out / "top.jsonl").read_text())
    assert [i for i, _ in found["faiss"]["proponents"]] == [i for i, _ in found["exact"]["proponents"]]
    assert found["faiss"]["proponents"][0][0] == NUM_TUNES  # the planted near-duplicate


def test_fp16_index_screens_with_its_row_norms(tmp_path, monkeypatch):
    """An fp16 index carries each stored row's norm (norms.npy); inner and cosine then screen
    its rows with an fp16 GEMM and give the exact path's top and bottom rows, also for an index
    without norms.npy (built before it existed: the norms are computed once and cached)."""
    import dataclasses

    import assay.attribution.kernel as kernel

    if not kernel.half_gemm_is_exact_enough():
        pytest.skip("no fp16 GEMM with fp32 accumulation on this CPU")
    monkeypatch.setenv("ASSAY_CACHE", str(tmp_path / "cache"))
    cfg = BuildConfig(
        out=str(tmp_path / "index"),
        model=ModelConfig(model=MODEL),
        data=DataConfig(dataset="abc-tunes", max_samples=40, max_length=MAX_LENGTH),
        runtime=RuntimeConfig(precision="fp32"),
        store_dtype="float16",
    )
    build_index(cfg)
    index = open_index(tmp_path / "index")
    stored = np.asarray(index.gradients, dtype=np.float32)
    assert index.row_norms is not None
    np.testing.assert_allclose(index.row_norms, np.linalg.norm(stored, axis=1), rtol=1e-6)
    queries = torch.from_numpy(stored[[0, 7, 19]] + 0.01 * stored[[1, 2, 3]])
    screened = []
    real = kernel.screened_chunk
    monkeypatch.setattr(kernel, "screened_chunk", lambda *a: screened.append(1) or real(*a))
    for source in (index, dataclasses.replace(index, row_norms=None)):
        for mode in ("inner", "cosine"):
            full = np.zeros((3, len(index)), np.float32)
            want, _ = score_index(
                index, queries, ScoreOptions(mode=mode, top_k=4), scores_out=full
            )  # the exact path
            got, _ = score_index(source, queries, ScoreOptions(mode=mode, top_k=4))
            np.testing.assert_array_equal(got.top_rows.numpy(), want.top_rows.numpy())
            np.testing.assert_array_equal(got.bottom_rows.numpy(), want.bottom_rows.numpy())
            np.testing.assert_allclose(got.top_values.numpy(), want.top_values.numpy(), rtol=1e-6)
    assert len(screened) >= 4  # both modes, with norms.npy and with the cached norms
    assert list((tmp_path / "cache" / "row-norms").glob("*.npy"))
