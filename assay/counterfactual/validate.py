"""`assay validate`: how well does an attribution predict what retraining does, on your own setup?

Stages, in the experiment folder OUT (written in place, resumable, see core/experiment.py):

    data/                       the preset's pool and query files (--preset abc)
    full/                       the recipe fine-tuned on the whole pool: the model attributed
    ground_truth/               subset_NNNN.json per retrained subset (resumable one by one), then
                                masks.npy [M, N], outputs.npy [M, Q], ids.npy, ground_truth.json
    index/KIND-PRECISION/       the pool's gradient indexes under full/model (for --methods)
    methods/METHOD-PRECISION.npy  each method's scores [Q, N] in the ground truth's order
    methods/replay-P.parts/     the metagradient rows of each batch of queries (resumable batch by batch)
    lds.json, lds.md, lds.png   the LDS of every method and of every --scores run

Subset runs replay the full run's visit order restricted to the subset (`--ordered`); under
torchrun the full run and the subsets are shared out over the ranks, each trained by one
process alone, so the ground truth is the same as in one process (with the same --threads);
so are the methods' indexes, and replay's batches of queries.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import numpy as np
import tyro

from assay.core.config import (
    DataConfig,
    ModelConfig,
    QueryConfig,
    RuntimeConfig,
    refuse_non_finite,
    require_config,
)
from assay.core.console import note
from assay.core.distributed import Distributed
from assay.core.errors import AssayError
from assay.core.experiment import finish_experiment, first_difference, open_experiment
from assay.core.precision import slow_bf16_note
from assay.core.runs import CONFIG_FILE, DONE_FILE, config_from_dict, config_to_dict, read_json, write_json
from assay.counterfactual.ground_truth import (
    GroundTruth,
    RetrainSetup,
    collect_outputs,
    job_file,
    query_losses,
    run_subset,
    subset_masks,
)
from assay.counterfactual.methods import (
    DEFAULT_DAMPING,
    DEFAULT_PROJECTION,
    METHODS,
    MethodSetup,
    compute_method,
    method_label,
    replay_method,
    scores_path,
)
from assay.counterfactual.report import evaluate_all
from assay.lm.data import load_examples
from assay.lm.models import load_model, load_tokenizer, setup_runtime
from assay.lm.presets import prepare_preset
from assay.lm.queries import load_queries
from assay.training.finetune import FinetuneConfig, finetune
from assay.training.recipe import TrainRecipe

GROUND_TRUTH = "ground_truth"
ABC_RECIPE = TrainRecipe(
    learning_rate=1e-3, num_epochs=2, effective_batch_size=8, micro_batch_size=8, warmup_ratio=0.1
)
"""The abc preset's fine-tune (the coreset experiments' recipe)."""


@dataclass
class ValidateConfig:
    """Retrain a fine-tuning recipe on random subsets of its data and measure attributions' LDS."""

    out: tyro.conf.Positional[str]
    """Experiment folder (every stage inside; rerun the same command to resume)."""
    model: tyro.conf.OmitArgPrefixes[ModelConfig] = field(default_factory=ModelConfig)
    data: tyro.conf.OmitArgPrefixes[DataConfig] = field(default_factory=DataConfig)
    runtime: tyro.conf.OmitArgPrefixes[RuntimeConfig] = field(default_factory=RuntimeConfig)
    recipe: tyro.conf.OmitArgPrefixes[TrainRecipe] = field(default_factory=TrainRecipe)
    queries: tyro.conf.OmitArgPrefixes[QueryConfig] = field(default_factory=QueryConfig)
    preset: Literal["none", "abc"] = "none"
    """abc: assay-tiny fine-tuned in fp32 on a pool of ABC tunes (every collection), held-out
    tunes as queries, every gradient method at bf16 and fp32 (overrides --model, --dataset,
    --query*, --precision and the recipe; --methods replay then adds the metagradients, about
    2.3 training runs per query; docs/validation.md has its table)."""
    pool_size: int = 300
    """Training tunes in the abc preset's pool."""
    query_size: int = 24
    """Held-out tunes in the abc preset's query set."""
    preset_learning_rate: float = ABC_RECIPE.learning_rate
    """Peak learning rate of the abc preset's fine-tune. 1e-3 is the coreset experiments' recipe;
    at 3e-4 the run is smooth enough for its exact metagradient to predict small drops
    (docs/validation.md)."""
    num_subsets: int = 32
    """M: random subsets retrained (each its own fine-tune from the base model)."""
    alpha: float = 0.5
    """Fraction of the pool each subset keeps."""
    subset_seed: int = 0
    """Seed of the subsets (subset m depends on it and m only)."""
    removal: Literal["skip", "weight"] = "skip"
    """How a retraining leaves the rest of the pool out. skip: trains on the subset alone, in the
    full run's visit order (the batches close up: fewer, other steps). weight: the full run's own
    batches and steps with the left-out examples' loss weights at 0 (each step still divided by
    its whole batch's tokens): the counterfactual exact metagradients (replay) differentiate, and
    the one bergson's LDS retrains."""
    methods: tuple[str, ...] = ()
    """Attribution methods computed here on the full run's model and validated: trackstar, cosine,
    inner, influence, kfac, ekfac, replay (exact metagradients through the full run, at the run's
    own precision only). None by default; the abc preset runs them all."""
    index_precisions: tuple[Literal["fp32", "bf16", "fp16"], ...] = ("fp32",)
    """Precisions each method's index and queries are computed at (one LDS row per precision)."""
    projection_dim: int = DEFAULT_PROJECTION
    """Projection width per side of the methods' indexes (0: raw weight gradients, exact but
    large: one parameter-sized row per pool example). Rows made at another width than 16 are
    labelled NAME-pP-PRECISION."""
    replay_from_step: int = 0
    """replay: differentiate only the steps from this one on, the earlier ones held fixed (scores
    saved as replay-fromS-P). MAGIC's remedy for a non-smooth start: in Adam's first steps the
    second moments are tiny and their exact derivatives dominate (docs/validation.md)."""
    damping: float = DEFAULT_DAMPING
    """Damping of the influence methods, as a multiple of the mean eigenvalue (per module). Rows
    made with another damping than 0.1 are labelled NAME-dD-PRECISION."""
    scores: tuple[str, ...] = ()
    """Attribution results to validate: `assay score` runs made with --save_scores (over the same
    pool and queries) or .npy matrices [Q, N] in the ground truth's order (OUT/ground_truth)."""
    bootstrap: int = 1000
    """Bootstrap resamples of the queries behind each LDS's confidence interval."""
    token_batch_size: int = 4096
    """Most tokens per batch for gradients and evaluation."""
    overwrite: bool = False
    """Redo a finished experiment in OUT from scratch."""

    def __post_init__(self) -> None:
        unknown = [m for m in self.methods if m not in METHODS]
        if unknown:
            raise AssayError(f"unknown method {unknown[0]!r}; choose from {', '.join(METHODS)}")
        if self.num_subsets < 3:
            raise AssayError(
                f"--num_subsets must be >= 3 (a rank correlation needs points), got {self.num_subsets}"
            )
        if not 0.0 < self.alpha < 1.0:
            raise AssayError(f"--alpha must be in (0, 1), got {self.alpha}")
        if not 0.0 < self.preset_learning_rate < 1.0:
            raise AssayError(f"--preset_learning_rate must be in (0, 1), got {self.preset_learning_rate}")
        if min(self.pool_size, self.query_size, self.token_batch_size, self.bootstrap) < 1:
            raise AssayError("--pool_size, --query_size, --token_batch_size and --bootstrap must be >= 1")
        refuse_non_finite(self)
        if min(self.damping, self.replay_from_step, self.projection_dim) < 0:
            raise AssayError("--damping, --replay_from_step and --projection_dim must be >= 0")
        missing = [path for path in self.scores if not Path(path).exists()]
        if missing:  # before the fine-tune and the retraining, not after them
            raise AssayError(f"--scores {missing[0]}: no such score run or .npy file")


