"""Scoring an SAE against known ground-truth features (synthetic data), as SAELens's
`sae_lens.synthetic` (SynthSAEBench) does.

  MCC (mean correlation coefficient): |cosine| between every SAE decoder row and every true
      feature direction; a one-to-one matching maximising their sum (the Hungarian algorithm,
      `linear_sum_assignment`); the mean |cosine| over the matched pairs (min(n_latents,
      n_features) of them).
  Classification (precision, recall, F1, accuracy): each latent is matched to the true feature
      its decoder row is closest to (largest |cosine|, several latents may share one); on
      evaluation samples it "predicts" that feature firing when it is active (!= 0). Per-latent
      precision TP / (TP + FP), recall TP / (TP + FN) (0 where undefined), F1 their harmonic
      mean (0 where both are 0), accuracy (TP + TN) / total; each averaged over latents.
  Chance F1: the F1 each latent would score firing as often as it does but independently of
      its feature (precision = the feature's firing rate, recall = the latent's), averaged over
      latents. F1 rewards firing often before it rewards recovery: a latent firing on half the
      samples scores 0.44 against a feature firing on 40%, knowing nothing. An F1 means recovery
      only by its margin over this one.

A ground-truth file (safetensors) holds `feature_vectors` [F, d], `eval_acts` [M, d] (the
hidden activations of M evaluation samples) and `eval_fires` [M, F] bool (which true features
fire in each); `bench/bench_sae_synthetic.py` writes one from SAELens's generator.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file
from torch import Tensor

from assay.core.errors import AssayError

GT_KEYS = ("feature_vectors", "eval_acts", "eval_fires")


def linear_sum_assignment(cost: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(rows, cols) of a minimum-cost one-to-one assignment of a [n, m] cost matrix: min(n, m)
    pairs, rows ascending (scipy.optimize.linear_sum_assignment's result, without scipy).

    The Hungarian algorithm with potentials (shortest augmenting paths, O(n^2 m)); the scan
    over columns is vectorised, so each row costs a few numpy passes per column visited.
    """
    c = np.asarray(cost, dtype=np.float64)
    if not np.isfinite(c).all():
        raise ValueError("linear_sum_assignment: the cost matrix must be finite")
    transposed = c.shape[0] > c.shape[1]
    if transposed:
        c = c.T
    n, m = c.shape
    u, v = np.zeros(n + 1), np.zeros(m + 1)  # row / column potentials (index 0: virtual)
    owner = np.zeros(m + 1, dtype=np.int64)  # owner[j]: 1-based row assigned to column j (0: free)
    way = np.zeros(m + 1, dtype=np.int64)  # previous column on the shortest path
    for i in range(1, n + 1):
        owner[0], j0 = i, 0
        minv = np.full(m + 1, np.inf)
        used = np.zeros(m + 1, dtype=bool)
        while owner[j0] != 0:
            used[j0] = True
            i0 = owner[j0]
            reduced = c[i0 - 1] - u[i0] - v[1:]  # [m] reduced costs from row i0
            better = ~used[1:] & (reduced < minv[1:])
            minv[1:][better] = reduced[better]
            way[1:][better] = j0
            free_min = np.where(used[1:], np.inf, minv[1:])
            j1 = int(free_min.argmin()) + 1
            delta = free_min[j1 - 1]
            u[owner[used]] += delta
            v[used] -= delta
            minv[~used] -= delta
            j0 = j1
        while j0:  # augment along the path
            j1 = way[j0]
            owner[j0] = owner[j1]
            j0 = j1
    cols = np.nonzero(owner[1:])[0]
    rows = owner[1:][cols] - 1
    if transposed:
        rows, cols = cols, rows
    order = np.argsort(rows)
    return rows[order], cols[order]


def abs_cosines(a: Tensor, b: Tensor) -> Tensor:
    """[n, F] |cosine| between the rows of a [n, d] and b [F, d] (fp64)."""
    a64, b64 = a.double(), b.double()
    a64 = a64 / a64.norm(dim=1, keepdim=True).clamp_min(1e-12)
    b64 = b64 / b64.norm(dim=1, keepdim=True).clamp_min(1e-12)
    return (a64 @ b64.T).abs()


def fastest_assignment() -> Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """scipy's linear_sum_assignment where scipy is installed, else `linear_sum_assignment`.

    Both return an optimal assignment, so the MCC is the same. scipy's compiled solver took 2.8 s
    at 4,096 and 13.6 s at 8,192 random unit rows here, so about a minute at SynthSAEBench's
    16,384; the numpy one runs a Python loop per row and visited column. assay does not require
    scipy.
    """
    try:
        from scipy.optimize import linear_sum_assignment as compiled  # optional, see above
    except ImportError:
        return linear_sum_assignment
    return compiled  # type: ignore[no-any-return]


def mean_correlation_coefficient(decoder: Tensor, features: Tensor) -> float:
    """MCC of decoder rows [n, d] against true feature directions [F, d] (module docstring)."""
    sims = abs_cosines(decoder, features).cpu().numpy()
    rows, cols = fastest_assignment()(1.0 - sims)
    return float(sims[rows, cols].mean())


@dataclass
class Classification:
    """Latents as detectors of their best-matching true feature, averaged over latents."""

    precision: float
    """Mean of TP / (TP + FP)."""
    recall: float
    """Mean of TP / (TP + FN)."""
    f1: float
    """Mean per-latent F1."""
    accuracy: float
    """Mean of (TP + TN) / samples."""
    chance_f1: float
    """Mean F1 of a latent firing at its own rate independently of its feature (module docstring)."""


