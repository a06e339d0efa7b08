"""`assay filter`: choose training examples by a score, for coreset or targeted selection."""

from __future__ import annotations

from typing import Any

from assay.core.console import say
from assay.selection.filter import FilterConfig, select

Config = FilterConfig


def run(cfg: FilterConfig) -> dict[str, Any]:
    summary = select(cfg)
    tail = "lowest" if cfg.lowest else "highest"
    say(
        f"{cfg.out}: kept {summary['num_selected']} of {summary['pool_size']} examples "
        f"({cfg.strategy}, query {cfg.query}, {tail} scores)"
    )
    return summary
