"""`assay validate` on a tiny model: the ground truth is what `assay finetune --selection --ordered`
measures, it resumes subset by subset, and score runs are validated (or refused) against it."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

import assay.counterfactual.methods as methods_mod
import assay.counterfactual.validate as validate_mod
from assay.cli import main
from assay.core.config import DataConfig, ModelConfig, QueryConfig, RuntimeConfig
from assay.core.errors import AssayError
from assay.counterfactual.ground_truth import GroundTruth, job_file
from assay.counterfactual.validate import ValidateConfig, validate
from assay.lm.data import load_examples
from assay.lm.losses import evaluate_losses
from assay.lm.models import load_model, load_tokenizer
from assay.lm.queries import load_queries
from assay.training.finetune import FinetuneConfig, finetune
from assay.training.recipe import TrainRecipe
from tests.helpers import write_word_texts

RECIPE = TrainRecipe(learning_rate=3e-3, num_epochs=2, effective_batch_size=4, micro_batch_size=4)


def _cfg(root: Path, model_dir: Path, **kw) -> ValidateConfig:
    return ValidateConfig(
        out=str(root / "lds"),
        model=ModelConfig(model=str(model_dir)),
        data=DataConfig(dataset=str(root / "pool.jsonl"), max_length=32),
        runtime=RuntimeConfig(precision="fp32", threads=1, attention="eager"),
        recipe=RECIPE,
        queries=QueryConfig(query_dataset=str(root / "query.jsonl"), query_split="train"),
        num_subsets=4,
        token_batch_size=512,
        **kw,
    )


@pytest.fixture(scope="module")
def experiment(tmp_path_factory, tiny_model_dir):
    root = tmp_path_factory.mktemp("validate")
    write_word_texts(root / "pool.jsonl", 16, 10)
    (root / "query.jsonl").write_text(
        "".join(json.dumps({"text": t}) + "\n" for t in ("the folk tune", "my love"))
    )
    cfg = _cfg(root, tiny_model_dir, methods=("inner", "influence"))
    result = validate(cfg)
    return root, cfg, result


def test_ground_truth_is_the_ordered_subset_finetune(experiment, tiny_model_dir):
    """Subset m's outputs = the queries' losses after `finetune --selection S_m --ordered FULL`."""
    root, cfg, _ = experiment
    truth = GroundTruth.load(root / "lds" / "ground_truth")
    assert truth.masks.shape == (4, 16) and truth.outputs.shape == (4, 2)
    assert (truth.masks.sum(1) == 8).all() and truth.full_outputs is not None
    m = 2
    (root / "subset.json").write_text(json.dumps(truth.ids[truth.masks[m]].tolist()))
    ft = FinetuneConfig(
        out=str(root / "check"), model=cfg.model, data=cfg.data, runtime=cfg.runtime, recipe=RECIPE,
        selection=str(root / "subset.json"), ordered=str(root / "lds" / "full"), eval_split="",
        pool_loss=False, save_every=0,
    )  # fmt: skip
    finetune(ft)
    tokenizer = load_tokenizer(cfg.model)
    model = load_model(ModelConfig(model=str(root / "check" / "model")), _fp32())
    queries = load_queries(cfg.queries, 32, tokenizer)
    want = evaluate_losses(model, queries.examples, _fp32(), tokenizer.pad_token_id, 512)
    np.testing.assert_allclose(truth.outputs[m], want, rtol=1e-5)
    _, pool = load_examples(cfg.data, tokenizer)
    assert truth.ids.tolist() == pool.ids.tolist()


def _fp32():
    from assay.core.precision import PrecisionPolicy

    return PrecisionPolicy.resolve("fp32", "cpu")


def test_methods_are_validated_and_the_table_written(experiment):
    root, _, result = experiment
    assert set(result["results"]) == {"inner-fp32", "influence-fp32"}
    for r in result["results"].values():
        assert len(r["per_query"]) == 2 and r["num_subsets"] == 4
    assert (root / "lds" / "lds.md").exists() and (root / "lds" / "lds.png").exists()
    facts = json.loads((root / "lds" / "methods" / "inner-fp32.json").read_text())
    assert facts["peak_gb"] > 0.05 and facts["index_seconds"] > 0  # the process's resident peak meanwhile
    assert "peak GB" in (root / "lds" / "lds.md").read_text()
    assert json.loads((root / "lds" / "run.json").read_text())


def test_a_lost_subset_is_redone_alone_and_gives_the_same_truth(experiment, monkeypatch, tiny_model_dir):
    root, cfg, _ = experiment
    before = GroundTruth.load(root / "lds" / "ground_truth")
    (root / "lds" / "run.json").unlink()  # as if interrupted after the subsets, before the end
    (root / "lds" / "ground_truth" / "ground_truth.json").unlink()
    job_file(root / "lds" / "ground_truth", 1).unlink()
    redone = []
    real = validate_mod.run_subset
    monkeypatch.setattr(
        validate_mod, "run_subset", lambda s, mask, m, f: redone.append(m) or real(s, mask, m, f)
    )
    validate(cfg)
    assert redone == [1]
    after = GroundTruth.load(root / "lds" / "ground_truth")
    np.testing.assert_array_equal(after.outputs, before.outputs)


def test_score_runs_are_checked_against_the_ground_truth(experiment, capsys):
    root, cfg, _ = experiment
    index = root / "lds" / "index" / "raw-fp32"
    good, bare = root / "score-good", root / "score-bare"
    query = ["--query_dataset", str(root / "query.jsonl"), "--query_split", "train"]
    assert main(["score", str(good), "--index", str(index), *query, "--mode", "cosine", "--save_scores"]) == 0
    assert main(["score", str(bare), "--index", str(index), *query, "--mode", "cosine"]) == 0
    assert main(["validate", cfg.out, "--scores", str(good)]) == 0
    result = json.loads((root / "lds" / "lds.json").read_text())["results"]
    assert "score-good" in result and "inner-fp32" in result  # merged with the methods'
    assert main(["validate", cfg.out, "--scores", str(bare)]) == 2
    assert "--save_scores" in capsys.readouterr().err
    other = root / "score-other"
    one = ["--query_text", "a folk tune"]
    assert main(["score", str(other), "--index", str(index), *one, "--save_scores"]) == 0
    assert main(["validate", cfg.out, "--scores", str(other)]) == 2
    assert "other queries" in capsys.readouterr().err


def test_replay_scores_a_finished_finetune_and_refuses_one_that_does_not_replay(experiment, capsys):
    """`assay score --finetune RUN` writes a score run over the run's training examples; validate
    reads it like any other; a run whose data changed since is refused instead of attributed."""
    root, cfg, _ = experiment
    out = root / "replay"
    query = ["--query_dataset", str(root / "query.jsonl"), "--query_split", "train"]
    full = str(root / "lds" / "full")
    assert main(["score", str(out), "--finetune", full, *query, "--save_scores", "--top_k", "3"]) == 0
    scores = np.load(out / "scores.npy")
    assert scores.shape == (2, 16) and np.isfinite(scores).all() and np.abs(scores).sum() > 0
    records = [json.loads(line) for line in (out / "top.jsonl").read_text().splitlines()]
    assert [pid for pid, _ in records[0]["proponents"]] == list(np.argsort(-scores[0])[:3])  # ids = rows here
    assert main(["validate", cfg.out, "--scores", str(out)]) == 0
    assert "replay" in json.loads((root / "lds" / "lds.json").read_text())["results"]
    pool = root / "pool.jsonl"
    saved = pool.read_text()
    pool.write_text(saved.replace("the", "a"))  # same rows, other texts: the run no longer replays
    try:
        assert main(["score", str(root / "replay2"), "--finetune", full, *query]) == 2
        assert "does not reproduce" in capsys.readouterr().err
    finally:
        pool.write_text(saved)


def test_replay_from_step_attributes_only_the_later_steps(experiment, capsys):
    """`--replay_from_step S` (the first S steps held fixed): examples the run visited only before
    S score 0, and a step past the run's end is one clear line."""
    root, cfg, _ = experiment
    query = ["--query_dataset", str(root / "query.jsonl"), "--query_split", "train"]
    full = root / "lds" / "full"
    out = root / "replay-late"
    assert (
        main(["score", str(out), "--finetune", str(full), *query, "--save_scores", "--replay_from_step", "6"])
        == 0
    )
    scores = np.load(out / "scores.npy")
    epochs = json.loads((full / "order.json").read_text())["epochs"]
    late = {int(i) for e, ids in enumerate(epochs) for j, i in enumerate(ids) if e * len(ids) + j >= 6 * 4}
    assert late and (scores[:, sorted(late)] != 0).any() and len(late) < 16  # steps of 4 examples
    early_only = sorted(set(range(16)) - late)
    assert (scores[:, early_only] == 0).all()
    assert json.loads((out / "summary.json").read_text())["replay_from_step"] == 6
    result = validate(replace(cfg, methods=("replay",), replay_from_step=6))  # the same, in validate
    np.testing.assert_allclose(
        np.load(full.parent / "methods" / "replay-from6-fp32.npy"), scores, rtol=1e-4, atol=1e-7
    )
    assert result["results"]["replay-from6-fp32"]["replay_from_step"] == 6
    assert (
        main(
            ["score", str(root / "replay-past"), "--finetune", str(full), *query, "--replay_from_step", "99"]
        )
        == 2
    )
    assert "past the last step" in capsys.readouterr().err