FREE = (
    "scores", "bootstrap", "threads", "methods", "index_precisions", "damping", "projection_dim",
    "replay_from_step",
)  # fmt: skip
"""Settings that may change when rerunning a validation: they do not touch the ground truth."""


def resolve(cfg: ValidateConfig, root: Path) -> ValidateConfig:
    """The preset applied (its data files written once), or the config as given."""
    if cfg.preset == "none":
        return cfg
    files = prepare_preset("lds", root / "data", cfg.pool_size, cfg.query_size, 0)
    data = replace(
        cfg.data, dataset=files["pool"], split="train", max_length=256, filter_column=None, filter_value=None
    )
    queries = QueryConfig(query_dataset=files["query"], query_split="train")
    methods = cfg.methods or tuple(m for m in METHODS if m != "replay")  # replay: opt in (its cost)
    precisions = cfg.index_precisions if cfg.index_precisions != ("fp32",) else ("bf16", "fp32")
    runtime = replace(cfg.runtime, precision="fp32")  # the reference run: replayed exactly, in fp32
    recipe = replace(ABC_RECIPE, learning_rate=cfg.preset_learning_rate)
    return replace(cfg, model=ModelConfig(model="assay-tiny"), data=data, queries=queries, recipe=recipe,
                   runtime=runtime, methods=methods, index_precisions=precisions)  # fmt: skip


