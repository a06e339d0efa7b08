"""The counterfactual pillar's Python entry points given what a user plausibly passes by mistake:
each refused in one line before any work, or simply accepted (0/1 masks, str paths, tensors
that require grad), never a silently wrong result or a ground truth overwritten."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from assay.core.errors import AssayError
from assay.counterfactual.ground_truth import GroundTruth, retrain_subsets
from assay.counterfactual.lds import linear_datamodel_score, sample_subsets

X = np.arange(10) * 10.0  # a pool of 10 examples; "training" on a subset sums its values


def _sum_of_subset(mask: np.ndarray) -> np.ndarray:
    return np.array([X[mask].sum(), 1.0])  # [Q=2]


def test_0_1_integer_masks_reach_the_function_as_bool():
    masks = sample_subsets(10, 4, 0.5, 0)
    got = retrain_subsets(_sum_of_subset, masks.astype(np.int64))  # as saved and loaded as 0/1
    np.testing.assert_array_equal(got[:, 0], (masks * X).sum(axis=1))
    np.testing.assert_array_equal(got, retrain_subsets(_sum_of_subset, torch.tensor(masks)))


@pytest.mark.parametrize(
    "masks, message",
    [
        (np.ones(10, bool), "2-D.*a single subset is masks\\[None\\]"),
        (np.zeros((0, 10), bool), "no subsets"),
        (np.full((3, 10), 2), "boolean \\(or 0/1\\)"),
    ],
)
def test_masks_that_are_not_subsets_are_one_line(masks, message):
    calls = []
    with pytest.raises(AssayError, match=message):
        retrain_subsets(lambda mask: calls.append(mask) or np.ones(2), masks)
    assert calls == []  # refused before any retraining


@pytest.mark.parametrize(
    "returned, message",
    [
        (lambda m: None, "returned None for subset 0"),
        (
            lambda m: np.array([np.nan, 1.0]) if m[0] else np.ones(2),
            "NaN/inf outputs for subset \\d.*diverge",
        ),
        (lambda m: ["a", "b"], "returned list for subset 0, not \\[Q\\] numbers"),
        (lambda m: np.ones(1 + int(m[0])), "outputs for subset \\d but \\d for subset 0"),
    ],
)
def test_what_the_function_returns_is_checked_per_subset(returned, message):
    masks = np.array([[True, False] * 5, [False, True] * 5, [True, True] + [False] * 8])
    with pytest.raises(AssayError, match=message):
        retrain_subsets(returned, masks)


def test_an_output_tensor_that_requires_grad_is_detached():
    masks = sample_subsets(10, 3, 0.5, 0)
    got = retrain_subsets(lambda m: torch.ones(2, requires_grad=True) * float(m.sum()), masks)
    np.testing.assert_array_equal(got, np.full((3, 2), 5.0))


def test_lds_takes_tensors_that_require_grad():
    rng = np.random.default_rng(0)
    masks = sample_subsets(10, 8, 0.5, 0)
    scores = rng.normal(size=(3, 10))
    outputs = -(masks @ scores.T) + 0.1 * rng.normal(size=(8, 3))
    want = linear_datamodel_score(scores, masks, outputs).mean
    got = linear_datamodel_score(torch.tensor(scores, requires_grad=True), masks, outputs).mean
    assert got == want


def _truth(**changes) -> GroundTruth:
    fields = dict(
        masks=sample_subsets(10, 4, 0.5, 0),
        outputs=np.arange(8.0).reshape(4, 2),
        ids=np.arange(10),
        query_ids=[np.int64(0), 1],
        query_texts=["a", "b"],
        full_outputs=np.array([0.5, 1.5]),
    )
    return GroundTruth(**{**fields, **changes})


def test_a_ground_truth_saves_and_loads_from_str_paths(tmp_path):
    _truth().save(str(tmp_path / "gt"))
    back = GroundTruth.load(str(tmp_path / "gt"))
    np.testing.assert_array_equal(back.outputs, _truth().outputs)
    assert back.query_ids == [0, 1]  # numpy ints saved as numbers, not as "0"


def test_a_ground_truth_is_not_overwritten_unless_asked(tmp_path):
    folder = tmp_path / "gt"
    folder.mkdir()
    (folder / "masks.npy").write_text("mine")
    with pytest.raises(AssayError, match="already holds masks.npy; pass overwrite=True"):
        _truth().save(folder)
    assert (folder / "masks.npy").read_text() == "mine"
    _truth().save(folder, overwrite=True)
    with pytest.raises(AssayError, match="already holds"):
        _truth(outputs=np.zeros((4, 2))).save(folder)
    _truth(outputs=np.zeros((4, 2))).save(folder, overwrite=True)
    assert not GroundTruth.load(folder).outputs.any()


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"outputs": np.ones((3, 2))}, "3 outputs' rows for 4 masks' rows"),
        ({"ids": np.arange(7)}, "7 ids for 10 masks' columns"),
        ({"query_ids": [0]}, "1 query_ids for 2 outputs' columns"),
        ({"query_texts": ["a", "b", "c"]}, "3 query_texts for 2"),
        ({"full_outputs": np.ones(3)}, "3 full_outputs for 2"),
        ({"outputs": np.ones(4)}, "outputs \\[subsets, queries\\]"),
    ],
)
def test_a_ground_truth_whose_sizes_disagree_is_not_saved(tmp_path, changes, message):
    with pytest.raises(AssayError, match=message):
        _truth(**changes).save(tmp_path / "gt")
    assert not (tmp_path / "gt").exists()


def test_an_incomplete_ground_truth_folder_is_one_line(tmp_path):
    (tmp_path / "ground_truth.json").write_text(json.dumps({"query_ids": [0], "query_texts": ["a"]}))
    with pytest.raises(AssayError, match="holds ground_truth.json but no masks.npy"):
        GroundTruth.load(tmp_path)
    _truth().save(tmp_path / "gt")
    (tmp_path / "gt" / "outputs.npy").write_bytes(b"garbage")
    with pytest.raises(AssayError, match="outputs.npy is not a numpy array file"):
        GroundTruth.load(tmp_path / "gt")
    with pytest.raises(AssayError, match="must be a path"):
        GroundTruth.load(None)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"n": 10.0}, "n .* must be an integer >= 2, got 10.0"),
        ({"num_subsets": 2.5}, "number of subsets must be an integer >= 1"),
        ({"seed": None}, "subset seed must be a non-negative integer, got None"),
        ({"seed": -1}, "subset seed must be a non-negative integer"),
        ({"alpha": "0.5"}, "alpha must be a number strictly between 0 and 1, got '0.5'"),
        ({"alpha": True}, "alpha must be a number strictly between 0 and 1"),
    ],
)
def test_sample_subsets_takes_counts_as_integers(kwargs, message):
    args = {"n": 10, "num_subsets": 4, "alpha": 0.5, "seed": 0, **kwargs}
    with pytest.raises(AssayError, match=message):
        sample_subsets(**args)


def test_lds_refuses_scores_that_are_not_numbers_and_bootstrap_settings_of_the_wrong_type():
    masks = sample_subsets(6, 5, 0.5, 0)
    outputs, scores = np.random.default_rng(0).normal(size=(5, 2)), np.ones((2, 6))
    with pytest.raises(AssayError, match="scores must hold numbers"):
        linear_datamodel_score([["a"] * 6] * 2, masks, outputs)
    with pytest.raises(AssayError, match="scores must be a rectangular array"):
        linear_datamodel_score([[1.0] * 6, [1.0] * 5], masks, outputs)
    for kwargs, message in (
        ({"num_resamples": 2.5}, "num_resamples must be an integer >= 1"),
        ({"seed": -1}, "seed must be a non-negative integer"),
        ({"confidence": 1.5}, "confidence must be a number strictly between 0 and 1"),
    ):
        with pytest.raises(AssayError, match=message):
            linear_datamodel_score(scores, masks, outputs, **kwargs)