def test_a_finished_validation_is_extended_with_more_methods(experiment, monkeypatch):
    """More --methods reuse the ground truth (no retraining) and join the earlier results."""
    root, cfg, _ = experiment
    monkeypatch.setattr(validate_mod, "run_subset", lambda *a: pytest.fail("retrained a subset"))
    result = validate(replace(cfg, methods=("cosine",)))
    assert {"inner-fp32", "influence-fp32", "cosine-fp32"} <= set(result["results"])


def test_other_projection_or_damping_are_rows_of_their_own(experiment, monkeypatch):
    """Rerun with another --projection_dim (here raw gradients) or --damping: new indexes and rows
    beside the earlier ones, never the earlier scores reused under the same label."""
    root, cfg, _ = experiment
    monkeypatch.setattr(validate_mod, "run_subset", lambda *a: pytest.fail("retrained a subset"))
    before = np.load(root / "lds" / "methods" / "influence-fp32.npy")
    raw = validate(replace(cfg, methods=("influence", "inner"), projection_dim=0))["results"]
    damped = validate(replace(cfg, methods=("influence", "inner"), damping=1.0))["results"]
    assert {"influence-p0-fp32", "inner-p0-fp32", "influence-d1-fp32"} <= set(raw) | set(damped)
    assert "inner-d1-fp32" not in damped  # the inner product has no damping
    assert (root / "lds" / "index" / "raw-p0-fp32").exists()
    assert np.array_equal(np.load(root / "lds" / "methods" / "influence-fp32.npy"), before)
    for other in ("influence-p0-fp32", "influence-d1-fp32"):
        assert not np.allclose(np.load(root / "lds" / "methods" / f"{other}.npy"), before)


