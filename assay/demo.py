"""`assay demo`: the main job on the bundled defaults (real data, a real small model).

The one place that runs every pillar in turn, so a new user sees the whole tool at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import tyro

from assay.core.config import DataConfig, ModelConfig, RuntimeConfig
from assay.core.console import say
from assay.core.runs import run_folder, write_json
from assay.training.evaluate import mean_token_loss


@dataclass
class DemoConfig:
    """Run the main job: assay-tiny on real ABC folk tunes and real general text."""

    out: tyro.conf.Positional[str] = "demo-out"
    """Output folder for every stage's results."""
    model: str = "assay-tiny"
    """Model to study (an alias, a local folder or a hub id)."""
    precision: str = "auto"
    """Precision policy for every stage (see `assay eval --help`)."""
    max_samples: int = 400
    """Examples per dataset the demo uses (keeps it to minutes on 2 CPU cores)."""
    overwrite: bool = False
    """Replace a finished demo in OUT."""


def _loss_table(cfg: DemoConfig, out: Path) -> dict[str, float]:
    model = ModelConfig(model=cfg.model)
    runtime = RuntimeConfig(precision=cfg.precision)  # type: ignore[arg-type]
    results = {}
    for dataset in ("shakespeare", "abc-tunes"):
        data = DataConfig(dataset=dataset, split="eval", max_samples=cfg.max_samples)
        results[dataset] = mean_token_loss(model, data, runtime)["mean_loss"]
    write_json(out / "losses.json", results)
    return results


def run_demo(cfg: DemoConfig) -> None:
    with run_folder(cfg.out, "demo", cfg, cfg.overwrite) as run:
        losses = _loss_table(cfg, run.path)
    say(f"\n{cfg.model} loss (nats/token) on held-out text:")
    for name, value in losses.items():
        say(f"  {name:<12} {value:.3f}")
    say(f"results in {cfg.out}/")
