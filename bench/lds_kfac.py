"""K-FAC / EK-FAC columns of bench/lds_classifier.py: assay's Python API and kronfluence (the
reference EK-FAC) on the same model, batches, labels and damping rule. Each method is
`(model, data, recipe, damping, fisher) -> scores [Q, N]`, positive = proponent.

assay attributes the linear layers' weights; kronfluence also their biases (a ones column
appended to each layer's input). The `+b` methods run assay on the same function with each bias
folded into its weight that way, to show how much of any difference the biases make.

kronfluence is imported only where it is installed (the peers' venv: `make test-interop`);
lds_classifier.py skips its columns elsewhere.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import tempfile
import warnings
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn
from torch.utils.data import TensorDataset

from assay.attribution.kfac import resolve_policy
from assay.attribution.kfac_fit import SampledCrossEntropy, fit_kfac
from assay.attribution.kfac_influence import kfac_influence
from assay.counterfactual.lds import bootstrap_mean_ci, spearman

try:  # the reference EK-FAC: installed in the peers' venv only (Makefile: test-interop)
    from kronfluence.analyzer import Analyzer, prepare_model
    from kronfluence.arguments import FactorArguments, ScoreArguments
    from kronfluence.factor import config as kronfluence_config
    from kronfluence.task import Task

    # its GradScaler call is deprecated in recent torch: one warning per pass, nothing to act on
    warnings.filterwarnings("ignore", category=FutureWarning, module="kronfluence")
except ImportError:
    Task = object  # its methods are skipped with a note (see `unavailable`)

if TYPE_CHECKING:
    from lds_classifier import Data, Recipe


# --- K-FAC / EK-FAC: assay's Python API and kronfluence on the same batches, labels and damping

TRAIN_BATCH = 100
"""Training examples per batch, for both libraries' factor and score passes."""


