"""Where assay keeps prepared data and converted models between runs."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from assay.core.errors import AssayError


def cache_dir() -> Path:
    """The user cache folder: `$ASSAY_CACHE`, else `~/.cache/assay`."""
    return Path(os.environ.get("ASSAY_CACHE", Path.home() / ".cache" / "assay"))


def assets_dir() -> Path:
    """Files shipped inside the package (the assay-tiny checkpoint)."""
    return Path(__file__).resolve().parent.parent / "assets"


def as_path(value: Any, what: str) -> Path:
    """`value` as a Path, or one line when it is not a path (None, a number, a list)."""
    if isinstance(value, str | os.PathLike) and str(value):
        return Path(value)
    got = "an empty string" if isinstance(value, str) else "None" if value is None else type(value).__name__
    raise AssayError(f"{what} must be a path (a str or pathlib.Path), not {got}")
