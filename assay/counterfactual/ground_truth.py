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
from assay.core.errors import AssayError, first_line
from assay.core.paths import as_path
from assay.core.runs import read_json, write_json
from assay.counterfactual.lds import as_array, sample_subsets
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

    def save(
        self, folder: Path | str, extra: dict[str, Any] | None = None, *, overwrite: bool = False
    ) -> None:
        """Write the ground truth into `folder` (created if needed; other files there are left alone).

        An earlier ground truth there (any of its files) is refused unless `overwrite=True`."""
        folder = as_path(folder, "GroundTruth.save's folder")
        masks, outputs, ids = as_array(self.masks), as_array(self.outputs), as_array(self.ids)
        full = None if self.full_outputs is None else as_array(self.full_outputs)
        _check_sizes(masks, outputs, ids, self.query_ids, self.query_texts, full, "this GroundTruth")
        _check_destination(folder, overwrite)
        folder.mkdir(parents=True, exist_ok=True)
        # ground_truth.json goes first and comes last: a save cut short leaves no folder that
        # `load` takes for a whole ground truth
        (folder / META_FILE).unlink(missing_ok=True)
        np.save(folder / MASKS_FILE, masks)
        np.save(folder / OUTPUTS_FILE, outputs)
        np.save(folder / IDS_FILE, ids)
        meta = {
            "query_ids": [x.item() if isinstance(x, np.generic) else x for x in self.query_ids],
            "query_texts": list(self.query_texts),
            "full_outputs": None if full is None else [float(x) for x in full],
        }
        write_json(folder / META_FILE, {**meta, "higher_is_better": self.higher_is_better, **(extra or {})})

    @classmethod
    def load(cls, folder: Path | str) -> GroundTruth:
        folder = as_path(folder, "GroundTruth.load's folder")
        if not (folder / META_FILE).exists():
            raise AssayError(f"{folder} holds no ground truth ({META_FILE}); run `assay validate` to make it")
        meta = read_json(folder / META_FILE)
        if not isinstance(meta, dict) or not {"query_ids", "query_texts"} <= set(meta):
            raise AssayError(f"{folder / META_FILE} is not a ground truth's (no query_ids and query_texts)")
        masks, outputs, ids = (_load_array(folder, name) for name in (MASKS_FILE, OUTPUTS_FILE, IDS_FILE))
        full = meta.get("full_outputs")
        truth = cls(
            masks=masks,
            outputs=outputs,
            ids=ids,
            query_ids=list(meta["query_ids"]),
            query_texts=list(meta["query_texts"]),
            full_outputs=None if full is None else np.asarray(full, dtype=np.float64),
            higher_is_better=bool(meta.get("higher_is_better", False)),
        )
        _check_sizes(masks, outputs, ids, truth.query_ids, truth.query_texts, truth.full_outputs, str(folder))
        return truth


GROUND_TRUTH_FILES = (MASKS_FILE, OUTPUTS_FILE, IDS_FILE, META_FILE)


def _check_destination(folder: Path, overwrite: bool) -> None:
    """Refuse a file, or (without `overwrite`) a folder already holding a ground truth's files."""
    if folder.exists() and not folder.is_dir():
        raise AssayError(f"{folder} is a file; give GroundTruth.save a folder")
    held = [name for name in GROUND_TRUTH_FILES if (folder / name).exists()]
    if held and not overwrite:
        raise AssayError(
            f"{folder} already holds {held[0]}; pass overwrite=True to replace that ground truth, "
            "or choose another folder"
        )


def _load_array(folder: Path, name: str) -> np.ndarray:
    """One of the ground truth's arrays; a missing or unreadable file is one line."""
    path = folder / name
    if not path.is_file():
        raise AssayError(
            f"{folder} holds {META_FILE} but no {name}: the ground truth is incomplete; remake it"
        )
    try:
        return np.load(path, allow_pickle=False)
    except (OSError, ValueError) as e:
        raise AssayError(
            f"{path} is not a numpy array file ({first_line(e)}); remake the ground truth"
        ) from None


