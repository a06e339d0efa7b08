"""LDS on a small classifier: which attribution method predicts what retraining does?

A GELU MLP (32 -> 64 -> 10, 2,762 parameters) is trained with one fixed recipe (full-batch
Adam, L2 in the loss, fixed initialisation) on a deterministic synthetic 10-class Gaussian
mixture. Ground truth: the same recipe retrained on M random α-subsets of the training set,
each query's loss and margin measured under every subset model. Each attribution method
gives scores [Q, N] (positive = the training example lowers the query's loss) from the model
trained on all the data; its LDS is the Spearman correlation over subsets between summed
scores and measured outputs (`assay.counterfactual.lds`), mean over queries with a bootstrap
95% interval.

Methods (add one by writing `def my_method(model, data, recipe) -> np.ndarray [Q, N]` and
listing it in METHODS; a `damping` or `fisher` argument receives the flag's value):

- `influence-hessian`: ∇L_qᵀ (H + δI)⁻¹ ∇ℓ_i with H the exact Hessian of the training objective
  over all parameters (torch.func, fp64); negative eigenvalues (the MLP is not convex) clamped
  to 0, then δ = damping × mean eigenvalue added (`--damping`, default 0.1: the heuristic
  kronfluence uses when its damping_factor is None, and assay's preconditioner default;
  every method with a `damping` argument gets the same value). Under-damped, the exact
  Hessian's near-zero curvature directions dominate its inverse and its LDS falls towards 0
  (try `--damping 1e-3`); the GGN is far less sensitive.
- `influence-ggn`: the same with the Gauss-Newton matrix (PSD) instead of the Hessian.
- `assay-kfac`, `assay-ekfac`: assay's Python API (`assay.attribution.kfac_influence`): K-FAC /
  EK-FAC factors of the two linear layers' weights (assay does not attribute biases), δ =
  damping × each module's mean eigenvalue, unprojected gradients. `assay-kfac-bf16`,
  `assay-ekfac-bf16`: the same with the forwards and backwards under bf16 autocast (the factors
  still accumulated in fp32 and decomposed in fp64).
- `kronfluence-kfac`, `kronfluence-ekfac`: kronfluence (the reference EK-FAC) on the same model,
  batches, labels (`--fisher`) and damping rule (its damping_factor=None heuristic, scaled to
  `--damping`); it also attributes the biases. Only where kronfluence is installed (the peers'
  venv, `make test-interop`); elsewhere they are skipped with a note.
- `assay-kfac+b`, `assay-ekfac+b`: assay on the same function with each bias folded into its
  weight (kronfluence's parameters), to show what the biases account for.
- `inner`: ∇L_q · ∇ℓ_i.  `cosine`: the same between unit-normalised gradients.

Every method is timed end to end from the trained model (factors included), best of
`--repeats`; "peak MiB" is the growth of the process's resident memory while its first run
ran, sampled every 5 ms after freed memory is handed back to the OS (approximate: a peak
shorter than 5 ms can be missed, and for this tiny model it is mostly torch's workspace).

The margin is log p_y - log(1 - p_y) = z_y - logsumexp_{k≠y} z_k; cross-entropy equals
softplus(-margin), so per query the loss and margin columns must agree (a check, not news).

    .venv/bin/python bench/lds_classifier.py                      # defaults: M = 100, α = 0.5
    .venv/bin/python bench/lds_classifier.py --num_subsets 32 --methods inner cosine
    PYTHONPATH=. .venv-peers/bin/python bench/lds_classifier.py   # with kronfluence's columns

Figures printed by this script are provisional (timings on a shared machine are noisy).
"""

from __future__ import annotations

import argparse
import copy
import ctypes
import gc
import inspect
import json
import logging
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.func import functional_call, grad, jacrev, vmap

from assay.core.memory import PeakResident
from assay.counterfactual.lds import LDSResult, linear_datamodel_score, sample_subsets

sys.path.insert(0, str(Path(__file__).parent))
from lds_kfac import (  # noqa: E402
    against_kronfluence,
    assay_ekfac,
    assay_ekfac_bf16,
    assay_ekfac_bias,
    assay_kfac,
    assay_kfac_bf16,
    assay_kfac_bias,
    kronfluence_ekfac,
    kronfluence_kfac,
    unavailable,
)
from machine import header, machine  # noqa: E402  (the benchmarks' shared record of CPU, ISA and load)


