"""`assay report RUN_DIR... -o report.html`: one self-contained HTML page for any run folders."""

from __future__ import annotations

from pathlib import Path

from assay.core.console import say
from assay.report.command import ReportConfig, build_report

Config = ReportConfig


def run(cfg: ReportConfig) -> Path:
    out = build_report(
        [Path(r) for r in cfg.runs], Path(cfg.out), cfg.title,
        features=cfg.features, feature_examples=cfg.feature_examples,
    )  # fmt: skip
    size = out.stat().st_size
    say(f"report: {out} ({size / 1024:,.0f} KB); open it in a browser (no server needed)")
    return out