def _check_sizes(
    masks: np.ndarray,
    outputs: np.ndarray,
    ids: np.ndarray,
    query_ids: list[Any],
    query_texts: list[str],
    full_outputs: np.ndarray | None,
    what: str,
) -> None:
    """One line when masks [M, N], outputs [M, Q], ids [N], the queries [Q] and full_outputs [Q]
    disagree (a ground truth whose rows or columns do not line up scores nothing)."""
    if masks.ndim != 2 or outputs.ndim != 2 or ids.ndim != 1:
        raise AssayError(
            f"{what}: masks must be [subsets, examples], outputs [subsets, queries] and ids [examples]; "
            f"got masks {list(masks.shape)}, outputs {list(outputs.shape)}, ids {list(ids.shape)}"
        )
    (m, n), (m_out, q) = masks.shape, outputs.shape
    sizes = {
        "outputs' rows": (m_out, m, "masks' rows (subsets)"),
        "ids": (len(ids), n, "masks' columns (examples)"),
        "query_ids": (len(query_ids), q, "outputs' columns (queries)"),
        "query_texts": (len(query_texts), q, "outputs' columns (queries)"),
    }
    if full_outputs is not None:
        sizes["full_outputs"] = (full_outputs.size, q, "outputs' columns (queries)")
    for name, (got, want, of) in sizes.items():
        if got != want:
            raise AssayError(f"{what}: {got} {name} for {want} {of}; they must agree")


def retrain_subsets(train_and_measure: Callable[[np.ndarray], Any], masks: np.ndarray) -> np.ndarray:
    """[M, Q] outputs: `train_and_measure(mask [N] bool) -> [Q]` called once per subset.

    The Python API for any model (a classifier's margins, a regression's losses): train from the
    same start with the same recipe on the examples where `mask` is true, return what to predict.
    `masks` [M, N] are bool or 0/1 (`sample_subsets`'); each reaches the function as bool, so
    `X[mask]` selects the subset's rows."""
    masks = _subset_masks(masks)
    rows: list[np.ndarray] = []
    for m, mask in enumerate(masks):
        row = _measured(train_and_measure(mask.copy()), m)
        if rows and len(row) != len(rows[0]):
            raise AssayError(
                f"train_and_measure returned {len(row)} outputs for subset {m} but {len(rows[0])} for "
                "subset 0: return one output per query, the same queries every time"
            )
        rows.append(row)
    return np.stack(rows)


def _subset_masks(masks: Any) -> np.ndarray:
    """[M, N] bool from bool or 0/1 masks (a numpy array, a list, a tensor); one line otherwise."""
    array = as_array(masks)
    if array.ndim != 2:
        raise AssayError(
            f"masks must be 2-D [subsets, training examples] (as sample_subsets returns), got shape "
            f"{list(array.shape)}; a single subset is masks[None]"
        )
    if len(array) == 0:
        raise AssayError("masks hold no subsets: give at least one row [subsets, training examples]")
    if array.dtype != np.bool_ and not np.isin(array, (0, 1)).all():
        raise AssayError("masks must be boolean (or 0/1): True where a training example is in the subset")
    return array.astype(bool)


def _measured(output: Any, m: int) -> np.ndarray:
    """[Q] float64 of what train_and_measure returned for subset m; one line naming the subset
    when it is not finite numbers (a model that diverged, a forgotten `return`)."""
    if output is None:
        raise AssayError(
            f"train_and_measure returned None for subset {m}: return the [Q] outputs it measured"
        )
    try:
        row = as_array(output).astype(np.float64).reshape(-1)
    except (TypeError, ValueError, AssayError):  # None, text, ragged lists
        raise AssayError(
            f"train_and_measure returned {type(output).__name__} for subset {m}, not [Q] numbers"
        ) from None
    if row.size == 0:
        raise AssayError(f"train_and_measure returned no outputs for subset {m}: return one per query")
    bad = ~np.isfinite(row)
    if bad.any():
        raise AssayError(
            f"train_and_measure returned {int(bad.sum())} NaN/inf outputs for subset {m} (the first at "
            f"query {int(np.argmax(bad))}): did the model retrained on it diverge?"
        )
    return row


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
