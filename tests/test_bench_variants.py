"""The collector variants the loop benchmark times beside the default (bench/variants.py) do what
their names say inside their block, and nothing after it."""

from __future__ import annotations

import numpy as np

from assay.attribution import collector
from assay.attribution.projection import Projector
from assay.core.precision import PrecisionPolicy
from assay.lm import shared_cast
from bench.variants import own_input_casts
from tests.helpers import collect_all, random_examples, tiny_llama


def _shared_casts_made(on: bool, monkeypatch) -> int:
    """How many layers took the shared cast in one bf16 collection with the variant `on`."""
    made = []
    real = shared_cast._SharedCast.apply
    monkeypatch.setattr(shared_cast._SharedCast, "apply", lambda *a: made.append(1) or real(*a))
    policy = PrecisionPolicy.resolve("bf16", "cpu")
    with own_input_casts(on):
        collect_all(tiny_llama(), random_examples([6, 4], seed=0), np.arange(2), Projector(4, 0), policy)
    return len(made)


def test_own_input_casts_skips_the_shared_cast_and_is_undone_after(monkeypatch):
    assert _shared_casts_made(True, monkeypatch) == 0
    assert "shared_input_casts" in vars(collector)
    assert collector.shared_input_casts is shared_cast.shared_input_casts  # the default is back
    assert _shared_casts_made(False, monkeypatch) > 0
