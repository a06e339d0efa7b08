"""The attribution pillar's Python entry points given what a user plausibly passes by mistake:
each refused in one line before any work (never a raw torch traceback, a silently wrong result
or a model left frozen), or, for ordinary DataLoader batches, simply accepted."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from assay.attribution.api import Gradients, collect_gradients, score
from assay.attribution.collector import GradientCollector, linear_modules
from assay.attribution.kfac import load_factors, save_factors
from assay.attribution.kfac_fit import fit_kfac
from assay.attribution.kfac_influence import kfac_influence
from assay.attribution.options import ScoreOptions
from assay.attribution.projection import Projector
from assay.core.errors import AssayError
from assay.core.precision import PrecisionPolicy


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))


def _batches(n: int = 12, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    x, y = torch.randn(n, 6, generator=gen), torch.randint(0, 3, (n,), generator=gen)
    return [{"x": x[i : i + 4], "y": y[i : i + 4]} for i in range(0, n, 4)]


def _ce(model: nn.Module, batch: dict) -> torch.Tensor:
    return F.cross_entropy(model(batch["x"]), batch["y"], reduction="none")  # [B]


def _never(model: nn.Module, batch: dict) -> torch.Tensor:
    raise RuntimeError("the check should have come before any work")


def _trainable(model: nn.Module) -> list[bool]:
    return [p.requires_grad for p in model.parameters()]


class _Named(nn.Module):
    """Two `mlp_*` layers and a head: patterns that differ from their characters."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.mlp_in, self.mlp_out, self.head = nn.Linear(6, 8), nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.mlp_out(torch.relu(self.mlp_in(x)))))


class _SideHead(nn.Module):
    """`aux` is computed but never reaches the loss; `unused` is never called."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body, self.head = nn.Linear(6, 8), nn.Linear(8, 3)
        self.aux, self.unused = nn.Linear(8, 2), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.body(x))
        self.aux(h)
        return self.head(h)


# --- modules --------------------------------------------------------------------------------------
def test_a_str_of_modules_is_one_pattern_everywhere():
    model, b = _Named(), _batches()
    assert list(collect_gradients(model, b, _ce, modules="mlp*", projection_dim=4).modules) == [
        "mlp_in",
        "mlp_out",
    ]
    assert list(fit_kfac(model, b, _ce, kind="kfac", modules="!*head").modules) == ["mlp_in", "mlp_out"]
    one = kfac_influence(model, b, b[:1], _ce, kind="kfac", modules="!*head")
    torch.testing.assert_close(one, kfac_influence(model, b, b[:1], _ce, kind="kfac", modules=("!*head",)))
    with pytest.raises(AssayError, match="modules must be glob patterns"):
        linear_modules(model, (model.head,))  # type: ignore[arg-type]


def test_fit_kfac_names_modules_that_never_reach_the_loss():
    model, b = _SideHead(), _batches()
    for fit in (
        lambda: fit_kfac(model, b, _ce, kind="kfac"),
        lambda: fit_kfac(model, b, _ce, kind="ekfac"),
        lambda: kfac_influence(model, b, b[:1], _ce),
    ):
        with pytest.raises(AssayError, match=r"modules aux, unused in these batches.*modules=\('!aux'"):
            fit()
    factors = fit_kfac(model, b, _ce, modules=("!aux", "!unused"))
    assert list(factors.modules) == ["body", "head"]


def test_a_frozen_model_or_one_without_parameters_is_one_line():
    frozen = _mlp().requires_grad_(False)
    for call in (
        lambda: collect_gradients(frozen, _batches(), _ce),
        lambda: fit_kfac(frozen, _batches(), _ce),
    ):
        with pytest.raises(AssayError, match=r"linear modules .* are all frozen \(requires_grad=False\)"):
            call()
    for call in (
        lambda: collect_gradients(nn.Identity(), _batches(), _ce),
        lambda: fit_kfac(nn.Sequential(nn.ReLU()), _batches(), _ce),
    ):
        with pytest.raises(AssayError, match="has no parameters"):
            call()


# --- projection and seed --------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"projection_dim": 16.0}, "projection_dim must be an int"),
        ({"projection_dim": -1}, "projection_dim must be >= 0"),
        ({"projection_dim": True}, "projection_dim must be an int"),
        ({"seed": 0.0}, "seed must be an int"),
        ({"seed": False}, "seed must be an int"),
    ],
)
def test_projection_dim_and_seed_must_be_ints(kwargs, match):
    model = _mlp()
    with pytest.raises(AssayError, match=match):
        collect_gradients(model, _batches(), _ce, **kwargs)
    assert all(_trainable(model))


def test_a_collector_that_fails_to_enter_leaves_the_model_trainable():
    model = _mlp()
    policy = PrecisionPolicy.resolve("fp32", "cpu")
    with pytest.raises(TypeError):  # a bad projection only fails when its matrices are made
        with GradientCollector(model, linear_modules(model), Projector(2.5), policy):  # type: ignore[arg-type]
            pass
    assert all(_trainable(model))


# --- loss_fn --------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "loss_fn, got",
    [
        (lambda m, b: _ce(m, b)[:-1], r"tensor of shape \[3\]"),
        (lambda m, b: torch.stack([_ce(m, b)] * 2, 1), r"tensor of shape \[4, 2\]"),
        (lambda m, b: _ce(m, b).mean(), r"tensor of shape \[\]"),
        (lambda m, b: 1.0, "not a float"),
        (lambda m, b: b["y"], "torch.int64 tensor"),
    ],
)
def test_a_loss_fn_of_the_wrong_shape_is_one_line(loss_fn, got):
    model = _mlp()
    for call in (
        lambda: collect_gradients(model, _batches(), loss_fn, projection_dim=4),
        lambda: fit_kfac(model, _batches(), loss_fn, kind="kfac"),
    ):
        with pytest.raises(AssayError, match=rf"loss_fn must return a float tensor \[B\].*B = 4.*{got}"):
            call()
    assert all(_trainable(model))


# --- batches --------------------------------------------------------------------------------------
class _Texts(Dataset):
    """A dataset whose examples carry a string, as a tokenised text dataset's do."""

    def __init__(self, batches: list[dict[str, torch.Tensor]]):
        self.x, self.y = torch.cat([b["x"] for b in batches]), torch.cat([b["y"] for b in batches])

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> dict:
        return {"x": self.x[i], "y": self.y[i], "text": f"example {i}"}


