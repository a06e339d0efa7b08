"""Cells shared by an experiment's markdown tables and the HTML report that shows them.

Kept free of torch: the report reads finished results and should start fast.
"""

from __future__ import annotations

from typing import Any


def versus_baseline(vs: dict[str, Any] | None) -> str:
    """A row's mean difference to the baseline over seeds and the seeds it won ("-0.0135 (3/3)"),
    from an experiment's results ({"mean", "wins", "of"}); "–" where absent or NaN (no pool loss)."""
    if not vs or vs.get("mean") is None or vs["mean"] != vs["mean"]:
        return "–"
    return f"{vs['mean']:+.4f} ({vs['wins']}/{vs['of']})"
