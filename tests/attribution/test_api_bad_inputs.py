"""The attribution pillar's Python entry points given what a user plausibly passes by mistake:
each refused in one line before any work (never a raw torch traceback, a silently wrong result
or a model left frozen), or, for ordinary DataLoader batches, simply accepted."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from assay.attribution.api import Gradients, collect_gradients, score
from assay.attribution.kfac import load_factors, save_factors
from assay.attribution.kfac_fit import fit_kfac
from assay.attribution.options import ScoreOptions
from assay.core.errors import AssayError


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))


def _batches(n: int = 12, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    x, y = torch.randn(n, 6, generator=gen), torch.randint(0, 3, (n,), generator=gen)
    return [{"x": x[i : i + 4], "y": y[i : i + 4]} for i in range(0, n, 4)]


def _ce(model: nn.Module, batch: dict) -> torch.Tensor:
    return F.cross_entropy(model(batch["x"]), batch["y"], reduction="none")  # [B]


# --- modules --------------------------------------------------------------------------------------


# --- projection and seed --------------------------------------------------------------------------


# --- loss_fn --------------------------------------------------------------------------------------


# --- batches --------------------------------------------------------------------------------------


# --- kfac_influence's options ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def fitted():
    model, b = _mlp(), _batches()
    return model, b, fit_kfac(model, b, _ce, kind="ekfac"), fit_kfac(model, b, _ce, kind="kfac")


# --- save_factors ---------------------------------------------------------------------------------
def test_save_factors_writes_only_new_files_or_its_own_factors_with_overwrite(fitted, tmp_path):
    _, _, ekfac, kfac = fitted
    mine = tmp_path / "notes.txt"
    mine.write_text("my data")
    with pytest.raises(AssayError, match="exists and is not K-FAC factors"):
        save_factors(ekfac, mine)
    assert mine.read_text() == "my data"
    with pytest.raises(AssayError, match="is a folder; give save_factors a file path"):
        save_factors(ekfac, tmp_path)
    with pytest.raises(AssayError, match="no folder .*nope to save the factors in"):
        save_factors(ekfac, tmp_path / "nope" / "kfac.safetensors")
    with pytest.raises(AssayError, match="saves the KronFactors of fit_kfac, not a str"):
        save_factors("kfac", tmp_path / "k.safetensors")  # type: ignore[arg-type]
    path = save_factors(ekfac, tmp_path / "k.safetensors")
    with pytest.raises(AssayError, match="already holds K-FAC factors; pass overwrite=True"):
        save_factors(kfac, path)
    assert load_factors(path).kind == "ekfac"
    save_factors(kfac, path, overwrite=True)
    assert load_factors(path).kind == "kfac"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["k.safetensors", "notes.txt"]  # no .tmp


def test_a_failed_save_leaves_no_temporary_file(fitted, tmp_path, monkeypatch):
    from assay.attribution import kfac

    def full(tensors, filename, metadata=None):
        open(filename, "wb").write(b"half")
        raise OSError("disk full")

    monkeypatch.setattr(kfac, "save_file", full)
    with pytest.raises(OSError):
        save_factors(fitted[2], tmp_path / "k.safetensors")
    assert list(tmp_path.iterdir()) == []


# --- score ----------------------------------------------------------------------------------------
def test_score_takes_rows_that_require_grad():
    model, b = _mlp(), _batches()
    train, queries = (
        collect_gradients(model, b, _ce, projection_dim=4),
        collect_gradients(model, b[:1], _ce, projection_dim=4),
    )
    tracked = Gradients(queries.rows.clone().requires_grad_(True), queries.modules, 4, 0)
    for mode in ("trackstar", "cosine"):
        want = score(queries, train, ScoreOptions(mode=mode)).scores
        torch.testing.assert_close(score(tracked, train, ScoreOptions(mode=mode)).scores, want)