def cross_entropy(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """[B] per-example cross-entropy: the training loss and each query's measurement."""
    return nn.functional.cross_entropy(model(batch["x"]), batch["y"], reduction="none")


def assay_influence(
    model: nn.Module, data: Data, kind: str, damping: float, fisher: str, precision: str = "fp32"
) -> np.ndarray:
    """assay's `kfac_influence`; with the sampled Fisher the factors are fitted first on drawn labels.
    `precision` bf16: forward and backward under bf16 autocast, statistics accumulated in fp32."""
    train = [
        {"x": data.x[s : s + TRAIN_BATCH], "y": data.y[s : s + TRAIN_BATCH]}
        for s in range(0, len(data.x), TRAIN_BATCH)
    ]
    factors = None
    if fisher == "sampled":
        drawn = SampledCrossEntropy(lambda m, b: m(b["x"]))
        factors = fit_kfac(model, train, drawn, kind, ("*",), resolve_policy(model, precision))  # type: ignore[arg-type]
    queries = [{"x": data.xq, "y": data.yq}]
    kw = {"damping": damping, "modules": ("*",), "factors": factors, "precision": precision}
    return kfac_influence(model, train, queries, cross_entropy, kind, **kw).numpy()  # type: ignore[arg-type]


class AppendOne(nn.Module):
    """x -> [x, 1]: the input a bias folded into the next layer's weight sees."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x, torch.ones_like(x[..., :1])], dim=-1)


def folded(model: nn.Module) -> nn.Module:
    """The same function with each Linear's bias as an extra weight column (no biases left)."""
    layers: list[nn.Module] = []
    for layer in model:
        if not isinstance(layer, nn.Linear) or layer.bias is None:
            layers.append(layer)
            continue
        plain = nn.Linear(layer.in_features + 1, layer.out_features, bias=False)
        with torch.no_grad():
            plain.weight.copy_(torch.cat([layer.weight, layer.bias[:, None]], dim=1))
        layers += [AppendOne(), plain]
    return nn.Sequential(*layers).eval()


def assay_kfac(model: nn.Module, data: Data, recipe: Recipe, damping: float, fisher: str) -> np.ndarray:
    """assay's K-FAC influence (weights of both linear layers)."""
    return assay_influence(model, data, "kfac", damping, fisher)


def assay_ekfac(model: nn.Module, data: Data, recipe: Recipe, damping: float, fisher: str) -> np.ndarray:
    """assay's EK-FAC influence (weights of both linear layers)."""
    return assay_influence(model, data, "ekfac", damping, fisher)


def assay_kfac_bf16(model: nn.Module, data: Data, recipe: Recipe, damping: float, fisher: str) -> np.ndarray:
    """assay's K-FAC influence with the gradients and factors taken under bf16 autocast."""
    return assay_influence(model, data, "kfac", damping, fisher, "bf16")


def assay_ekfac_bf16(model: nn.Module, data: Data, recipe: Recipe, damping: float, fisher: str) -> np.ndarray:
    """assay's EK-FAC influence with the gradients and factors taken under bf16 autocast."""
    return assay_influence(model, data, "ekfac", damping, fisher, "bf16")


def assay_kfac_bias(model: nn.Module, data: Data, recipe: Recipe, damping: float, fisher: str):
    """assay's K-FAC influence with the biases folded into the weights (kronfluence's parameters)."""
    return assay_influence(folded(model), data, "kfac", damping, fisher)


def assay_ekfac_bias(model: nn.Module, data: Data, recipe: Recipe, damping: float, fisher: str):
    """assay's EK-FAC influence with the biases folded into the weights (kronfluence's parameters)."""
    return assay_influence(folded(model), data, "ekfac", damping, fisher)


class ClassifierTask(Task):  # type: ignore[misc, valid-type]
    """kronfluence's task: summed cross-entropy; with `sample`, labels drawn from the model (true Fisher)."""

    def compute_train_loss(self, batch, model, sample=False):
        x, y = batch
        logits = model(x)
        if sample:
            with torch.no_grad():
                y = torch.multinomial(torch.softmax(logits.detach(), dim=1), 1)[:, 0]
        return nn.functional.cross_entropy(logits, y, reduction="sum")

    def compute_measurement(self, batch, model):
        x, y = batch
        return nn.functional.cross_entropy(model(x), y, reduction="sum")


@contextlib.contextmanager
def kronfluence_damping(scale: float):
    """kronfluence's relative damping (damping_factor=None) is a module constant, 0.1: set it for
    the run, so both libraries take δ = scale × each module's mean eigenvalue."""
    saved = kronfluence_config.HEURISTIC_DAMPING_SCALE
    kronfluence_config.HEURISTIC_DAMPING_SCALE = scale
    try:
        yield
    finally:
        kronfluence_config.HEURISTIC_DAMPING_SCALE = saved


def kronfluence_influence(model: nn.Module, data: Data, strategy: str, damping: float, fisher: str):
    """kronfluence's pairwise scores [Q, N] on a copy of the model (it wraps the modules)."""
    task = ClassifierTask()
    wrapped = prepare_model(copy.deepcopy(model), task)
    train, queries = TensorDataset(data.x, data.y), TensorDataset(data.xq, data.yq)
    with tempfile.TemporaryDirectory() as out, kronfluence_damping(damping):
        analyzer = Analyzer("lds", wrapped, task, cpu=True, disable_tqdm=True, output_dir=out)
        factor_args = FactorArguments(strategy=strategy, use_empirical_fisher=fisher == "empirical")
        analyzer.fit_all_factors("f", train, per_device_batch_size=TRAIN_BATCH, factor_args=factor_args)
        analyzer.compute_pairwise_scores(
            "s",
            "f",
            queries,
            train,
            per_device_query_batch_size=len(queries),
            per_device_train_batch_size=TRAIN_BATCH,
            score_args=ScoreArguments(damping_factor=None),
        )
        return analyzer.load_pairwise_scores("s")["all_modules"].double().numpy()


def kronfluence_kfac(model: nn.Module, data: Data, recipe: Recipe, damping: float, fisher: str):
    """kronfluence's K-FAC influence (weights and biases)."""
    return kronfluence_influence(model, data, "kfac", damping, fisher)


def kronfluence_ekfac(model: nn.Module, data: Data, recipe: Recipe, damping: float, fisher: str):
    """kronfluence's EK-FAC influence (weights and biases)."""
    return kronfluence_influence(model, data, "ekfac", damping, fisher)


NEEDS = {"kronfluence-kfac": "kronfluence", "kronfluence-ekfac": "kronfluence"}
"""Methods that need a package outside assay's own dependencies."""


def unavailable(name: str) -> str | None:
    """Why a method cannot run in this environment (None when it can)."""
    package = NEEDS.get(name)
    if package is None or importlib.util.find_spec(package) is not None:
        return None
    return f"{package} is not installed here (the peers' venv has it: make test-interop)"


def paired_difference(ours: dict, theirs: dict) -> tuple[float, float, float]:
    """Mean per-query LDS difference and its bootstrap 95% interval (queries defined on both sides)."""
    a, b = (np.array([np.nan if x is None else x for x in r["per_query"]]) for r in (ours, theirs))
    diff = (a - b)[~(np.isnan(a) | np.isnan(b))]
    low, high = bootstrap_mean_ci(diff)
    return float(diff.mean()), low, high


def against_kronfluence(rows: dict, scores: dict) -> None:
    """assay's K-FAC / EK-FAC beside kronfluence's: paired LDS difference, time ratio, agreement."""
    pairs = [(f"assay-{k}{b}", f"kronfluence-{k}") for k in ("kfac", "ekfac") for b in ("", "+b")]
    for ours, theirs in pairs:
        if ours not in rows or theirs not in rows:
            continue
        lds, low, high = paired_difference(rows[ours]["loss"], rows[theirs]["loss"])
        ratio = rows[ours]["seconds"] / rows[theirs]["seconds"]
        rho = spearman(scores[ours].T, scores[theirs].T)  # per query, over training examples
        rows[ours]["vs_kronfluence"] = {
            "lds_loss_diff": [lds, low, high],
            "time_ratio": ratio,
            "spearman": rho.tolist(),
        }
        print(
            f"{ours} vs {theirs}: LDS (loss) {lds:+.4f} [{low:+.4f}, {high:+.4f}], time {ratio:.2f}x, "
            f"scores' per-query Spearman median {np.median(rho):.4f} (min {rho.min():.4f})"
        )
