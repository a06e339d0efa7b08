"""K-FAC / EK-FAC through `assay build --preconditioner` and `assay score --mode influence`.

The factors a build saves are those `fit_kfac` fits on the same sample; a raw index (projection 0)
scores exact EK-FAC influence; a projected index whose projection is injective scores the same
ranking through the projected curvature."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from assay.attribution import index as ix
from assay.attribution.build import BuildConfig, build_index, setup_from_index
from assay.attribution.index import open_index
from assay.attribution.kfac import precondition_rows
from assay.attribution.kfac_fit import fit_kfac
from assay.attribution.normalizers import sample_positions
from assay.attribution.projection import Projector
from assay.attribution.score import ScoreOptions, score_index
from assay.core.config import DataConfig, ModelConfig, RuntimeConfig
from assay.core.errors import AssayError
from assay.lm.data import collate, load_examples, token_batches
from assay.lm.losses import example_losses
from tests.helpers import write_word_texts


def _build(out, model_dir, data, projection_dim: int, kind: str = "ekfac") -> None:
    build_index(
        BuildConfig(
            out=str(out),
            model=ModelConfig(model=str(model_dir)),
            data=DataConfig(dataset=str(data), max_length=32),
            runtime=RuntimeConfig(precision="fp32", threads=1),
            projection_dim=projection_dim,
            modules=("*self_attn*",),  # 32-wide layers: p = 32 projects them injectively, cheaply
            preconditioner=kind,  # type: ignore[arg-type]
            stats_samples=24,
            token_batch_size=256,
        )
    )


@pytest.fixture(scope="module")
def indexes(tmp_path_factory, tiny_model_dir):
    root = tmp_path_factory.mktemp("kfac-index")
    data = write_word_texts(root / "words.jsonl", 40, 12)
    _build(root / "raw", tiny_model_dir, data, 0)
    _build(root / "wide", tiny_model_dir, data, 32)  # >= every attention layer's width: injective
    return root, data


def test_build_saves_the_factors_fit_kfac_fits_on_its_sample(indexes):
    root, data = indexes
    index = open_index(root / "raw")
    saved = index.kfac_factors()
    assert saved is not None and saved.kind == "ekfac"
    setup = setup_from_index(index, device="cpu")
    _, examples = load_examples(DataConfig(dataset=str(data), max_length=32), setup.tokenizer)
    sample = examples.subset(sample_positions(len(examples), 24, 0))
    batches = [collate(sample, p, setup.pad_id) for p in token_batches(sample, 256)]
    fresh = fit_kfac(setup.model, batches, example_losses, "ekfac", setup.modules, setup.policy)
    queries = torch.randn(3, index.dim, generator=torch.Generator().manual_seed(0))
    got = precondition_rows(queries, saved, Projector(0, 0))
    want = precondition_rows(queries, fresh, Projector(0, 0))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_raw_index_scores_exact_influence_and_projected_ranks_alike(indexes):
    root, _ = indexes
    raw, wide = open_index(root / "raw"), open_index(root / "wide")
    rows = torch.from_numpy(np.array(raw.gradients, dtype=np.float32))
    q = rows[:4] + 0.1 * rows[4:8]  # queries with the training rows' structure
    options = ScoreOptions(mode="influence", damping=1e-4, top_k=3)
    exact = np.zeros((4, len(raw)), np.float32)
    score_index(raw, q, options, scores_out=exact)
    want = rows.double() @ precondition_rows(q, raw.kfac_factors(), Projector(0, 0), damping=1e-4).double().T
    np.testing.assert_allclose(exact, want.T.numpy(), rtol=1e-3, atol=1e-3 * float(want.abs().max()))
    projector = Projector(32, 0)
    slots = [(s, raw.module_shapes()[n]) for n, s in raw.modules.items()]
    projected_q = torch.cat(
        [projector.project_full(n, q[:, s].reshape(4, *shape)).reshape(4, -1) for (n, (s, shape)) in
         zip(raw.modules, slots)], dim=1,
    )  # fmt: skip
    projected = np.zeros((4, len(wide)), np.float32)
    score_index(wide, projected_q, options, scores_out=projected)
    for a, b in zip(exact, projected):
        ra, rb = np.argsort(np.argsort(a)), np.argsort(np.argsort(b))
        # the same values up to the damping (relative to each curvature's own mean eigenvalue)
        assert np.corrcoef(a, b)[0, 1] >= 0.998 and np.corrcoef(ra, rb)[0, 1] >= 0.98


def test_raw_layers_too_wide_for_dense_statistics_still_build_and_score(indexes, tiny_model_dir, monkeypatch):
    """Raw gradients of real layers are too wide for a [d, d] statistics matrix: a K-FAC index
    then keeps only its factors (what influence reads) and scores as the index with statistics."""
    root, data = indexes
    monkeypatch.setattr(ix, "MAX_STATS_DIM", 16)  # every 32 x 32 layer is "too wide"
    _build(root / "raw-nostats", tiny_model_dir, data, 0)
    bare, full = open_index(root / "raw-nostats", verify="full"), open_index(root / "raw")
    assert not (bare.path / ix.PRECONDITIONER_FILE).exists() and (full.path / ix.PRECONDITIONER_FILE).exists()
    q = torch.from_numpy(np.array(full.gradients[:3], dtype=np.float32))
    got, want = (np.zeros((3, len(full)), np.float32) for _ in range(2))
    score_index(bare, q, ScoreOptions(mode="influence"), scores_out=got)
    score_index(full, q, ScoreOptions(mode="influence"), scores_out=want)
    np.testing.assert_array_equal(got, want)


def test_kfac_needs_plain_gradients():
    with pytest.raises(AssayError, match="--normalizer none"):
        BuildConfig(out="x", preconditioner="ekfac", normalizer="adafactor")