def test_replay_in_validate_resumes_batch_by_batch(experiment, monkeypatch):
    """--methods replay differentiates the full run batch of queries by batch; a lost batch is
    redone alone and the rows equal `assay score --finetune`'s."""
    root, cfg, _ = experiment
    monkeypatch.setattr(methods_mod, "REPLAY_QUERY_BATCH", 1)  # 2 queries: 2 batches
    validate(replace(cfg, methods=("replay",)))
    methods = root / "lds" / "methods"
    first = np.load(methods / "replay-fp32.npy")
    (methods / "replay-fp32.npy").unlink()
    (methods / "replay-fp32.parts" / "batch-0001.npy").unlink()
    done = []
    real = methods_mod.metagradient_scores
    monkeypatch.setattr(
        methods_mod, "metagradient_scores", lambda r, q, **kw: done.append(len(q)) or real(r, q, **kw)
    )
    result = validate(replace(cfg, methods=("replay",)))
    assert done == [1]  # only the lost batch
    np.testing.assert_array_equal(np.load(methods / "replay-fp32.npy"), first)
    assert "replay-fp32" in result["results"]
    meta = json.loads((methods / "replay-fp32.json").read_text())
    assert meta["index_seconds"] > 0 and meta["score_seconds"] > 0
    out, query = (
        root / "replay-direct",
        ["--query_dataset", str(root / "query.jsonl"), "--query_split", "train"],
    )
    assert main(["score", str(out), "--finetune", str(root / "lds" / "full"), *query, "--save_scores"]) == 0
    np.testing.assert_allclose(first, np.load(out / "scores.npy"), rtol=1e-4, atol=1e-7)  # ids = rows here


