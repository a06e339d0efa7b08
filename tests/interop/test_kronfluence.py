"""assay's K-FAC / EK-FAC against kronfluence, the reference implementation (run in .venv-peers:
`make test-interop`). Same model, data, labels (the empirical Fisher: sampled labels would
differ by RNG) and damping rule (0.1 × mean eigenvalue per module: kronfluence's
`damping_factor=None`); unprojected gradients on both sides. Passing means Spearman >= 0.99
per query between the two libraries' influence scores.

`pytest -s` also prints both libraries' wall times on the same setup (provisional: small models
on a shared CPU measure mostly per-call overhead).
"""

from __future__ import annotations

import copy
import platform
import time

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset, TensorDataset

from assay.attribution.api import collect_gradients
from assay.attribution.kfac import precondition_queries
from assay.attribution.kfac_fit import fit_kfac
from assay.attribution.projection import Projector
from assay.lm.data import Examples, collate
from assay.lm.losses import example_losses

kronfluence = pytest.importorskip("kronfluence")
from kronfluence.analyzer import Analyzer, prepare_model  # noqa: E402
from kronfluence.arguments import FactorArguments, ScoreArguments  # noqa: E402
from kronfluence.task import Task  # noqa: E402


def spearman_rows(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Spearman correlation of each row of a with the same row of b (no ties expected)."""
    ra, rb = (x.argsort(axis=1).argsort(axis=1).astype(np.float64) for x in (a, b))
    ra -= ra.mean(axis=1, keepdims=True)
    rb -= rb.mean(axis=1, keepdims=True)
    return (ra * rb).sum(axis=1) / np.sqrt((ra**2).sum(axis=1) * (rb**2).sum(axis=1))


def kronfluence_scores(model, task, train: Dataset, queries: Dataset, strategy: str, tmp_path) -> np.ndarray:
    """kronfluence's pairwise scores [Q, N] on a copy of the model (it wraps the modules)."""
    model = prepare_model(copy.deepcopy(model), task)
    analyzer = Analyzer("interop", model, task, cpu=True, disable_tqdm=True, output_dir=str(tmp_path))
    factor_args = FactorArguments(strategy=strategy, use_empirical_fisher=True)
    analyzer.fit_all_factors(
        "f", train, per_device_batch_size=16, factor_args=factor_args, overwrite_output_dir=True
    )
    analyzer.compute_pairwise_scores(
        "s",
        "f",
        queries,
        train,
        per_device_query_batch_size=8,
        per_device_train_batch_size=16,
        score_args=ScoreArguments(damping_factor=None),
        overwrite_output_dir=True,
    )
    return analyzer.load_pairwise_scores("s")["all_modules"].numpy()


def assay_scores(model, train_batches, query_batches, loss_fn, kind: str) -> np.ndarray:
    """assay's influence [Q, N]: preconditioned raw query gradients · raw train gradients."""
    modules = tuple(n for n, m in model.named_modules() if isinstance(m, nn.Linear) and "lm_head" not in n)
    factors = fit_kfac(model, train_batches, loss_fn, kind="ekfac", modules=modules)
    train = collect_gradients(model, train_batches, loss_fn, modules=modules, projection_dim=0)
    queries = precondition_queries(model, factors, query_batches, loss_fn, Projector(0), kind=kind)  # type: ignore[arg-type]
    return (queries.rows.double() @ train.rows.double().T).numpy()


def cpu_model() -> str:
    """The CPU's model name (timings printed beside it are provisional)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def timed(fn, *args):
    start = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - start


# --- an MLP classifier ------------------------------------------------------------------------------
class ClassifierTask(Task):
    def compute_train_loss(self, batch, model, sample=False):
        x, y = batch
        assert not sample  # the empirical Fisher only: sampled labels would differ by RNG
        return F.cross_entropy(model(x), y, reduction="sum")

    def compute_measurement(self, batch, model):
        x, y = batch
        return F.cross_entropy(model(x), y, reduction="sum")


def classifier():
    torch.manual_seed(0)
    y = torch.randint(0, 4, (120,))
    x = torch.randn(4, 12)[y] * 2 + torch.randn(120, 12)
    model = nn.Sequential(  # bias-free: assay's factors are the weights' (see assay/attribution/kfac.py)
        nn.Linear(12, 32, bias=False),
        nn.Tanh(),
        nn.Linear(32, 16, bias=False),
        nn.Tanh(),
        nn.Linear(16, 4, bias=False),
    )
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(30):  # briefly trained on the first 96: gradients differ between examples
        opt.zero_grad()
        F.cross_entropy(model(x[:96]), y[:96]).backward()
        opt.step()
    return model.eval(), x, y


def ce(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(model(batch["x"]), batch["y"], reduction="none")


@pytest.mark.parametrize("strategy", ["ekfac", "kfac"])
def test_classifier_scores_match_kronfluence(strategy: str, tmp_path) -> None:
    model, x, y = classifier()
    train_batches = [{"x": x[i : i + 16], "y": y[i : i + 16]} for i in range(0, 96, 16)]
    query_batches = [{"x": x[96:], "y": y[96:]}]
    theirs, t_theirs = timed(
        kronfluence_scores,
        model,
        ClassifierTask(),
        TensorDataset(x[:96], y[:96]),
        TensorDataset(x[96:], y[96:]),
        strategy,
        tmp_path,
    )
    ours, t_ours = timed(assay_scores, model, train_batches, query_batches, ce, strategy)
    rho = spearman_rows(ours, theirs)
    print(
        f"\n[{cpu_model()}, {torch.get_num_threads()} threads] classifier {strategy}: assay {t_ours:.2f} s, "
        f"kronfluence {t_theirs:.2f} s; Spearman min {rho.min():.5f}"
    )
    assert ours.shape == theirs.shape == (24, 96)
    assert rho.min() >= 0.99, np.sort(rho)[:3]
    np.testing.assert_allclose(ours, theirs, rtol=2e-3, atol=2e-3 * np.abs(theirs).max())


# --- a tiny causal LM with padding ---------------------------------------------------------------------
class LmTask(Task):
    def __init__(self, modules: list[str]):
        self.modules = modules

    def compute_train_loss(self, batch, model, sample=False):
        assert not sample
        return example_losses(model, batch).sum()

    def compute_measurement(self, batch, model):
        return example_losses(model, batch).sum()

    def get_influence_tracked_modules(self):
        return self.modules

    def get_attention_mask(self, batch):
        return batch["attention_mask"]


class Rows(Dataset):
    def __init__(self, batch: dict[str, torch.Tensor]):
        self.batch = batch

    def __len__(self) -> int:
        return self.batch["input_ids"].shape[0]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {k: v[i] for k, v in self.batch.items()}


def tiny_llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        attn_implementation="eager",
    )
    return LlamaForCausalLM(cfg).eval()


def padded(n: int, seed: int) -> dict[str, torch.Tensor]:
    """n examples of 5..20 tokens, all padded to 24 (so every batch has padding to ignore)."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(5, 21, size=n)
    ex = Examples(
        ids=np.arange(n, dtype=np.int64),
        offsets=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
        tokens=rng.integers(1, 96, size=int(lengths.sum())).astype(np.int32),
        loss_start=np.ones(n, dtype=np.int64),
    )
    return collate(ex, np.arange(n), pad_id=0, pad_to=24)


@pytest.mark.parametrize("strategy", ["ekfac", "kfac"])
def test_tiny_lm_scores_match_kronfluence(strategy: str, tmp_path) -> None:
    model = tiny_llama()
    modules = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and "lm_head" not in n]
    train, queries = padded(64, seed=1), padded(8, seed=2)
    train_batches = [{k: v[i : i + 16] for k, v in train.items()} for i in range(0, 64, 16)]
    theirs, t_theirs = timed(
        kronfluence_scores, model, LmTask(modules), Rows(train), Rows(queries), strategy, tmp_path
    )
    ours, t_ours = timed(assay_scores, model, train_batches, [queries], example_losses, strategy)
    rho = spearman_rows(ours, theirs)
    print(
        f"\n[{cpu_model()}, {torch.get_num_threads()} threads] tiny LM {strategy}: assay {t_ours:.2f} s, "
        f"kronfluence {t_theirs:.2f} s; Spearman min {rho.min():.5f}"
    )
    assert ours.shape == theirs.shape == (8, 64)
    assert rho.min() >= 0.99, np.sort(rho)[:3]
    np.testing.assert_allclose(ours, theirs, rtol=2e-3, atol=2e-3 * np.abs(theirs).max())
