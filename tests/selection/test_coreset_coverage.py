"""Regression test: coverage beats typicality on a small deterministic coreset case.

The pool holds three kinds of lines in shares 75 / 15 / 10 %; the eval set holds all three
equally. Ranking the pool by its agreement with itself (TrackStar, query = the pool) keeps the
most typical lines, nearly all of the dominant kind; facility location keeps every kind. After
retraining on each 10% selection the coverage one must have the lower eval loss, by a margin,
and the CRAIG weights it carries must be what `assay finetune` trains with.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from assay.attribution.build import BuildConfig, build_index
from assay.core.config import DataConfig, ModelConfig, RuntimeConfig
from assay.selection.filter import FilterConfig, read_selection, select
from assay.training.finetune import FinetuneConfig, finetune
from assay.training.recipe import TrainRecipe
from assay.training.subset import read_weights
from tests.helpers import prose, tune

MARGIN = 0.05  # nats/token facility must beat the typicality ranking by on the mixed eval set


def numbers(rng: np.random.Generator) -> str:
    return " ".join(str(int(x)) for x in rng.integers(0, 999, size=10))


KINDS = {"tune": tune, "prose": prose, "numbers": numbers}


def write(path: Path, kinds: list[str], rng: np.random.Generator) -> str:
    path.write_text("".join(json.dumps({"text": KINDS[k](rng), "collection": k}) + "\n" for k in kinds))
    return str(path)


@pytest.fixture(scope="module")
def pool(tmp_path_factory, tiny_model_dir):
    root = tmp_path_factory.mktemp("coverage")
    rng = np.random.default_rng(3)
    kinds = ["tune"] * 90 + ["prose"] * 18 + ["numbers"] * 12
    kinds = [kinds[i] for i in rng.permutation(len(kinds))]
    data = DataConfig(dataset=write(root / "pool.jsonl", kinds, rng), max_length=64)
    write(root / "eval.jsonl", ["tune", "prose", "numbers"] * 8, rng)
    runtime = RuntimeConfig(precision="fp32", attention="eager", threads=1)
    model = ModelConfig(model=str(tiny_model_dir))
    build_index(BuildConfig(out=str(root / "index"), model=model, data=data, runtime=runtime,
                            preconditioner="trackstar", projection_dim=8))  # fmt: skip
    return root, data, runtime, model, kinds


def _select(pool, strategy: str) -> Path:
    root, data, runtime, model, _ = pool
    out = root / f"select-{strategy}"
    select(FilterConfig(out=str(out), model=model, data=data, runtime=runtime, strategy=strategy,
                        fraction=0.1, index=str(root / "index")))  # fmt: skip
    return out


def _retrain(pool, selection: Path, name: str) -> float:
    root, data, runtime, model, _ = pool
    recipe = TrainRecipe(learning_rate=3e-3, num_epochs=4, effective_batch_size=4, micro_batch_size=4)
    cfg = FinetuneConfig(
        out=str(root / f"retrain-{name}"), model=model, data=data, runtime=runtime, recipe=recipe,
        selection=str(selection), eval_dataset=str(root / "eval.jsonl"), eval_split="train", save_every=0,
        pool_loss=False,
    )  # fmt: skip
    summary = finetune(cfg)
    assert summary["weighted"] == (read_weights(selection) is not None)  # CRAIG's weights are trained with
    return float(summary["eval_loss"])


def test_coverage_keeps_every_kind_and_retrains_better_than_typicality(pool):
    root, _, _, _, kinds = pool
    typical, covering = _select(pool, "trackstar"), _select(pool, "facility")
    share = {name: [kinds[i] for i in read_selection(folder)] for name, folder in
             (("trackstar", typical), ("facility", covering))}  # fmt: skip
    assert set(share["facility"]) == {"tune", "prose", "numbers"}
    assert share["trackstar"].count("tune") >= 10  # of 12: the typicality ranking fills up with tunes
    weights = read_weights(covering)
    assert weights is not None and sum(weights.values()) == pytest.approx(len(kinds))
    assert _retrain(pool, covering, "facility") < _retrain(pool, typical, "trackstar") - MARGIN


def test_kcenter_and_balanced_cover_every_kind(pool):
    _, _, _, _, kinds = pool
    for strategy in ("kcenter", "balanced"):
        picked = {kinds[i] for i in read_selection(_select(pool, strategy))}
        assert picked == {"tune", "prose", "numbers"}, strategy


def test_dedup_keeps_the_top_scores_among_distinct_examples(pool):
    """`assay filter --dedup C`: near-duplicates (gradient cosine >= C to a better-scored kept
    example) are dropped before the top scores are taken."""
    root, data, runtime, model, _ = pool
    common = dict(model=model, data=data, runtime=runtime, strategy="trackstar", fraction=0.1, features="raw")
    select(FilterConfig(out=str(root / "top"), index=str(root / "index"), **common))  # type: ignore[arg-type]
    summary = select(
        FilterConfig(out=str(root / "top-dedup"), index=str(root / "index"), dedup=0.5, **common)
    )  # type: ignore[arg-type]
    top, deduped = read_selection(root / "top"), read_selection(root / "top-dedup")
    assert 12 <= summary["kept_after_dedup"] < 120 and len(deduped) == 12
    scores = dict(
        zip(np.load(root / "top" / "ids.npy").tolist(), np.load(root / "top" / "scores.npy").tolist())
    )
    assert [scores[i] for i in deduped] == sorted((scores[i] for i in deduped), reverse=True)  # best first
    assert set(deduped) != set(top)  # the raw gradients of typical tunes are near-duplicates
