"""Mixed precision: bf16 autocast and fp16 loss scaling agree with fp32; overflow is loud."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from assay.attribution.build import GradientSetup, iter_gradients
from assay.attribution.collector import GradientCollector, linear_modules
from assay.attribution.projection import Projector
from assay.core.config import DataConfig, ModelConfig
from assay.core.errors import AssayError
from assay.core.paths import assets_dir
from assay.core.precision import PrecisionPolicy
from assay.lm.data import collate, load_examples, token_batches
from assay.lm.losses import example_losses
from tests.helpers import random_examples, tiny_llama

BF16_MIN_COSINE = 0.99
BF16 = PrecisionPolicy.resolve("bf16", "cpu")


def _cosines(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=1)


def _rows(model_name: str, precision: str, examples, tokenizer, p: int = 16) -> torch.Tensor:
    from assay.lm.models import load_model

    policy = PrecisionPolicy.resolve(precision, "cpu")
    model = load_model(ModelConfig(model=model_name), policy)
    setup = GradientSetup(model, tokenizer, policy, linear_modules(model), Projector(p), None, 0)
    rows = torch.zeros(len(examples), setup.collector().dim)
    for positions, grads, _, _ in iter_gradients(setup, examples, token_batches(examples, 4096)):
        rows[torch.from_numpy(positions)] = grads
    return rows


@pytest.mark.skipif(
    not (assets_dir() / "assay-tiny" / "config.json").exists(), reason="assay-tiny not bundled"
)
def test_bf16_autocast_agrees_with_fp32_on_assay_tiny_abc_tunes():
    from assay.lm.models import load_tokenizer

    tokenizer = load_tokenizer(ModelConfig(model="assay-tiny"))
    _, examples = load_examples(DataConfig(dataset="abc-tunes", max_samples=100, max_length=256), tokenizer)
    fp32 = _rows("assay-tiny", "fp32", examples, tokenizer)
    bf16 = _rows("assay-tiny", "bf16", examples, tokenizer)
    cos = _cosines(bf16, fp32)
    q = torch.quantile(cos, torch.tensor([0.0, 0.05, 0.5], dtype=torch.float64))
    print(f"bf16 vs fp32 per-example cosine: min {q[0]:.4f} p5 {q[1]:.4f} median {q[2]:.4f}")
    assert float(cos.min()) >= BF16_MIN_COSINE


def _collect(model, precision: str, objective=example_losses) -> torch.Tensor:
    policy = PrecisionPolicy.resolve(precision, "cpu")
    examples = random_examples([12, 30, 7, 21], seed=11)
    batch = collate(examples, np.arange(4), pad_id=0)
    with GradientCollector(model, linear_modules(model), Projector(8), policy) as col:
        return col.gradients(batch, objective)[0]


def test_fp16_loss_scaling_and_bf16_pure_agree_with_fp32():
    model = tiny_llama(12)
    fp32 = _collect(model, "fp32")
    assert float(_cosines(_collect(model, "fp16"), fp32).min()) >= 0.99
    assert float(_cosines(_collect(model, "bf16"), fp32).min()) >= 0.99
    pure = tiny_llama(12).to(torch.bfloat16)
    assert float(_cosines(_collect(pure, "bf16-pure"), fp32).min()) >= 0.98


def test_fp16_recovers_from_overflow_by_rescaling(monkeypatch):
    model = tiny_llama(13)
    fp32 = _collect(model, "fp32")
    scales = []
    real = GradientCollector._attempt

    def spy(self, batch, objective, scale):
        scales.append(scale)
        return real(self, batch, objective, scale)

    def huge(m, b):  # gradients ~1e5× larger: the first loss scale overflows fp16
        return example_losses(m, b) * 1e5

    monkeypatch.setattr(GradientCollector, "_attempt", spy)
    rows = _collect(model, "fp16", huge) / 1e5
    assert len(scales) > 1 and scales[-1] < scales[0], "the batch was retried at a lower scale"
    assert torch.isfinite(rows).all() and float(_cosines(rows, fp32).min()) >= 0.99


def test_non_finite_is_a_clear_error():
    model = tiny_llama(14)

    def broken(m, b):
        return example_losses(m, b) * float("inf")

    with pytest.raises(AssayError, match="fp16 overflowed"):
        _collect(model, "fp16", broken)


def test_projection_in_compute_dtype_agrees_with_fp32_projection():
    model = tiny_llama(15)
    examples = random_examples([12, 30, 7, 21], seed=11)
    batch = collate(examples, np.arange(4), pad_id=0)
    rows = {}
    for lowp in (False, True):
        with GradientCollector(
            model, linear_modules(model), Projector(8), BF16, project_in_compute_dtype=lowp
        ) as c:
            rows[lowp] = c.gradients(batch, example_losses)[0]
    assert rows[True].dtype == torch.float32 and not torch.equal(rows[True], rows[False])
    assert float(_cosines(rows[True], rows[False]).min()) >= 0.9999


def test_bf16_projection_is_the_fp32_projection_rounded_once():
    """A bf16 input projected by the bf16 GEMM against the exact signs: the fp32 projection of
    the same values, off by at most one bf16 rounding of the p-wide result (2^-9 relative)."""
    model = tiny_llama(16)
    with GradientCollector(model, linear_modules(model), Projector(8), BF16) as c:
        name = next(iter(c.modules))
        mat = c._mats[(name, "in")]
        assert mat is not None
        x = torch.randn(2, 5, mat.shape[1], generator=torch.Generator().manual_seed(0)).bfloat16()
        got = c._project(x, mat)
    want = x.float() @ mat.T
    assert got.dtype == torch.float32 and not torch.equal(got, want)
    assert bool(((got - want).abs() <= 2**-8 * want.abs() + 1e-6).all())
