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
    if STRATEGIES[cfg.strategy].kind == "score":
        how = f"{'lowest' if cfg.lowest else 'highest'} scores"
    say(
        f"{cfg.out}: kept {summary['num_selected']} of {summary['pool_size']} examples "
        f"({cfg.strategy}, query {cfg.query}, {how})"
    )
    return summary
