"""`assay validate`: the LDS of attribution methods on your own fine-tune, by retraining on subsets."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from assay.core.console import say
from assay.core.runs import final_location
from assay.counterfactual.validate import ValidateConfig, validate

Config = ValidateConfig


def run(cfg: ValidateConfig) -> dict[str, Any]:
    result = validate(cfg)
    if result:
        say((Path(cfg.out) / "lds.md").read_text())
        out = final_location(cfg.out)
        say(f"results in {out}/ (lds.json, lds.md, lds.png; ground truth in {out}/ground_truth)")
    return result
