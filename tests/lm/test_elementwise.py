"""`--compile`: the collector's elementwise steps as compiled kernels give the eager path's numbers
up to rounding (the eager path itself is checked bit for bit against autograd in test_lean.py)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from assay.attribution.collector import GradientCollector, linear_modules
from assay.attribution.projection import Projector
from assay.core.errors import AssayError
from assay.core.precision import PrecisionPolicy
from assay.lm import elementwise, lean
from assay.lm.data import collate
from assay.lm.elementwise import EAGER, Kernels, compiled_kernels
from assay.lm.losses import example_losses
from tests.helpers import random_examples, rel_err, tiny_llama


def _close(got: torch.Tensor, want: torch.Tensor, rtol: float) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    err = rel_err(got.float(), want.float())
    assert err < rtol, err


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_kernels_match_the_eager_ones(dtype):
    g = torch.Generator().manual_seed(0)
    fused = compiled_kernels("cpu")
    for f in dataclasses.fields(Kernels):  # torch.compile's wrappers around the functional formulas
        assert getattr(fused, f.name)._torchdynamo_orig_callable is not getattr(EAGER, f.name)
    rtol = 1e-6 if dtype == torch.float32 else 1e-2  # bf16: fused keeps fp32 between the ops
    gate, up, grad = (torch.randn(37, 96, generator=g).to(dtype) for _ in range(3))
    _close(fused.silu_gate(gate, up), EAGER.silu_gate(gate, up), rtol)
    for got, want in zip(fused.silu_gate_backward(grad, gate, up), EAGER.silu_gate_backward(grad, gate, up)):
        _close(got, want, rtol)
    x, dy = torch.randn(2, 37, 48, generator=g), torch.randn(2, 37, 48, generator=g)
    w = torch.randn(48, generator=g)
    (out, rstd), (out_e, rstd_e) = fused.rms_norm(x, w, 1e-6), EAGER.rms_norm(x, w, 1e-6)
    _close(out, out_e, 1e-6)
    _close(rstd, rstd_e, 1e-6)
    for got, want in zip(
        fused.rms_norm_backward(dy, x, w, rstd_e), EAGER.rms_norm_backward(dy, x, w, rstd_e)
    ):
        _close(got, want, 1e-6)


def _rows(model, precision: str, compiled: bool) -> torch.Tensor:
    examples = random_examples([9, 5, 12, 3], seed=2)
    batch = collate(examples, np.arange(4), pad_id=0)
    policy = PrecisionPolicy.resolve(precision, "cpu")
    with GradientCollector(model, linear_modules(model), Projector(8, 0), policy, compiled=compiled) as col:
        return col.gradients(batch, example_losses)[0]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_compiled_collector_gives_the_eager_rows(precision, monkeypatch):
    model = tiny_llama()
    eager = _rows(model, precision, compiled=False)
    calls: list[str] = []

    def counted(name: str, fn):
        return lambda *a: calls.append(name) or fn(*a)

    fused = compiled_kernels("cpu")
    spied = Kernels(*(counted(f.name, getattr(fused, f.name)) for f in dataclasses.fields(Kernels)))
    monkeypatch.setattr(lean, "compiled_kernels", lambda device_type: spied)
    rows = _rows(model, precision, compiled=True)
    layers = model.config.num_hidden_layers
    # every gate, and every norm but the first (its input, the frozen embedding, needs no gradient)
    assert sorted(set(calls)) == sorted(f.name for f in dataclasses.fields(Kernels))
    assert calls.count("silu_gate") == calls.count("silu_gate_backward") == layers
    assert calls.count("rms_norm") == calls.count("rms_norm_backward") == 2 * layers
    # fp32: a sum ordered differently; bf16: the gate's product rounded once instead of twice
    _close(rows, eager, 1e-5 if precision == "fp32" else 2e-2)
    assert model.model.layers[0].mlp.forward.__func__ is type(model.model.layers[0].mlp).forward  # restored


def test_compile_without_a_cpp_compiler_is_one_line(monkeypatch):
    import torch._inductor.cpp_builder as cpp_builder

    def missing() -> str:
        raise RuntimeError("no C++ compiler found")

    monkeypatch.setattr(cpp_builder, "get_cpp_compiler", missing)
    with pytest.raises(AssayError, match="needs a C\\+\\+ compiler.*drop --compile"):
        elementwise._require_cpp_compiler()
