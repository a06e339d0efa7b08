"""`assay filter`: choose training examples by a score, for coreset or targeted selection."""

from __future__ import annotations

from typing import Any

from assay.core.console import say
from assay.selection.filter import FilterConfig, select
from assay.selection.strategies import STRATEGIES

Config = FilterConfig


def run(cfg: FilterConfig) -> dict[str, Any]:
    summary = select(cfg)
    how = "coverage"  # facility, kcenter, balanced, typiclust rank nothing
    if cfg.strategy == "random":
        how = "a uniform draw"
    elif STRATEGIES[cfg.strategy].kind == "score":
        how = f"{'lowest' if cfg.lowest else 'highest'} scores"
    if cfg.dedup is not None:
        how += f", near-duplicates (cosine >= {cfg.dedup}) dropped first"
    say(
        f"{cfg.out}: kept {summary['num_selected']} of {summary['pool_size']} examples "
        f"({cfg.strategy}, query {cfg.query}, {how})"
    )
    return summary
