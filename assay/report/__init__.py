"""Self-contained HTML reports of assay run folders (`assay report`, `build_report`)."""

from assay.report.command import build_report

__all__ = ["build_report"]
