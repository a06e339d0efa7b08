"""Where assay keeps prepared data and converted models between runs."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """The user cache folder: `$ASSAY_CACHE`, else `~/.cache/assay`."""
    return Path(os.environ.get("ASSAY_CACHE", Path.home() / ".cache" / "assay"))


def assets_dir() -> Path:
    """Files shipped inside the package (the assay-tiny checkpoint)."""
    return Path(__file__).resolve().parent.parent / "assets"
