"""assay filter: each strategy on a case with a known answer, and bad input."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from assay.core.config import DataConfig, ModelConfig, QueryConfig, RuntimeConfig
from assay.core.errors import AssayError
from assay.selection.filter import FilterConfig, read_selection, select, select_top
from assay.training.evaluate import mean_token_loss
from tests.helpers import prose, tune


@pytest.fixture(scope="module")
def pool(tmp_path_factory) -> dict:
    """16 tune-like lines and 4 prose lines (ids 16..19), plus a prose-only query file."""
    root = tmp_path_factory.mktemp("filter")
    rng = np.random.default_rng(1)
    texts = [tune(rng) for _ in range(16)] + [prose(rng) for _ in range(4)]
    (root / "pool.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    (root / "query.jsonl").write_text("".join(json.dumps({"text": prose(rng)}) + "\n" for _ in range(4)))
    return {"root": root, "pool": str(root / "pool.jsonl"), "query": str(root / "query.jsonl")}


def cfg(pool: dict, model_dir: Path, name: str, **kw) -> FilterConfig:
    return FilterConfig(
        out=str(pool["root"] / name),
        model=ModelConfig(model=str(model_dir)),
        data=DataConfig(dataset=pool["pool"], max_length=64),
        runtime=RuntimeConfig(precision="fp32", seed=kw.pop("seed", 0), attention="eager", threads=1),
        **kw,
    )


@pytest.fixture(scope="module")
def index(pool, tiny_model_dir) -> str:
    """TrackStar self-selection builds the pool's index in OUT/index; other tests reuse it."""
    select(cfg(pool, tiny_model_dir, "trackstar_self", strategy="trackstar", num_examples=8))
    return str(pool["root"] / "trackstar_self" / "index")


def test_random_is_seeded_and_uniform(pool, tiny_model_dir):
    select(cfg(pool, tiny_model_dir, "r0", strategy="random", num_examples=5))
    select(cfg(pool, tiny_model_dir, "r0b", strategy="random", num_examples=5))
    select(cfg(pool, tiny_model_dir, "r1", strategy="random", fraction=0.25, seed=1))
    a, b, c = (read_selection(pool["root"] / n) for n in ("r0", "r0b", "r1"))
    assert a.tolist() == b.tolist() and len(c) == 5 and set(a) != set(c)
    assert set(a) <= set(range(20))


def test_loss_keeps_the_highest_and_lowest_losses(pool, tiny_model_dir, index):
    data = DataConfig(dataset=pool["pool"], max_length=64)
    ref = mean_token_loss(ModelConfig(model=str(tiny_model_dir)), data, RuntimeConfig(precision="fp32"))
    per_token = ref["losses"] / ref["tokens"]
    order = ref["ids"][np.argsort(-per_token)]
    select(cfg(pool, tiny_model_dir, "loss_hi", strategy="loss", num_examples=4))
    select(cfg(pool, tiny_model_dir, "loss_lo", strategy="loss", num_examples=4, lowest=True))
    select(cfg(pool, tiny_model_dir, "loss_ix", strategy="loss", num_examples=4, index=index))
    assert read_selection(pool["root"] / "loss_hi").tolist() == order[:4].tolist()
    assert read_selection(pool["root"] / "loss_lo").tolist() == order[::-1][:4].tolist()
    assert read_selection(pool["root"] / "loss_ix").tolist() == order[:4].tolist()  # from the index's losses


@pytest.mark.parametrize("strategy", ["gradcos", "trackstar"])
def test_gradient_strategies_find_the_known_answer(pool, tiny_model_dir, index, strategy):
    # query = prose: the 4 prose lines of the pool (ids 16..19) must rank first
    queries = QueryConfig(query_dataset=pool["query"], query_split="train")
    select(cfg(pool, tiny_model_dir, f"{strategy}_q", strategy=strategy, num_examples=4, index=index,
               query="eval", queries=queries))  # fmt: skip
    assert sorted(read_selection(pool["root"] / f"{strategy}_q")) == [16, 17, 18, 19]
    # query = the pool itself: the most typical examples are tunes (16 of 20), the least are prose
    select(cfg(pool, tiny_model_dir, f"{strategy}_s", strategy=strategy, num_examples=4, index=index))
    select(
        cfg(
            pool,
            tiny_model_dir,
            f"{strategy}_sl",
            strategy=strategy,
            num_examples=4,
            index=index,
            lowest=True,
        )
    )
    assert max(read_selection(pool["root"] / f"{strategy}_s")) < 16
    assert sorted(read_selection(pool["root"] / f"{strategy}_sl")) == [16, 17, 18, 19]
    lines = (pool["root"] / f"{strategy}_s" / "selection.jsonl").read_text().splitlines()
    scores = [json.loads(x)["score"] for x in lines]
    assert scores == sorted(scores, reverse=True)


def test_bad_input(pool, tiny_model_dir):
    with pytest.raises(AssayError, match="more than the 20 examples"):
        select(cfg(pool, tiny_model_dir, "too_many", strategy="random", num_examples=21))
    with pytest.raises(AssayError, match="unknown --strategy"):
        cfg(pool, tiny_model_dir, "bad", strategy="influence", num_examples=2)
    with pytest.raises(AssayError, match="needs the query set"):
        cfg(pool, tiny_model_dir, "noq", strategy="trackstar", num_examples=2, query="eval")
    with pytest.raises(AssayError, match="exactly one"):
        cfg(pool, tiny_model_dir, "both", strategy="random", num_examples=2, fraction=0.5)
    with pytest.raises(AssayError, match="exactly one"):
        cfg(pool, tiny_model_dir, "neither", strategy="random")
    with pytest.raises(AssayError, match="not a gradient index"):
        select(cfg(pool, tiny_model_dir, "noindex", strategy="trackstar", num_examples=2, index=pool["pool"]))


def test_a_pool_other_than_the_index_s_is_refused(pool, tiny_model_dir, index):
    """--index decides the pool: another --dataset beside it would be recorded but never read."""
    other = pool["root"] / "other.jsonl"
    other.write_text('{"text": "x"}\n')
    bad = cfg(pool, tiny_model_dir, "other_pool", strategy="trackstar", num_examples=2, index=index)
    bad.data = DataConfig(dataset=str(other))
    with pytest.raises(AssayError, match="is not what .* was built from"):
        select(bad)
    bad.model = ModelConfig(model=str(pool["root"]))
    bad.data = DataConfig(dataset=pool["pool"])
    with pytest.raises(AssayError, match="--model .* is not what"):
        select(bad)


def test_select_top_breaks_ties_by_id():
    ids, scores = np.array([5, 3, 9, 1]), np.array([1.0, 2.0, 2.0, 0.5])
    assert ids[select_top(ids, scores, 2)].tolist() == [3, 9]
    assert ids[select_top(ids, scores, 2, lowest=True)].tolist() == [1, 5]