class ClassificationCounts:
    """Accumulates per-latent TP / FP / FN / TN over batches of evaluation samples."""

    def __init__(self, decoder: Tensor, features: Tensor):
        self.best = abs_cosines(decoder, features).argmax(dim=1)  # [n] each latent's feature
        n = len(self.best)
        self.tp, self.fp, self.fn, self.tn = (torch.zeros(n, dtype=torch.float64) for _ in range(4))

    def update(self, latents: Tensor, true_fires: Tensor) -> None:
        """latents [M, n] activations; true_fires [M, F] bool."""
        fires = latents != 0
        truth = true_fires[:, self.best.to(true_fires.device)].bool()  # [M, n]
        self.tp += (fires & truth).sum(0).double().cpu()
        self.fp += (fires & ~truth).sum(0).double().cpu()
        self.fn += (~fires & truth).sum(0).double().cpu()
        self.tn += (~fires & ~truth).sum(0).double().cpu()

    def result(self) -> Classification:
        tp, fp, fn, tn = self.tp, self.fp, self.fn, self.tn
        precision = torch.where(tp + fp > 0, tp / (tp + fp).clamp_min(1), torch.zeros_like(tp))
        recall = torch.where(tp + fn > 0, tp / (tp + fn).clamp_min(1), torch.zeros_like(tp))
        samples = (tp + fp + fn + tn).clamp_min(1)
        accuracy = (tp + tn) / samples
        # by chance: precision is the feature's firing rate, recall the latent's
        chance = _harmonic_mean((tp + fn) / samples, (tp + fp) / samples)
        f1 = _harmonic_mean(precision, recall)
        return Classification(
            float(precision.mean()),
            float(recall.mean()),
            float(f1.mean()),
            float(accuracy.mean()),
            float(chance.mean()),
        )


def _harmonic_mean(a: Tensor, b: Tensor) -> Tensor:
    """2ab / (a + b) elementwise, 0 where both are 0 (an F1 from its precision and recall)."""
    both = a + b
    return torch.where(both > 0, 2 * a * b / both.clamp_min(1e-300), torch.zeros_like(a))


def load_ground_truth(path: Path | str) -> dict[str, Tensor]:
    """A ground-truth file's tensors (module docstring), checked for the keys and shapes."""
    path = Path(path)
    if not path.exists():
        raise AssayError(f"ground-truth file {path} does not exist")
    gt = load_file(str(path))
    missing = [k for k in GT_KEYS if k not in gt]
    if missing:
        raise AssayError(f"{path} lacks {', '.join(missing)}; write it with bench/bench_sae_synthetic.py")
    f, d = gt["feature_vectors"].shape
    if gt["eval_acts"].shape[1] != d or tuple(gt["eval_fires"].shape) != (len(gt["eval_acts"]), f):
        raise AssayError(f"{path}: feature_vectors, eval_acts and eval_fires have mismatched shapes")
    return gt


class BatchTopKEncoding:
    """An SAE that encodes each batch by batch top-k: the k·B largest ReLU'd pre-activations of a
    batch of B samples (SAELens's `BatchTopK` activation), instead of its own inference rule.

    BatchTopK and Matryoshka SAEs train with this rule and are saved with a threshold that stands
    in for it; SynthSAEBench's runner scores the training SAE, so its published figures are at
    L0 = k whatever the saved threshold is (docs/sae.md, "Ground truth"). Everything but `encode`
    is the wrapped SAE's own."""

    def __init__(self, sae: Any, k: int):
        self.sae, self.k = sae, k

    def __getattr__(self, name: str) -> Any:
        return getattr(self.sae, name)

    @torch.no_grad()
    def encode(self, x: Tensor) -> Tensor:
        acts = self.sae.pre_acts(x).relu()
        flat = acts.flatten()
        kept = flat.topk(min(self.k * x.shape[0], flat.numel()))
        return torch.zeros_like(flat).scatter_(0, kept.indices, kept.values).view_as(acts)


def ground_truth_metrics(sae: Any, gt: dict[str, Tensor], batch: int = 4096) -> dict[str, float]:
    """MCC, F1 (precision, recall, accuracy), L0, FVU and the dead fraction (latents that never
    fire on the evaluation samples) of an SAE on raw activations (act_scale folded or applied)."""
    mcc = mean_correlation_coefficient(sae.W_dec.detach().float(), gt["feature_vectors"])
    return {"mcc": mcc, **detection_metrics(sae, gt, batch)}


@torch.no_grad()
def detection_metrics(sae: Any, gt: dict[str, Tensor], batch: int = 4096) -> dict[str, float]:
    """`ground_truth_metrics` but the MCC (whose assignment is the slow part at large widths)."""
    x = gt["eval_acts"].float()
    decoder = sae.W_dec.detach().float()
    counts = ClassificationCounts(decoder, gt["feature_vectors"])
    fired = torch.zeros(sae.d_sae, dtype=torch.bool)
    sq_err = active = 0.0
    for i in range(0, len(x), batch):
        xb = x[i : i + batch]  # [B, d]
        z = sae.encode(xb * sae.act_scale)  # [B, d_sae]
        sq_err += float((sae.decode(z) / sae.act_scale - xb).double().pow(2).sum())
        active += float((z != 0).sum())
        fired |= (z != 0).any(0).cpu()
        counts.update(z, gt["eval_fires"][i : i + batch])
    x64 = x.double()
    cls = counts.result()
    return {
        "f1": cls.f1,
        "f1_chance": cls.chance_f1,
        "precision": cls.precision,
        "recall": cls.recall,
        "accuracy": cls.accuracy,
        "l0": active / max(len(x), 1),
        "fvu": sq_err / max(float((x64 - x64.mean(0)).pow(2).sum()), 1e-30),
        "dead_fraction_eval": float((~fired).double().mean()),
    }
