"""TrainRecipe settings a user plausibly gets wrong from Python: each one line at construction,
never a silently different run (a schedule name that is not one used to train cosine)."""

from __future__ import annotations

import pytest

from assay.core.errors import AssayError
from assay.training.recipe import TrainRecipe


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"schedule": "Linear"}, "--schedule must be one of cosine, linear, constant, got 'Linear'"),
        ({"learning_rate": "1e-4"}, "--learning_rate must be a number, got '1e-4'"),
        ({"learning_rate": float("nan")}, "--learning_rate must be a finite number"),
        ({"num_epochs": 1.5}, "--num_epochs must be an integer"),
        ({"adam_betas": (0.9,)}, "--adam_betas must be two numbers in \\[0, 1\\)"),
        ({"adam_betas": (0.9, 0.99, 0.5)}, "--adam_betas must be two numbers"),
        ({"adam_betas": 0.9}, "--adam_betas must be two numbers"),
        ({"adam_betas": (0.9, 1.0)}, "--adam_betas must be two numbers in \\[0, 1\\)"),
        ({"adam_betas": ("0.9", 0.999)}, "--adam_betas must be two numbers"),
    ],
)
def test_recipe_settings_that_cannot_train_as_meant_are_refused(bad, message):
    with pytest.raises(AssayError, match=message):
        TrainRecipe(**bad)


def test_every_schedule_and_list_betas_are_accepted():
    for schedule in ("cosine", "linear", "constant"):
        assert TrainRecipe(schedule=schedule).schedule == schedule  # type: ignore[arg-type]
    assert TrainRecipe(adam_betas=[0.8, 0.9]).adam_betas == [0.8, 0.9]  # type: ignore[arg-type]