def test_dataloader_batches_with_non_tensor_values_are_used_as_they_are():
    model, b = _mlp(), _batches()
    loader = DataLoader(_Texts(b), batch_size=4)
    want = collect_gradients(model, b, _ce, projection_dim=4).rows
    torch.testing.assert_close(collect_gradients(model, loader, _ce, projection_dim=4).rows, want)
    texts = [{**batch, "text": ["t"] * 4, "n": 4} for batch in b]
    fitted = fit_kfac(model, texts, _ce)
    torch.testing.assert_close(fitted.modules["0"].corrected, fit_kfac(model, b, _ce).modules["0"].corrected)
    scores = kfac_influence(model, texts, texts[:1], _ce, factors=fitted)
    torch.testing.assert_close(scores, kfac_influence(model, b, b[:1], _ce, factors=fitted))


def test_batches_that_are_not_dicts_or_not_a_collection_are_one_line():
    model, b = _mlp(), _batches()
    tuples = DataLoader(TensorDataset(torch.randn(8, 6), torch.randint(0, 3, (8,))), batch_size=4)
    for call in (
        lambda: collect_gradients(model, tuples, _ce),
        lambda: fit_kfac(model, [(b[0]["x"], b[0]["y"])], _ce),
        lambda: kfac_influence(model, b, [(b[0]["x"], b[0]["y"])], _ce),
    ):
        with pytest.raises(AssayError, match="each batch must be a dict of tensors.*TensorDataset"):
            call()
    for call in (
        lambda: collect_gradients(model, b[0], _ce),
        lambda: fit_kfac(model, b[0], _ce, kind="kfac"),
        lambda: kfac_influence(model, b[0], b, _ce),
    ):
        with pytest.raises(AssayError, match=r"not one dict: pass \[batch\]"):
            call()
    assert all(_trainable(model))


# --- kfac_influence's options ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def fitted():
    model, b = _mlp(), _batches()
    return model, b, fit_kfac(model, b, _ce, kind="ekfac"), fit_kfac(model, b, _ce, kind="kfac")


@pytest.mark.parametrize("damping", [float("nan"), float("inf"), -1.0])
def test_kfac_influence_refuses_damping_that_is_not_finite_and_non_negative(fitted, damping):
    model, b, ekfac, _ = fitted
    with pytest.raises(AssayError, match="damping must be a finite number >= 0"):
        kfac_influence(model, b, b, _ce, query_fn=_never, factors=ekfac, damping=damping)
    with pytest.raises(AssayError, match="damping must be a finite number >= 0"):
        ekfac.dampings(damping=damping)  # the CLI's --damping reaches the same rule


def test_kfac_influence_checks_kind_and_modules_against_the_factors(fitted):
    model, b, ekfac, kfac = fitted
    with pytest.raises(AssayError, match="unknown K-FAC kind 'EKFAC'"):
        kfac_influence(model, b, b, _ce, kind="EKFAC", query_fn=_never, factors=ekfac)  # type: ignore[arg-type]
    with pytest.raises(AssayError, match="no EK-FAC eigenvalue correction.*kind='kfac'"):
        kfac_influence(model, b, b, _ce, kind="ekfac", query_fn=_never, factors=kfac)
    with pytest.raises(AssayError, match="selects other modules than the 2 the factors were fitted on"):
        kfac_influence(model, b, b, _ce, modules=("2",), query_fn=_never, factors=ekfac)
    same = kfac_influence(model, b, b[:1], _ce, modules="*", factors=ekfac)
    torch.testing.assert_close(same, kfac_influence(model, b, b[:1], _ce, factors=ekfac))


def test_kfac_influence_reads_factors_from_a_path(fitted, tmp_path):
    model, b, ekfac, _ = fitted
    path = save_factors(ekfac, tmp_path / "kfac.safetensors")
    for given in (path, str(path)):
        torch.testing.assert_close(
            kfac_influence(model, b, b[:1], _ce, factors=given),
            kfac_influence(model, b, b[:1], _ce, factors=ekfac),
        )
    with pytest.raises(AssayError, match="factors must be the KronFactors of fit_kfac or the path"):
        kfac_influence(model, b, b, _ce, factors=42, query_fn=_never)  # type: ignore[arg-type]


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
