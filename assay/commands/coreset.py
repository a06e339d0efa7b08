"""`assay coreset`: data selection proven by retraining, the whole experiment in one command."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from assay.core.console import say
from assay.core.runs import final_location
from assay.selection.coreset import CoresetConfig, run_experiment

Config = CoresetConfig


def run(cfg: CoresetConfig) -> dict[str, Any]:
    results = run_experiment(cfg)
    say((Path(cfg.out) / "results.md").read_text())
    say(f"results in {final_location(cfg.out)}/ (results.md, results.json, curves.png)")
    return results