@dataclass(frozen=True)
class Recipe:
    """The data and the training run: everything a retrained subset model shares."""

    dim: int = 32
    """Input features."""
    hidden: int = 64
    """Hidden width of the MLP."""
    classes: int = 10
    """Mixture components = classes."""
    separation: float = 0.6
    """Spread of the class means (× a unit-variance noise): sets how hard the task is."""
    label_noise: float = 0.05
    """Fraction of training labels replaced by a random class, so some examples hurt."""
    n_train: int = 1000
    """Training examples (the pool subsets are drawn from)."""
    n_query: int = 50
    """Held-out query examples."""
    steps: int = 300
    """Full-batch Adam steps."""
    lr: float = 0.01
    """Adam learning rate."""
    weight_decay: float = 1e-2
    """L2 coefficient: objective = mean cross-entropy + weight_decay/2 · |θ|²."""
    data_seed: int = 0
    """Seed of the synthetic data."""
    init_seed: int = 0
    """Seed of the initial weights, the same for every retrained model."""


@dataclass(frozen=True)
class Data:
    """Training set and queries (float32 features, int64 labels)."""

    x: torch.Tensor
    """[N, dim] training features."""
    y: torch.Tensor
    """[N] training labels."""
    xq: torch.Tensor
    """[Q, dim] query features."""
    yq: torch.Tensor
    """[Q] query labels."""


def make_data(recipe: Recipe) -> Data:
    """A Gaussian mixture: class means ~ N(0, separation² I), unit-variance noise, some labels flipped."""
    rng = np.random.default_rng(recipe.data_seed)
    means = rng.normal(size=(recipe.classes, recipe.dim)) * recipe.separation
    n = recipe.n_train + recipe.n_query
    labels = rng.integers(0, recipe.classes, size=n)
    x = means[labels] + rng.normal(size=(n, recipe.dim))
    noisy = rng.random(recipe.n_train) < recipe.label_noise
    labels[: recipe.n_train][noisy] = rng.integers(0, recipe.classes, size=int(noisy.sum()))
    xt, yt = torch.from_numpy(x).float(), torch.from_numpy(labels).long()
    return Data(xt[: recipe.n_train], yt[: recipe.n_train], xt[recipe.n_train :], yt[recipe.n_train :])


def build_model(recipe: Recipe) -> nn.Module:
    """The MLP at its fixed initialisation."""
    torch.manual_seed(recipe.init_seed)
    return nn.Sequential(
        nn.Linear(recipe.dim, recipe.hidden), nn.GELU(), nn.Linear(recipe.hidden, recipe.classes)
    )


def train(recipe: Recipe, x: torch.Tensor, y: torch.Tensor) -> nn.Module:
    """The fixed recipe: full-batch Adam from the fixed initialisation (deterministic).

    Adam's (coupled) weight_decay adds weight_decay·θ to the gradient: the gradient of the
    objective mean CE + weight_decay/2 · |θ|² whose Hessian the influence methods use.
    """
    model = build_model(recipe)
    opt = torch.optim.Adam(model.parameters(), lr=recipe.lr, weight_decay=recipe.weight_decay, fused=True)
    for _ in range(recipe.steps):
        opt.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return model.eval()


