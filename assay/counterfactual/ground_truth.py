"""Counterfactual ground truth: what each query's loss actually is after retraining on subsets.

For M random α-subsets of the training pool (`lds.sample_subsets`), the recipe is retrained on
each subset and every query's output is measured. The result, `GroundTruth`, is what any
attribution method's LDS is computed against (`lds.linear_datamodel_score`).

Two ways in:
- any model, from Python: `retrain_subsets(train_and_measure, masks)` calls your function once
  per subset (it trains on `mask` and returns the [Q] outputs: losses or margins);
- a causal LM fine-tuned by assay's recipe: `ground_truth_jobs` / `run_job` (used by
  `assay validate`), one job per subset, resumable and shardable over torchrun ranks.

LM subset runs leave examples out in one of two ways (`RetrainSetup.removal`):
- "skip": the full run's visit order restricted to the subset (as `assay finetune --ordered`
  does), so subsets differ only in which examples they hold, not in when they are seen; the
  batches close up over the gaps, so a subset runs fewer, differently composed steps;
- "weight": the full run's own batches and steps, the left-out examples' loss weights 0 and each
  step's loss still divided by its whole batch's tokens. This is the counterfactual the
  metagradients (`--methods replay`) differentiate, and the one bergson's LDS retrains.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from assay.core.distributed import Distributed
from assay.core.errors import AssayError
from assay.core.runs import read_json, write_json
from assay.counterfactual.lds import sample_subsets
from assay.lm.data import Examples
from assay.lm.losses import evaluate_losses
from assay.lm.models import load_model
from assay.lm.queries import Queries
from assay.training.finetune import FinetuneConfig, TrainData, Trainer
from assay.training.subset import restricted_plan, shuffled_plan

MASKS_FILE, OUTPUTS_FILE, IDS_FILE, META_FILE = "masks.npy", "outputs.npy", "ids.npy", "ground_truth.json"


@dataclass
class GroundTruth:
    """Subsets [M, N] of a pool, and what was measured on each query after retraining on each."""

    masks: np.ndarray
    """[M, N] bool: subset m holds training example n (in the order of `ids`)."""
    outputs: np.ndarray
    """[M, Q] float64: query q's output (summed loss, nats) under the model trained on subset m."""
    ids: np.ndarray
    """[N] int64: the pool's example ids, the columns of `masks` (and of every scores matrix)."""
    query_ids: list[Any]
    """[Q] the queries' ids (source rows, or "text:i")."""
    query_texts: list[str]
    """[Q] the queries' texts (a score run's queries must be these)."""
    full_outputs: np.ndarray | None = None
    """[Q] the outputs under the model trained on the whole pool (for reference)."""
    higher_is_better: bool = False
    """False: outputs are losses. True: margins, log-probabilities and the like."""

    def save(self, folder: Path, extra: dict[str, Any] | None = None) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        np.save(folder / MASKS_FILE, self.masks)
        np.save(folder / OUTPUTS_FILE, self.outputs)
        np.save(folder / IDS_FILE, self.ids)
        full = None if self.full_outputs is None else [float(x) for x in self.full_outputs]
        meta = {"query_ids": self.query_ids, "query_texts": self.query_texts, "full_outputs": full}
        write_json(folder / META_FILE, {**meta, "higher_is_better": self.higher_is_better, **(extra or {})})

    @classmethod
    def load(cls, folder: Path) -> GroundTruth:
        if not (folder / META_FILE).exists():
            raise AssayError(f"{folder} holds no ground truth ({META_FILE}); run `assay validate` to make it")
        meta = read_json(folder / META_FILE)
        full = meta.get("full_outputs")
        return cls(
            masks=np.load(folder / MASKS_FILE, allow_pickle=False),
            outputs=np.load(folder / OUTPUTS_FILE, allow_pickle=False),
            ids=np.load(folder / IDS_FILE, allow_pickle=False),
            query_ids=list(meta["query_ids"]),
            query_texts=list(meta["query_texts"]),
            full_outputs=None if full is None else np.asarray(full, dtype=np.float64),
            higher_is_better=bool(meta.get("higher_is_better", False)),
        )


