"""Regression test: a small deterministic targeted-selection experiment.

The pool mixes two domains: 10% folk-tune-like lines (the target domain) and 90% prose.
The query and eval sets are held-out target-domain lines. TrackStar selection against the
query must find the target domain and beat a random selection of equal size on the target
eval loss by a margin after retraining, and retraining on the LOWEST TrackStar scores must
do worse than on the highest by the same margin (if the scores carried no signal the two
tails would tie, so the test can fail).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

import assay.selection.coreset as coreset_mod
from assay.core.config import DataConfig, ModelConfig, QueryConfig, RuntimeConfig
from assay.core.errors import AssayError
from assay.selection.coreset import CoresetConfig, Layout, draw_seed, run_experiment
from assay.selection.filter import FilterConfig, read_selection, select
from assay.training.finetune import finetune
from assay.training.recipe import TrainRecipe
from tests.helpers import prose, tune

MARGIN = 0.1  # nats/token TrackStar must beat random by on the target domain


def write(path: Path, texts: list[str], kinds: list[str]) -> str:
    path.write_text("".join(json.dumps({"text": t, "collection": k}) + "\n" for t, k in zip(texts, kinds)))
    return str(path)


@pytest.fixture(scope="module")
def experiment(tmp_path_factory, tiny_model_dir):
    root = tmp_path_factory.mktemp("targeted")
    rng = np.random.default_rng(0)
    kinds = ["tune"] * 12 + ["prose"] * 108
    kinds = [kinds[i] for i in rng.permutation(len(kinds))]
    pool = write(root / "pool.jsonl", [tune(rng) if k == "tune" else prose(rng) for k in kinds], kinds)
    query = write(root / "query.jsonl", [tune(rng) for _ in range(8)], ["tune"] * 8)
    target = write(root / "eval.jsonl", [tune(rng) for _ in range(16)], ["tune"] * 16)
    cfg = CoresetConfig(
        out=str(root / "exp"),
        model=ModelConfig(model=str(tiny_model_dir)),
        data=DataConfig(dataset=pool, max_length=64),
        runtime=RuntimeConfig(precision="fp32", attention="eager", threads=1),
        seeds=(0,),
        random_draws=2,
        strategy_draws=1,
        strategies=("random", "trackstar"),
        index_precisions=("fp32",),
        query="eval",
        query_dataset=query,
        query_split="train",
        eval_dataset=target,
        eval_split="train",
        recipe=TrainRecipe(learning_rate=3e-3, num_epochs=3, effective_batch_size=4, micro_batch_size=4),
        token_batch_size=2048,
    )
    results = run_experiment(cfg)
    return cfg, results, root


def test_trackstar_finds_the_target_domain(experiment):
    cfg, results, root = experiment
    share = results["selection"]["collection_share"]
    assert share["pool"]["tune"] == pytest.approx(0.1)
    assert share["trackstar_fp32"]["tune"] >= 0.75


def test_trackstar_beats_random_and_the_other_tail_does_not(experiment):
    cfg, results, root = experiment
    rows = results["rows"]
    random_loss = rows["random"]["eval_loss"][0]
    trackstar_loss = rows["trackstar_fp32"]["eval_loss"][0]
    assert trackstar_loss < random_loss - MARGIN, (trackstar_loss, random_loss)
    assert rows["trackstar_fp32"]["draws_beaten"] == 1.0
    # the control: the bottom of the same ranking, retrained the same way
    exp = Path(cfg.out)
    lowest = select(
        FilterConfig(
            out=str(root / "lowest"),
            data=cfg.data,
            strategy="trackstar",
            query="eval",
            queries=QueryConfig(query_dataset=cfg.query_dataset, query_split="train"),
            fraction=cfg.fraction,
            lowest=True,
            index=str(exp / "index" / "fp32"),
        )
    )
    assert lowest["num_selected"] == 12
    assert not set(read_selection(root / "lowest")) & set(read_selection(exp / "select" / "trackstar_fp32"))
    retrained = json.loads((exp / "retrain" / "random" / "seed0" / "config.json").read_text())["config"]
    from assay.core.runs import config_from_dict
    from assay.training.finetune import FinetuneConfig

    ft = config_from_dict(FinetuneConfig, retrained)
    ft = replace(ft, out=str(root / "retrain_lowest"), selection=str(root / "lowest"))
    assert finetune(ft)["eval_loss"] > trackstar_loss + MARGIN  # the ranking's direction matters


def test_experiment_outputs_and_resume(experiment, capsys):
    cfg, results, root = experiment
    exp = Path(cfg.out)
    for name in ("results.md", "results.json", "curves.png", "stages.json"):
        assert (exp / name).exists()
    assert "TrackStar fp32" in (exp / "results.md").read_text()
    stages = json.loads((exp / "stages.json").read_text())
    assert {"full/seed0", "index/fp32", "retrain/random/seed0", "retrain/trackstar_fp32/seed0"} <= set(stages)
    assert "retrain/random/seed0_draw1" in stages
    with pytest.raises(AssayError, match="another --fraction"):
        run_experiment(replace(cfg, fraction=0.2))  # a setting the finished runs depend on


def test_random_is_the_mean_of_its_draws(experiment):
    """Each draw is its own random subset, retrained with the seed; the random row and every
    comparison with it use their mean."""
    cfg, results, root = experiment
    exp = Path(cfg.out)
    first, second = (read_selection(exp / "select" / name) for name in ("random_seed0", "random_seed0_draw1"))
    assert len(first) == len(second) == 12 and set(first) != set(second)
    draws = results["rows"]["random"]["draws"]
    for key in ("eval_loss", "pool_loss"):
        assert len(draws[key][0]) == 2 and draws[key][0][0] != draws[key][0][1]
        assert results["rows"]["random"][key][0] == pytest.approx(np.mean(draws[key][0]))
    trackstar = results["rows"]["trackstar_fp32"]
    mean_random = np.mean(draws["eval_loss"][0])
    assert trackstar["eval_vs_random"]["mean"] == pytest.approx(trackstar["eval_loss"][0] - mean_random)
    assert "mean of 2 draw(s) per seed" in (exp / "results.md").read_text()


def test_draw_seeds_are_distinct_and_the_first_is_the_seed():
    seeds = {draw_seed(s, d) for s in range(3) for d in range(10)}
    assert len(seeds) == 30 and draw_seed(5, 0) == 5


def test_a_finished_experiment_is_extended_with_more_strategies(experiment, monkeypatch):
    """More --strategies run only their own stages (no warm-up, no index, no earlier retraining)."""
    cfg, _, _ = experiment
    exp = Path(cfg.out)
    trained: list[str] = []
    real = coreset_mod.finetune
    monkeypatch.setattr(coreset_mod, "finetune", lambda c: trained.append(c.out) or real(c))
    results = run_experiment(replace(cfg, strategies=("random", "trackstar", "typiclust")))
    assert trained == [str(exp / "retrain" / "typiclust" / "seed0")]
    assert {"random", "trackstar_fp32", "typiclust"} <= set(results["rows"])
    assert "TypiClust" in (exp / "results.md").read_text()
    trained.clear()  # and more draws run only the new draws' stages
    more = replace(cfg, strategies=("random", "trackstar", "typiclust"), random_draws=3, strategy_draws=2)
    results = run_experiment(more)
    assert trained == [
        str(exp / "retrain" / name) for name in ("random/seed0_draw2", "typiclust/seed0_draw1")
    ]
    assert len(results["rows"]["random"]["draws"]["eval_loss"][0]) == 3
    typiclust = results["rows"]["typiclust"]
    assert typiclust["eval_loss"][0] == pytest.approx(np.mean(typiclust["draws"]["eval_loss"][0]))
    first, second = (read_selection(exp / "select" / n) for n in ("typiclust_seed0", "typiclust_seed0_draw1"))
    assert set(first) != set(second)  # another k-means seed, other clusters
    assert "TypiClust: the mean of 2 draw(s) per seed" in (exp / "results.md").read_text()


def test_seeded_strategies_are_drawn_per_seed_and_the_others_once(tmp_path):
    """A selection that is itself a random draw gets a folder per seed and draw; a deterministic
    one is made once and retrained with every seed."""
    lay = Layout(tmp_path, DataConfig(dataset="pool.jsonl"), "self", None, "train", {})
    cfg = CoresetConfig(out=str(tmp_path), random_draws=4, strategy_draws=3)
    for row in ("random", "kcenter", "balanced", "typiclust"):
        assert lay.selection(row, 2, 1).name == f"{row}_seed2_draw1"
        assert cfg.draws_of(row) == (4 if row == "random" else 3)
    for row in ("facility", "trackstar_fp32", "gradcos", "loss"):
        assert lay.selection(row, 2, 0) == lay.selection(row, 0, 0) == tmp_path / "select" / row
        assert cfg.draws_of(row) == 1
    with pytest.raises(AssayError, match="--strategy_draws must be at least 1, got 0"):
        CoresetConfig(out=str(tmp_path), strategy_draws=0)