def full_config(cfg: ValidateConfig, root: Path) -> FinetuneConfig:
    """The recipe on the whole pool (the model every method attributes)."""
    return FinetuneConfig(
        out=str(root / "full"), model=cfg.model, data=cfg.data, runtime=cfg.runtime, recipe=cfg.recipe,
        eval_split="", pool_loss=False, token_batch_size=cfg.token_batch_size, save_every=0,
    )  # fmt: skip


def ground_truth(cfg: ValidateConfig, root: Path) -> GroundTruth:
    """Retrain on every subset (resumably, shared out over torchrun ranks), then assemble."""
    folder = root / GROUND_TRUTH
    if Distributed.current().broadcast_object((folder / "ground_truth.json").exists()):
        return GroundTruth.load(folder)
    _, policy = setup_runtime(cfg.runtime)
    tokenizer = load_tokenizer(cfg.model)
    _, pool = load_examples(cfg.data, tokenizer)
    queries = load_queries(cfg.queries, cfg.data.max_length, tokenizer)
    masks = subset_masks(len(pool), cfg.num_subsets, cfg.alpha, cfg.subset_seed)
    setup = RetrainSetup(
        full_config(cfg, root),
        pool,
        queries,
        tokenizer.pad_token_id,
        policy,
        cfg.token_batch_size,
        cfg.removal,
    )
    folder.mkdir(parents=True, exist_ok=True)
    dist = Distributed.current()
    jobs = [-1, *range(cfg.num_subsets)]  # -1: the full run
    for job in dist.interleave(jobs):
        if job == -1:
            _full_run(setup, folder)
        elif not job_file(folder, job).exists():
            note(f"ground truth: subset {job + 1} of {cfg.num_subsets} ({int(masks[job].sum())} examples)")
            run_subset(setup, masks[job], job, folder)
    dist.barrier()
    if dist.is_main:
        full = np.asarray(read_json(folder / "full.json")["outputs"], dtype=np.float64)
        outputs = collect_outputs(folder, cfg.num_subsets, len(queries.ids))
        truth = GroundTruth(masks, outputs, pool.ids.astype(np.int64), list(queries.ids), queries.texts, full)
        settings = {
            "alpha": cfg.alpha,
            "num_subsets": cfg.num_subsets,
            "subset_seed": cfg.subset_seed,
            "removal": cfg.removal,
        }
        truth.save(folder, settings, overwrite=True)  # its own folder: an interrupted save's arrays
    dist.barrier()
    return GroundTruth.load(folder)


def _full_run(setup: RetrainSetup, folder: Path) -> None:
    """Fine-tune on the whole pool (alone in this process) and measure the queries under it."""
    out = Path(setup.recipe_cfg.out)
    with Distributed.alone():
        if not (out / DONE_FILE).exists():
            note("ground truth: the full run")
            finetune(setup.recipe_cfg)
        if not (folder / "full.json").exists():
            model = load_model(ModelConfig(model=str(out / "model")), setup.policy)
            write_json(folder / "full.json", {"outputs": query_losses(model, setup).tolist()})


METHOD_COST = {"ekfac": 6.0, "kfac": 3.0, "adam": 1.5, "raw": 1.0}
"""Rough relative cost of building each kind of index (the abc preset's timings), to share the
indexes out evenly over torchrun ranks."""


def compute_methods(cfg: ValidateConfig, root: Path, truth: GroundTruth) -> list[Path]:
    """Every --methods × --index_precisions score matrix, each saved once (resumable).

    Under torchrun the gradient methods are shared out by index (the methods that read one
    index stay together), each rank computing its share alone; replay shares its query batches."""
    setup = MethodSetup(
        root, ModelConfig(model=str(root / "full" / "model")), root / "full", cfg.data, cfg.queries,
        cfg.runtime, cfg.projection_dim, cfg.token_batch_size, cfg.damping, cfg.replay_from_step,
    )  # fmt: skip
    dist = Distributed.current()
    groups = index_groups([m for m in cfg.methods if m != "replay"], cfg.index_precisions)
    mine = [g for g, owner in zip(groups, share_out(groups, dist.world_size)) if owner == dist.rank]
    dist.on_every_rank(_compute_alone, setup, [label for g in mine for label in g], truth)  # ends together
    paths = [
        scores_path(setup, method_label(setup, name, precision)) for g in groups for name, precision in g
    ]
    if "replay" in cfg.methods:  # the run is differentiated at the precision it was trained at
        precision = str(read_json(root / "full" / "summary.json")["precision"])
        paths.append(replay_method(setup, precision, truth.ids, truth.query_ids))
    return paths


