"""`assay coreset`: data selection proven by retraining, the whole experiment in one command.

Stages (each a finished run folder under OUT/; a rerun skips finished stages and resumes the
interrupted one):

    data/                    the bundled preset's pool / query / eval files (--preset)
    full/seed{S}/            fine-tune on the whole pool (seed[0]'s run is the warm-up model)
    index/{bf16,fp32}/       gradient indexes of the pool under the warm-up model
    select/{row}/            selections; a seeded strategy's (random, kcenter, balanced, typiclust)
                             are drawn per seed and draw: select/{row}_seed{S}[_draw{D}]
    retrain/{row}/seed{S}/   fine-tune the BASE model on each selection (--ordered by full/seed{S});
                             further draws in retrain/{row}/seed{S}_draw{D}/
    results.json, results.md, curves.png

Rows: full data, then one per --strategies entry, TrackStar once per index precision (the other
gradient strategies select from the fp32 index); random's and the seeded strategies' rows are the
means of their draws.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import numpy as np
import tyro

from assay.attribution.build import BuildConfig, build_index
from assay.core.config import DataConfig, ModelConfig, QueryConfig, RuntimeConfig, is_single_file
from assay.core.console import note
from assay.core.distributed import Distributed
from assay.core.errors import AssayError
from assay.core.experiment import Stages, finish_experiment, open_experiment
from assay.core.precision import slow_bf16_note
from assay.lm.presets import prepare_preset
from assay.selection.filter import FilterConfig, select
from assay.selection.strategies import STRATEGIES, StrategyName, seeded
from assay.selection.tables import write_report
from assay.training.finetune import FinetuneConfig, finetune
from assay.training.recipe import TrainRecipe

COMMON_RECIPE = TrainRecipe(learning_rate=1e-3, num_epochs=2, effective_batch_size=8, micro_batch_size=8)
"""Every fine-tune of the experiment (full and subsets; subsets replay the full run's order)."""


@dataclass
class CoresetConfig:
    """Warm up on the full data, select with each strategy, retrain on each subset, compare."""

    out: tyro.conf.Positional[str]
    """Experiment folder (every stage in its own subfolder; rerun to resume)."""
    model: tyro.conf.OmitArgPrefixes[ModelConfig] = field(default_factory=ModelConfig)
    data: tyro.conf.OmitArgPrefixes[DataConfig] = field(default_factory=DataConfig)
    runtime: tyro.conf.OmitArgPrefixes[RuntimeConfig] = field(default_factory=RuntimeConfig)
    preset: Literal["none", "coreset", "targeted"] = "none"
    """Bundled abc-tunes experiment: coreset (query = the pool) or targeted (query = O'Neill tunes
    outside the pool, eval = held-out O'Neill tunes). Overrides --dataset, --query* and --eval*."""
    pool_size: int = 500
    """Pool size for the presets."""
    query_size: int = 64
    """Query examples for the targeted preset."""
    eval_size: int = 200
    """Eval examples for the coreset preset (a seeded sample of the held-out split)."""
    seeds: tuple[int, ...] = (0, 1, 2)
    """Training seeds (random selection is redrawn per seed; seed[0]'s full run is the warm-up)."""
    random_draws: int = 10
    """Random selections drawn per seed, each retrained with that seed. The random row is their
    mean, and every strategy is compared with it seed by seed: one draw's eval loss varies between
    draws about as much as the strategies differ, so a single draw is a noisy baseline. The table
    also gives the share of all draws each strategy beats at its own seed."""
    strategy_draws: int = 10
    """Selections drawn per seed for the other strategies whose selection is itself a draw
    (kcenter: its first centre; balanced and typiclust: their k-means and, for balanced, the order
    within clusters), each retrained with that seed; the row is their mean. One draw of them is as
    noisy as one random draw, so by default they get as many."""
    fraction: float = 0.1
    """Fraction of the pool each strategy keeps."""
    strategies: tuple[StrategyName, ...] = (
        "random",
        "loss",
        "gradcos",
        "trackstar",
        "facility",
        "kcenter",
        "balanced",
        "typiclust",
    )
    """Selection strategies to compare with the full data (see `assay filter --help`). Rerunning a
    finished experiment with more strategies runs only their stages."""
    index_precisions: tuple[Literal["bf16", "fp32", "fp16"], ...] = ("bf16", "fp32")
    """Precisions the gradient index is built at: TrackStar is retrained once per precision; every
    gradient strategy also selects at each, and the selections' agreement is reported."""
    query: Literal["self", "eval"] = "self"
    """self: coreset selection; eval: targeted selection with --query_dataset."""
    query_dataset: str | None = None
    """Query set for --query eval."""
    query_split: str = "train"
    """Split of the query set."""
    eval_dataset: str | None = None
    """Dataset the eval loss is measured on (default: --dataset)."""
    eval_split: str = "eval"
    """Split of the eval dataset."""
    eval_filter_column: str | None = None
    """Keep only eval rows whose column equals --eval_filter_value."""
    eval_filter_value: str | None = None
    """The value --eval_filter_column must equal."""
    recipe: tyro.conf.OmitArgPrefixes[TrainRecipe] = field(default_factory=lambda: COMMON_RECIPE)
    eval_every: int = 0
    """Eval-loss points on the curves every N steps (0: before and after only)."""
    pool_loss: bool = True
    """Also measure each subset model's loss on the whole pool (the coreset's "train loss")."""
    ordered: bool = True
    """Subset runs visit their examples in the full run's order (removes ordering effects)."""
    projection_dim: int = 16
    """Gradient projection width per side."""
    normalizer: Literal["none", "adafactor", "adam"] = "none"
    """Optimizer second-moment normalizer for the indexes (estimated from the pool)."""
    token_batch_size: int = 4096
    """Most tokens per batch for gradients and evaluation."""
    overwrite: bool = False
    """Redo a finished experiment in OUT from scratch."""

    def draws_of(self, row: str) -> int:
        """Selections drawn (and retrained) per seed for a table row."""
        if row == "random":
            return self.random_draws
        return self.strategy_draws if seeded(row) else 1

    def __post_init__(self) -> None:
        unknown = set(self.strategies) - set(STRATEGIES)
        if unknown:
            raise AssayError(f"unknown strategy {sorted(unknown)[0]!r}; choose from {', '.join(STRATEGIES)}")
        if not self.seeds:
            raise AssayError("--seeds needs at least one seed")
        for name in (
            "random_draws",
            "strategy_draws",
            "pool_size",
            "query_size",
            "eval_size",
            "token_batch_size",
        ):
            if getattr(self, name) < 1:
                raise AssayError(f"--{name} must be at least 1, got {getattr(self, name)}")
        if not 0.0 < self.fraction < 1.0:
            raise AssayError(f"--fraction must be in (0, 1), got {self.fraction}")
        if self.projection_dim < 0:  # 0: raw weight gradients, as `assay build` takes it
            raise AssayError(f"--projection_dim must be >= 0, got {self.projection_dim}")
        if self.query == "eval" and self.preset == "none" and not self.query_dataset:
            raise AssayError("--query eval needs --query_dataset (or use --preset targeted)")
        if self.preset == "none":
            self._check_held_out_data()

    def _check_held_out_data(self) -> None:
        """The tables compare retrained models on held-out loss: refuse a setup without any."""
        if not self.eval_split:
            raise AssayError("--eval_split '' leaves no held-out data, and the experiment compares on it")
        given = self.eval_dataset is not None or self.eval_filter_column is not None
        if not given and is_single_file(self.data.dataset):
            raise AssayError(
                f"the experiment compares retrained models on held-out loss, and {self.data.dataset} "
                "is a single file (one split): give held-out rows with --eval_dataset FILE or "
                "--eval_filter_column/--eval_filter_value (or use --preset)"
            )


@dataclass
class Layout:
    """Where every stage lives, and the resolved data of the experiment."""

    root: Path
    data: DataConfig
    query: str
    query_dataset: str | None
    query_split: str
    eval_data: dict[str, Any]

    def full(self, seed: int) -> Path:
        return self.root / "full" / f"seed{seed}"

    def index(self, precision: str) -> Path:
        return self.root / "index" / precision

    def selection(self, row: str, seed: int, draw: int = 0) -> Path:
        """A strategy's selection; a seeded strategy's is drawn per seed, and again per draw."""
        if not seeded(row):
            return self.root / "select" / row
        return self.root / "select" / f"{row}_seed{seed}{_draw_suffix(draw)}"

    def retrain(self, row: str, seed: int, draw: int = 0) -> Path:
        return self.root / "retrain" / row / f"seed{seed}{_draw_suffix(draw)}"


def _draw_suffix(draw: int) -> str:
    return f"_draw{draw}" if draw else ""


def draw_seed(seed: int, draw: int) -> int:
    """The seed a seeded selection `draw` of training seed `seed` is drawn with: the seed itself
    for the first draw (as `assay filter --seed S` draws it), then independent seeds derived from
    both."""
    return seed if draw == 0 else int(np.random.SeedSequence([seed, draw]).generate_state(1)[0])


def resolve_layout(cfg: CoresetConfig, root: Path) -> Layout:
    """Apply the preset (writing its data files once) or take the data flags as given."""
    eval_data = {
        "eval_dataset": cfg.eval_dataset,
        "eval_split": cfg.eval_split,
        "eval_filter_column": cfg.eval_filter_column,
        "eval_filter_value": cfg.eval_filter_value,
    }
    if cfg.preset == "none":
        return Layout(root, cfg.data, cfg.query, cfg.query_dataset, cfg.query_split, eval_data)
    files = prepare_preset(cfg.preset, root / "data", cfg.pool_size, cfg.query_size, cfg.eval_size)
    data = replace(cfg.data, dataset=files["pool"], split="train", filter_column=None, filter_value=None)
    eval_data = {"eval_dataset": files["eval"], "eval_split": "train", "eval_filter_column": None}
    eval_data["eval_filter_value"] = None
    query = "eval" if cfg.preset == "targeted" else "self"
    return Layout(root, data, query, files["query"] if query == "eval" else None, "train", eval_data)


def finetune_config(cfg: CoresetConfig, lay: Layout, out: Path, seed: int, selection: Path | None) -> Any:
    return FinetuneConfig(
        out=str(out),
        model=cfg.model,
        data=lay.data,
        runtime=replace(cfg.runtime, seed=seed),
        selection=str(selection) if selection else None,
        ordered=str(lay.full(seed)) if selection and cfg.ordered else None,
        recipe=cfg.recipe,
        eval_every=cfg.eval_every,
        pool_loss=cfg.pool_loss,
        token_batch_size=cfg.token_batch_size,
        log_every=1,
        **lay.eval_data,
    )


def index_stage(cfg: CoresetConfig, lay: Layout, precision: str) -> None:
    warm = lay.full(cfg.seeds[0]) / "model"
    build_index(
        BuildConfig(
            out=str(lay.index(precision)),
            model=ModelConfig(model=str(warm), trust_remote_code=cfg.model.trust_remote_code),
            data=lay.data,
            runtime=replace(cfg.runtime, precision=precision, seed=cfg.seeds[0]),  # type: ignore[arg-type]
            projection_dim=cfg.projection_dim,
            token_batch_size=cfg.token_batch_size,
            normalizer=cfg.normalizer,
            preconditioner="trackstar",
        )
    )


def select_stage(cfg: CoresetConfig, lay: Layout, row: str, seed: int, draw: int = 0) -> None:
    strategy, _, precision = row.partition("_")
    index = None if strategy == "random" else lay.index(precision or "fp32")
    select(
        FilterConfig(
            out=str(lay.selection(row, seed, draw)),
            data=lay.data,
            runtime=replace(cfg.runtime, seed=draw_seed(seed, draw)),
            strategy=strategy,  # type: ignore[arg-type]
            query=lay.query,  # type: ignore[arg-type]
            queries=QueryConfig(query_dataset=lay.query_dataset, query_split=lay.query_split),
            fraction=cfg.fraction,
            index=str(index) if index else None,
            token_batch_size=cfg.token_batch_size,
        )
    )


def rows_of(cfg: CoresetConfig) -> list[str]:
    """Table rows after "full": one per strategy, TrackStar once per index precision."""
    rows: list[str] = []
    for s in cfg.strategies:
        rows += [f"trackstar_{p}" for p in cfg.index_precisions] if s == "trackstar" else [s]
    return rows


def agreement_rows(cfg: CoresetConfig) -> tuple[str, ...]:
    """Selections made (not retrained) to compare precisions: every gradient strategy at every
    index precision, for the first seed."""
    gradient = [s for s in cfg.strategies if STRATEGIES[s].needs_index]
    rows = [f"{s}_{p}" for s in gradient for p in cfg.index_precisions]
    return tuple(r for r in rows if r not in rows_of(cfg)) if len(cfg.index_precisions) > 1 else ()


def run_stages(cfg: CoresetConfig, lay: Layout, stages: Stages) -> None:
    first = cfg.seeds[0]
    stages.run(
        f"full/seed{first}",
        lay.full(first),
        finetune,
        finetune_config(cfg, lay, lay.full(first), first, None),
    )
    rows = [*rows_of(cfg), *agreement_rows(cfg)]
    needs_index = {p for r in rows if r != "random" for p in [r.partition("_")[2] or "fp32"]}
    for precision in sorted(needs_index):
        stages.run(f"index/{precision}", lay.index(precision), index_stage, cfg, lay, precision)
    for row in agreement_rows(cfg):
        chosen = lay.selection(row, first)
        stages.run(f"select/{chosen.name}", chosen, select_stage, cfg, lay, row, first)
    for seed in cfg.seeds:
        full = lay.full(seed)
        stages.run(f"full/seed{seed}", full, finetune, finetune_config(cfg, lay, full, seed, None))
        for row in rows_of(cfg):
            for draw in range(cfg.draws_of(row)):
                chosen = lay.selection(row, seed, draw)
                stages.run(f"select/{chosen.name}", chosen, select_stage, cfg, lay, row, seed, draw)
                out = lay.retrain(row, seed, draw)
                stages.run(
                    f"retrain/{row}/{out.name}", out, finetune, finetune_config(cfg, lay, out, seed, chosen)
                )


def finish(cfg: CoresetConfig, lay: Layout, root: Path) -> dict[str, Any]:
    """The report (results.json, results.md, curves.png), then the experiment's run.json."""
    results = write_report(cfg, lay, rows_of(cfg), root, agreement_rows(cfg))
    finish_experiment(root)
    return results


FREE = ("strategies", "random_draws", "strategy_draws")
"""Settings a finished experiment may be rerun with: more --strategies or draws run only
their own stages (the warm-up runs, indexes and earlier selections are reused) and join the
tables."""


def run_experiment(cfg: CoresetConfig) -> dict[str, Any]:
    """Every stage (resumably), then the tables, the overlap and the plot.

    Under torchrun rank 0 opens the folder, writes the preset's data and the report; every
    rank runs the stages together and returns rank 0's results.
    """
    dist = Distributed.current()
    root = dist.main_only(open_experiment, cfg.out, "coreset", cfg, cfg.overwrite, FREE, True)
    lay = dist.main_only(resolve_layout, cfg, root)
    if slow := slow_bf16_note(cfg.index_precisions, cfg.runtime.device):
        note(slow)
    run_stages(cfg, lay, Stages(root))
    return dist.main_only(finish, cfg, lay, root)
