"""metrics.jsonl, the one metrics log of every training run (fine-tuning and SAEs).

One JSON object per line, appended and flushed as written, always saved locally; mirrored to
Weights & Biases when a run is given (works offline with WANDB_MODE=offline). Under torchrun
rank 0 writes. Non-finite floats are written as null, so the file stays standard JSON.

On resume the log is cut back to what the checkpoint being resumed from had seen (records
with `step` <= the checkpoint's step), and a torn last line from a killed process is dropped
instead of failing the run.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from assay.core.distributed import Distributed
from assay.core.errors import AssayError


def read_records(path: Path) -> list[dict[str, Any]]:
    """Every whole record of a metrics file; a line cut short by a crash is skipped."""
    records: list[dict[str, Any]] = []
    if not path.exists():
        return records
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a torn write (killed mid-line): the record was never complete
        if isinstance(record, dict):
            records.append(record)
    return records


class MetricsLog:
    """Appends one JSON object per line to `path`; mirrors each record to W&B when `wandb_run` is set."""

    def __init__(self, path: Path, wandb_run: Any = None):
        self.path, self.wandb_run = path, wandb_run
        self.enabled = Distributed.current().is_main

    def truncate_after(self, step: int) -> None:
        """Keep the records with step <= `step` (-1: none), dropping a torn last line too."""
        if not self.enabled:
            return
        kept = [r for r in read_records(self.path) if int(r.get("step", 0)) <= step]
        self.path.write_text("".join(json.dumps(r) + "\n" for r in kept))

    def log(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        with open(self.path, "a") as f:
            f.write(json.dumps(clean) + "\n")
        if self.wandb_run is not None:
            self.wandb_run.log({k: v for k, v in clean.items() if v is not None}, step=record.get("step"))

    def close(self) -> None:
        if self.wandb_run is not None:
            self.wandb_run.finish()


def start_wandb(project: str, name: str, config: dict[str, Any], folder: Path) -> Any:
    """A W&B run (honours WANDB_MODE=offline); a clear error when wandb is not installed."""
    try:
        import wandb  # optional extra: imported only when asked for
    except ImportError:
        raise AssayError("--wandb needs the wandb package: pip install 'assay[wandb]'") from None
    return wandb.init(project=project, name=name, config=config, dir=str(folder))