def index_groups(methods: list[str], precisions: tuple[str, ...]) -> list[list[tuple[str, str]]]:
    """(method, precision) labels grouped by the index they read, costliest group first."""
    groups: dict[tuple[str, str], list[tuple[str, str]]] = {}
    for precision in precisions:
        for name in methods:
            groups.setdefault((METHODS[name].index, precision), []).append((name, precision))
    return [groups[k] for k in sorted(groups, key=lambda k: -METHOD_COST.get(k[0], 1.0))]


def share_out(groups: list[list[tuple[str, str]]], world_size: int) -> list[int]:
    """The rank that computes each group: the least loaded so far (same answer on every rank)."""
    load, owners = [0.0] * world_size, []
    for group in groups:
        rank = load.index(min(load))
        load[rank] += METHOD_COST.get(METHODS[group[0][0]].index, 1.0)
        owners.append(rank)
    return owners


def _compute_alone(setup: MethodSetup, labels: list[tuple[str, str]], truth: GroundTruth) -> None:
    with Distributed.alone():
        for name, precision in labels:
            if not scores_path(setup, method_label(setup, name, precision)).exists():
                note(f"--- method {method_label(setup, name, precision)}")
            compute_method(setup, name, precision, truth.ids, truth.query_ids)


def validate(cfg: ValidateConfig) -> dict[str, Any]:
    """Ground truth (made once), the methods' scores, and the LDS of each and of every --scores.

    A finished experiment is extended, never redone: more --methods or --scores are validated
    against its ground truth. Given only such free settings (`assay validate OUT --scores RUN`),
    the experiment's own settings are used."""
    require_config(cfg, ValidateConfig, "validate's config")
    dist = Distributed.current()
    cfg = dist.main_only(_with_saved_settings, cfg)
    if cfg.preset == "none" and not cfg.queries.given:
        raise AssayError("give the queries: --query_dataset DATASET (or --preset abc)")
    root = dist.main_only(open_experiment, cfg.out, "validate", cfg, cfg.overwrite, FREE, True)
    cfg = dist.main_only(resolve, cfg, root)
    if slow := slow_bf16_note(cfg.index_precisions if cfg.methods else (), cfg.runtime.device):
        note(slow)
    if not cfg.methods and not cfg.scores and not (root / "methods").exists():
        note(
            "no --methods or --scores: this run makes the ground truth only; validate methods on it "
            f"later with `assay validate {cfg.out} --methods trackstar ...` or `--scores RUN`"
        )
    truth = ground_truth(cfg, root)
    methods = compute_methods(cfg, root, truth)
    earlier = sorted((root / "methods").glob("*.npy")) if (root / "methods").exists() else []
    sources = list(dict.fromkeys([*earlier, *methods, *map(Path, cfg.scores)]))
    result = dist.main_only(evaluate_all, root, truth, sources, cfg.bootstrap)
    if dist.is_main:
        finish_experiment(root)
    return result


def _with_saved_settings(cfg: ValidateConfig) -> ValidateConfig:
    """cfg, or (when cfg names an existing experiment and sets nothing but free settings) the
    experiment's saved settings with the free ones cfg sets (those it leaves at their defaults
    keep the saved values: `assay validate OUT --scores RUN` computes no methods afresh)."""
    path = Path(cfg.out) / CONFIG_FILE
    if not path.exists():
        return cfg
    given, default = config_to_dict(cfg), config_to_dict(ValidateConfig(out=cfg.out))
    if first_difference(default, given, {*FREE, "overwrite", "out"}) is not None:
        return cfg  # the user gave the experiment's settings: open_experiment compares them
    saved = config_from_dict(ValidateConfig, read_json(path)["config"])
    note(f"validating with the settings of {cfg.out} (its config.json)")
    changed = {k: getattr(cfg, k) for k in (*FREE, "overwrite") if given.get(k) != default.get(k)}
    return replace(saved, **changed)