def test_free_settings_left_at_their_defaults_keep_the_saved_ones(experiment):
    """`assay validate OUT --scores RUN` keeps the experiment's methods and precisions (a preset
    would otherwise expand "no --methods" to every method and compute them all again)."""
    _, cfg, _ = experiment
    saved = json.loads((Path(cfg.out) / "config.json").read_text())["config"]
    scores = str(Path(cfg.out).parent / "x.npy")
    np.save(scores, np.zeros((1, 1)))
    again = validate_mod._with_saved_settings(ValidateConfig(out=cfg.out, scores=(scores,)))
    assert list(again.methods) == saved["methods"] and again.methods  # the last run's, not none
    assert list(again.index_precisions) == saved["index_precisions"]
    assert again.scores == (scores,) and again.recipe == cfg.recipe
    with pytest.raises(AssayError, match="no such score run"):  # before any training
        ValidateConfig(out=cfg.out, scores=(scores + ".missing",))


def test_another_recipe_is_refused_by_name(experiment, tiny_model_dir):
    root, cfg, _ = experiment
    (root / "lds" / "run.json").unlink(missing_ok=True)
    changed = replace(cfg, recipe=replace(RECIPE, learning_rate=1e-2))
    with pytest.raises(AssayError, match="--learning_rate"):
        validate(changed)


def test_weight_removal_is_the_replays_counterfactual(experiment, tiny_model_dir):
    """--removal weight: subset m's outputs are the queries' losses under the full run replayed with
    the left-out examples' weights at 0 (what the metagradients differentiate); skip differs."""
    import torch

    from assay.counterfactual.from_run import load_replay

    root, _, _ = experiment
    cfg = replace(_cfg(root, tiny_model_dir), out=str(root / "lds-weight"), removal="weight")
    validate(cfg)
    truth = GroundTruth.load(root / "lds-weight" / "ground_truth")
    skipped = GroundTruth.load(root / "lds" / "ground_truth")
    assert np.array_equal(truth.masks, skipped.masks) and not np.allclose(truth.outputs, skipped.outputs)
    assert (
        json.loads((root / "lds-weight" / "ground_truth" / "ground_truth.json").read_text())["removal"]
        == "weight"
    )
    replayed = load_replay(root / "lds-weight" / "full", device="cpu")
    assert replayed.train.ids.tolist() == truth.ids.tolist()
    tokenizer = load_tokenizer(cfg.model)
    queries = load_queries(cfg.queries, 32, tokenizer)
    for m in (0, 3):
        replayed.replay.forward(torch.as_tensor(truth.masks[m], dtype=torch.float32))
        model = replayed.replay.model.eval()
        want = evaluate_losses(model, queries.examples, _fp32(), tokenizer.pad_token_id, 512)
        np.testing.assert_allclose(truth.outputs[m], want, rtol=1e-4)


def test_the_abc_preset_trains_at_its_learning_rate(tmp_path):
    """--preset_learning_rate replaces the preset's recipe's peak rate and nothing else of it."""
    preset = validate_mod.ABC_RECIPE
    cfg = ValidateConfig(out=str(tmp_path), preset="abc", pool_size=8, query_size=2)
    cfg = replace(cfg, preset_learning_rate=3e-4)
    assert validate_mod.resolve(cfg, tmp_path).recipe == replace(preset, learning_rate=3e-4)
    assert validate_mod.resolve(replace(cfg, preset_learning_rate=1e-3), tmp_path).recipe == preset
    with pytest.raises(AssayError, match="--preset_learning_rate"):
        ValidateConfig(out=str(tmp_path), preset="abc", preset_learning_rate=0.0)


def test_a_run_without_methods_or_scores_says_it_makes_the_ground_truth_only(
    tmp_path, tiny_model_dir, monkeypatch, caplog
):
    write_word_texts(tmp_path / "pool.jsonl", 8, 10)
    (tmp_path / "query.jsonl").write_text(json.dumps({"text": "my love"}) + "\n")

    def stop(*args):
        raise KeyboardInterrupt  # the note comes before the retraining; no need to run it

    monkeypatch.setattr(validate_mod, "ground_truth", stop)
    with caplog.at_level("INFO", logger="assay"), pytest.raises(KeyboardInterrupt):
        validate(_cfg(tmp_path, tiny_model_dir))
    assert "no --methods or --scores: this run makes the ground truth only" in caplog.text
