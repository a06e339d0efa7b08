"""The precision policy: which tensors are in which dtype, inside and outside autocast."""

import pytest
import torch
from torch import nn

from assay.core.errors import AssayError
from assay.core.precision import (
    STATS_DTYPE,
    PrecisionPolicy,
    autocast_device_type,
    check_finite,
    full_precision,
)


def test_autocast_device_type_strips_the_index():
    assert autocast_device_type("cuda:1") == "cuda"
    assert autocast_device_type(torch.device("cpu")) == "cpu"


@pytest.mark.parametrize(
    "name, weights, autocast",
    [
        ("fp32", torch.float32, None),
        ("bf16", torch.float32, torch.bfloat16),
        ("fp16", torch.float32, torch.float16),
        ("bf16-pure", torch.bfloat16, None),
    ],
)
def test_policies_name_their_dtypes(name, weights, autocast):
    policy = PrecisionPolicy.resolve(name, "cpu")
    assert policy.weight_dtype == weights
    assert policy.autocast_dtype == autocast
    assert policy.uses_loss_scaling == (name == "fp16")


def test_auto_resolves_with_a_reason(monkeypatch):
    from assay.core import precision

    monkeypatch.setattr(precision, "cpu_has_fast_bf16", lambda: True)
    assert PrecisionPolicy.resolve("auto", "cpu").name == "bf16"
    monkeypatch.setattr(precision, "cpu_has_fast_bf16", lambda: False)
    policy = PrecisionPolicy.resolve("auto", "cpu")
    assert policy.name == "fp32" and "no fast bf16" in policy.describe()


@pytest.mark.parametrize("name", ["bf16", "bf16-pure"])
def test_bf16_without_bf16_units_says_it_is_slow(monkeypatch, name):
    from assay.core import precision

    monkeypatch.setattr(precision, "cpu_has_fast_bf16", lambda: False)
    assert "no bf16 matmul units" in PrecisionPolicy.resolve(name, "cpu").describe()
    monkeypatch.setattr(precision, "cpu_has_fast_bf16", lambda: True)
    assert PrecisionPolicy.resolve(name, "cpu").describe() == f"precision: {name} (asked for)"


def test_experiments_building_a_bf16_index_say_it_is_slow_without_bf16_units(monkeypatch):
    from assay.core import precision

    monkeypatch.setattr(precision, "cpu_has_fast_bf16", lambda: False)
    assert "runs emulated" in (precision.slow_bf16_note(("bf16", "fp32"), "cpu") or "")
    assert precision.slow_bf16_note(("fp32",), "cpu") is None
    assert precision.slow_bf16_note(("bf16",), "cuda") is None  # a GPU's bf16 is its own question
    monkeypatch.setattr(precision, "cpu_has_fast_bf16", lambda: True)
    assert precision.slow_bf16_note(("bf16", "fp32"), "cpu") is None


def test_unknown_precision_is_a_clear_error():
    with pytest.raises(AssayError, match="unknown precision 'fp8'"):
        PrecisionPolicy.resolve("fp8", "cpu")


def test_dtypes_inside_and_outside_the_autocast_region():
    policy = PrecisionPolicy.resolve("bf16", "cpu")
    layer = nn.Linear(8, 8)
    x = torch.randn(4, 8)
    with policy.autocast():
        y = layer(x)
        assert y.dtype == torch.bfloat16  # matmuls run in bf16
        assert layer.weight.dtype == torch.float32  # master weights stay fp32
        with full_precision("cpu"):
            stats = torch.zeros(8, 8, dtype=STATS_DTYPE)
            stats += y.float().T @ y.float()  # statistics accumulate in fp32
            assert (y.float() @ layer.weight.T).dtype == torch.float32
    assert stats.dtype == torch.float32
    assert layer(x).dtype == torch.float32  # outside the region: fp32 again
    y.float().sum().backward()
    assert layer.weight.grad is not None and layer.weight.grad.dtype == torch.float32


def test_bf16_accumulation_would_lose_counts():
    """Why statistics must not accumulate in bf16: it holds integers exactly only to 256."""
    count = torch.tensor(256.0, dtype=torch.bfloat16)
    assert float(count + 1) == 256.0
    assert float(torch.tensor(256.0, dtype=STATS_DTYPE) + 1) == 257.0


def test_check_finite_names_fp16_overflow():
    policy = PrecisionPolicy.resolve("fp16", "cpu")
    with pytest.raises(AssayError, match="fp16 overflowed"):
        check_finite(torch.tensor([1.0, float("inf")]), "gradients", policy)
    check_finite(torch.ones(3), "gradients", policy)