@torch.no_grad()
def query_outputs(model: nn.Module, xq: torch.Tensor, yq: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """Per query: cross-entropy loss [Q] and margin z_y - logsumexp_{k≠y} z_k [Q], in fp64."""
    logits = copy.deepcopy(model).double()(xq.double())  # [Q, C]
    loss = nn.functional.cross_entropy(logits, yq, reduction="none")
    others = logits.scatter(1, yq[:, None], float("-inf"))
    margin = logits.gather(1, yq[:, None])[:, 0] - torch.logsumexp(others, dim=1)
    return loss.numpy(), margin.numpy()


def ground_truth(recipe: Recipe, data: Data, masks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Retrain on every subset: losses [M, Q] and margins [M, Q]."""
    losses, margins = [], []
    for mask in masks:
        keep = torch.from_numpy(mask)
        loss, margin = query_outputs(train(recipe, data.x[keep], data.y[keep]), data.xq, data.yq)
        losses.append(loss)
        margins.append(margin)
    return np.stack(losses), np.stack(margins)


# ---------------------------------------------------------------------------------------------
# Attribution methods: (trained model, data, recipe) -> scores [Q, N], positive = proponent


class Flat:
    """The model as functions of one flat fp64 parameter vector θ [P] (for torch.func)."""

    def __init__(self, model: nn.Module) -> None:
        params = {k: v.detach().double() for k, v in model.named_parameters()}
        self.model = model
        self.shapes = {k: v.shape for k, v in params.items()}
        self.sizes = [v.numel() for v in params.values()]
        self.theta = torch.cat([v.reshape(-1) for v in params.values()])  # [P]

    def logits(self, theta: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """[B, C] logits of x [B, d] under parameters θ."""
        params = {k: t.view(self.shapes[k]) for k, t in zip(self.shapes, theta.split(self.sizes))}
        return functional_call(self.model, params, (x.double(),))

    def loss(self, theta: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy of x [B, d], y [B] under θ."""
        return nn.functional.cross_entropy(self.logits(theta, x), y)


def per_example_grads(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """[B, P] fp64 gradient of each example's cross-entropy (no weight decay: it is not per example)."""
    flat = Flat(model)
    return vmap(grad(flat.loss), in_dims=(None, 0, 0))(flat.theta, x[:, None], y[:, None])


def hessian(model: nn.Module, data: Data, recipe: Recipe) -> torch.Tensor:
    """[P, P] fp64 Hessian of the training objective at the trained weights (reverse over reverse)."""
    flat = Flat(model)
    h = jacrev(grad(flat.loss), chunk_size=256)(flat.theta, data.x, data.y)
    return h + recipe.weight_decay * torch.eye(len(flat.theta), dtype=h.dtype)


def gauss_newton(model: nn.Module, data: Data, recipe: Recipe, batch: int = 200) -> torch.Tensor:
    """[P, P] fp64 GGN of the objective: mean of Jᵀ(diag p - p pᵀ)J over examples, + weight decay."""
    flat = Flat(model)
    theta, logits = flat.theta, flat.logits
    total = torch.zeros(len(theta), len(theta), dtype=torch.float64)
    for start in range(0, len(data.x), batch):
        x = data.x[start : start + batch]
        jac = vmap(jacrev(logits), in_dims=(None, 0))(theta, x[:, None])[:, 0]  # [B, C, P]
        p = torch.softmax(logits(theta, x), dim=1)  # [B, C]
        h_out = torch.diag_embed(p) - p[:, :, None] * p[:, None, :]  # [B, C, C]
        left = torch.einsum("bcd,bdp->bcp", h_out, jac).reshape(-1, len(theta))  # [B*C, P]
        total += jac.reshape(-1, len(theta)).T @ left
    return total / len(data.x) + recipe.weight_decay * torch.eye(len(theta), dtype=torch.float64)


def _inverse_influence(curvature: torch.Tensor, model: nn.Module, data: Data, damping: float) -> np.ndarray:
    """∇L_qᵀ (C⁺ + δI)⁻¹ ∇ℓ_i: eigenvalues clamped at 0, δ = damping × mean clamped eigenvalue."""
    vals, vecs = torch.linalg.eigh(curvature)  # fp64
    vals = vals.clamp(min=0.0)
    vals = vals + damping * vals.mean()
    gq = per_example_grads(model, data.xq, data.yq)  # [Q, P]
    gi = per_example_grads(model, data.x, data.y)  # [N, P]
    return (((gq @ vecs) / vals) @ (vecs.T @ gi.T)).numpy()


def influence_hessian(model: nn.Module, data: Data, recipe: Recipe, damping: float = 0.1) -> np.ndarray:
    """Influence with the exact Hessian of the objective (fp64, non-convex directions clamped)."""
    return _inverse_influence(hessian(model, data, recipe), model, data, damping)


def influence_ggn(model: nn.Module, data: Data, recipe: Recipe, damping: float = 0.1) -> np.ndarray:
    """Influence with the Gauss-Newton matrix of the objective (fp64)."""
    return _inverse_influence(gauss_newton(model, data, recipe), model, data, damping)


def inner(model: nn.Module, data: Data, recipe: Recipe) -> np.ndarray:
    """Plain gradient inner product ∇L_q · ∇ℓ_i."""
    return (per_example_grads(model, data.xq, data.yq) @ per_example_grads(model, data.x, data.y).T).numpy()


def cosine(model: nn.Module, data: Data, recipe: Recipe) -> np.ndarray:
    """Cosine between the query's and the training example's gradients."""
    gq = nn.functional.normalize(per_example_grads(model, data.xq, data.yq), dim=1)
    gi = nn.functional.normalize(per_example_grads(model, data.x, data.y), dim=1)
    return (gq @ gi.T).numpy()


METHODS: dict[str, Callable[..., np.ndarray]] = {
    "influence-hessian": influence_hessian,
    "influence-ggn": influence_ggn,
    "assay-kfac": assay_kfac,
    "assay-ekfac": assay_ekfac,
    "assay-kfac-bf16": assay_kfac_bf16,
    "assay-ekfac-bf16": assay_ekfac_bf16,
    "assay-kfac+b": assay_kfac_bias,
    "assay-ekfac+b": assay_ekfac_bias,
    "kronfluence-kfac": kronfluence_kfac,
    "kronfluence-ekfac": kronfluence_ekfac,
    "inner": inner,
    "cosine": cosine,
}
"""Columns of the table, in order."""

# ---------------------------------------------------------------------------------------------
# The run


def release_free_memory() -> None:
    """Hand memory the allocator keeps back to the OS (glibc), so the next method's growth is its own."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: the growth may read low after a big method
        pass


class PeakMemory(PeakResident):
    """The growth of the resident set while it runs, sampled every 5 ms (`mib`), after what earlier
    methods left is freed (not counted as this one's)."""

    def __init__(self) -> None:
        super().__init__(interval=0.005)

    def __enter__(self) -> PeakMemory:
        gc.collect()
        release_free_memory()
        super().__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        self.mib = (self.gb - self.start_gb) * 1024


def cached_ground_truth(recipe: Recipe, masks: np.ndarray, data: Data, cache: Path | None):
    """Ground truth from `cache` when it was made with this recipe and these subsets, else retrain."""
    key = json.dumps(asdict(recipe), sort_keys=True)
    if cache is not None and cache.exists():
        saved = np.load(cache)
        if str(saved["recipe"]) == key and np.array_equal(saved["masks"], masks):
            return saved["losses"], saved["margins"], 0.0
        print(f"{cache} was made with another recipe or subsets: retraining")
    start = time.perf_counter()
    losses, margins = ground_truth(recipe, data, masks)
    seconds = time.perf_counter() - start
    if cache is not None:
        np.savez(cache, recipe=key, masks=masks, losses=losses, margins=margins)
    return losses, margins, seconds


def fmt(r: LDSResult) -> str:
    """Mean LDS and its interval, as the table shows them."""
    return f"{r.mean:6.3f} [{r.ci_low:.3f}, {r.ci_high:.3f}]"


def trained_model(recipe: Recipe, data: Data) -> nn.Module:
    """The model trained on all the data (the one attributed), with its accuracy and time printed."""
    start = time.perf_counter()
    model = train(recipe, data.x, data.y)
    seconds = time.perf_counter() - start
    with torch.no_grad():
        train_acc = (model(data.x).argmax(1) == data.y).float().mean().item()
        query_acc = (model(data.xq).argmax(1) == data.yq).float().mean().item()
    params = sum(p.numel() for p in model.parameters())
    shape = f"{recipe.dim}-{recipe.hidden}-{recipe.classes}"
    print(f"MLP {shape} ({params:,} parameters), N = {recipe.n_train}, Q = {recipe.n_query}")
    print(
        f"full-data model: train acc {train_acc:.3f}, query acc {query_acc:.3f}, trained in {seconds:.2f} s"
    )
    return model


def run_method(name: str, model: nn.Module, data: Data, recipe: Recipe, options: dict) -> np.ndarray:
    """Scores [Q, N] of one method; it gets the `options` (damping, fisher) its signature names."""
    method = METHODS[name]
    wanted = inspect.signature(method).parameters
    return method(model, data, recipe, **{k: v for k, v in options.items() if k in wanted})


def measure(name: str, model: nn.Module, data: Data, recipe: Recipe, args) -> tuple[np.ndarray, dict]:
    """(scores, {seconds: best of the repeats, every repeat's, peak resident growth MiB of the first})."""
    options = {"damping": args.damping, "fisher": args.fisher}
    times, peaks = [], []
    for _ in range(args.repeats):
        with PeakMemory() as memory:
            start = time.perf_counter()
            scores = run_method(name, model, data, recipe, options)  # [Q, N], deterministic
            times.append(time.perf_counter() - start)
        peaks.append(memory.mib)
    return scores, {"seconds": min(times), "seconds_each": times, "peak_rss_mib": peaks[0]}


def parse_args() -> argparse.Namespace:
    """Command-line flags (the recipe itself is fixed: see Recipe)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num_subsets", type=int, default=100, help="M, retrained subsets")
    ap.add_argument("--alpha", type=float, default=0.5, help="fraction of the training set per subset")
    ap.add_argument("--subset_seed", type=int, default=0)
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    ap.add_argument("--damping", type=float, default=0.1, help="δ = damping × mean eigenvalue")
    ap.add_argument(
        "--fisher",
        choices=["empirical", "sampled"],
        default="empirical",
        help="K-FAC factors' labels: the data's, or drawn from the model (kronfluence's default)",
    )
    ap.add_argument("--repeats", type=int, default=1, help="time each method this many times (best kept)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1 is fastest for this tiny MLP)")
    ap.add_argument("--cache", type=Path, help="an .npz to keep the ground truth in between runs")
    ap.add_argument("--json", type=Path, help="write the results here")
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    logging.getLogger("assay").setLevel(logging.WARNING)  # no progress bars: the table is the output
    recipe = Recipe()
    info = machine()
    line = header(info)
    print(line)
    print("figures are provisional: timings on a shared machine are noisy")
    data = make_data(recipe)
    model = trained_model(recipe, data)
    masks = sample_subsets(recipe.n_train, args.num_subsets, args.alpha, args.subset_seed)
    losses, margins, truth_s = cached_ground_truth(recipe, masks, data, args.cache)
    print(f"ground truth: M = {args.num_subsets} subsets of α = {args.alpha}: {truth_s:.1f} s (0 = cached)")
    print(f"damping {args.damping} × mean eigenvalue; K-FAC factors on the {args.fisher} Fisher")

    rows, scores, skipped = {}, {}, {}
    print(
        f"{'method':<18} {'LDS (loss) [95% CI]':<26} {'LDS (margin)':<26} {'undef':>5} "
        f"{'time s':>7} {'peak MiB':>8}"
    )
    for name in args.methods:
        reason = unavailable(name)
        if reason is not None:
            skipped[name] = reason
            print(f"{name:<18} skipped: {reason}")
            continue
        scores[name], timing = measure(name, model, data, recipe, args)
        by_loss = linear_datamodel_score(scores[name], masks, losses)
        by_margin = linear_datamodel_score(scores[name], masks, margins, higher_is_better=True)
        rows[name] = {"loss": by_loss.to_dict(), "margin": by_margin.to_dict(), **timing}
        print(
            f"{name:<18} {fmt(by_loss):<26} {fmt(by_margin):<26} {by_loss.num_undefined:>5} "
            f"{timing['seconds']:>7.2f} {timing['peak_rss_mib']:>8.1f}"
        )
    against_kronfluence(rows, scores)
    if args.json is not None:
        flags = {k: str(v) for k, v in vars(args).items()}
        out = {"machine": info, "recipe": asdict(recipe), "args": flags, "truth_seconds": truth_s}
        args.json.write_text(json.dumps({**out, "methods": rows, "skipped": skipped}, indent=1))


if __name__ == "__main__":
    main()
