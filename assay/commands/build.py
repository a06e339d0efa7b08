"""`assay build`: one projected loss gradient per example, streamed to a memory-mapped index."""

from __future__ import annotations

from typing import Any

from assay.attribution.build import BuildConfig, build_index
from assay.core.console import say
from assay.core.runs import final_location

Config = BuildConfig


def run(cfg: BuildConfig) -> dict[str, Any]:
    summary = build_index(cfg)
    if cfg.append:
        speed = f"; {summary['tokens_per_s']:,.0f} tokens/s" if "tokens_per_s" in summary else ""
        added, total = summary["appended"], summary["num_examples"]
        say(f"index {final_location(cfg.out)}: appended {added} examples, {total} in all{speed}")
        return summary
    say(
        f"index {final_location(cfg.out)}: {summary['num_examples']} examples × {summary['dim']} dims "
        f"({len(summary['modules'])} modules, p={cfg.projection_dim}, {summary['precision']}, "
        f"stored {cfg.store_dtype}); {summary['tokens_per_s']:,.0f} tokens/s"
    )
    return summary