def retrain_subsets(train_and_measure: Callable[[np.ndarray], np.ndarray], masks: np.ndarray) -> np.ndarray:
    """[M, Q] outputs: `train_and_measure(mask [N] bool) -> [Q]` called once per subset.

    The Python API for any model (a classifier's margins, a regression's losses): train from the
    same start with the same recipe on the examples where `mask` is true, return what to predict."""
    rows = [np.asarray(train_and_measure(mask.copy()), dtype=np.float64).reshape(-1) for mask in masks]
    if len({len(r) for r in rows}) != 1:
        raise AssayError("train_and_measure returned outputs of different lengths for different subsets")
    return np.stack(rows)


# --- causal LMs fine-tuned by assay's recipe --------------------------------------------------------
@dataclass
class RetrainSetup:
    """What every retraining job shares: the recipe, the pool, the queries, the tokenizer."""

    recipe_cfg: FinetuneConfig
    """The full run's finetune config (its out is the full run's folder)."""
    pool: Examples
    queries: Queries
    pad_id: int
    policy: Any
    token_batch_size: int
    removal: str = "skip"
    """How a subset leaves examples out: "skip" or "weight" (the module docstring)."""


def subset_masks(n: int, num_subsets: int, alpha: float, seed: int) -> np.ndarray:
    """[M, N] the seeded α-subsets (subset m depends on (seed, m) only)."""
    return sample_subsets(n, num_subsets, alpha, seed)


def job_file(folder: Path, m: int) -> Path:
    return folder / f"subset_{m:04d}.json"


def run_subset(setup: RetrainSetup, mask: np.ndarray, m: int, folder: Path) -> None:
    """Retrain the recipe on subset m (alone in this process), measure every query, save atomically."""
    cfg = setup.recipe_cfg
    ids = setup.pool.ids[mask]
    full_plan = shuffled_plan(setup.pool.ids, cfg.recipe.num_epochs, cfg.runtime.seed)
    if setup.removal == "weight":
        data = TrainData(setup.pool, None, None, full_plan, mask.astype(np.float64), weight_tokens=False)
    else:
        data = TrainData(
            setup.pool.subset(setup.pool.positions_of(ids)), None, None, restricted_plan(full_plan, ids)
        )
    with Distributed.alone(), tempfile.TemporaryDirectory(dir=folder) as scratch:
        quiet = replace(cfg, out=scratch, save_every=0, eval_every=0, log_every=10**9)
        model = load_model(cfg.model, setup.policy, cfg.runtime.attention)
        trainer = Trainer(quiet, model, data, setup.policy, setup.pad_id, Path(scratch))
        trainer.run()
        losses = query_losses(model, setup)
    write_json(job_file(folder, m), {"subset": m, "examples": int(mask.sum()), "outputs": losses.tolist()})


def query_losses(model: Any, setup: RetrainSetup) -> np.ndarray:
    """[Q] summed loss (nats) of each query under `model`, in eval mode."""
    model.eval()
    return evaluate_losses(
        model, setup.queries.examples, setup.policy, setup.pad_id, setup.token_batch_size, desc="queries"
    )


def collect_outputs(folder: Path, num_subsets: int, num_queries: int) -> np.ndarray:
    """[M, Q] from the per-subset files (every one must be there)."""
    outputs = np.zeros((num_subsets, num_queries), dtype=np.float64)
    for m in range(num_subsets):
        saved = read_json(job_file(folder, m))
        if len(saved["outputs"]) != num_queries:
            found = len(saved["outputs"])
            raise AssayError(
                f"{job_file(folder, m)} measured {found} queries, not {num_queries}; delete it to redo"
            )
        outputs[m] = saved["outputs"]
    return outputs
