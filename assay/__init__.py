"""assay: understand language models through their training data and their features."""

from typing import Any

__all__ = ["open_index"]


def open_index(path: Any) -> Any:
    """Open a gradient index built by `assay build` (memory-mapped; see docs/index-format.md)."""
    from assay.attribution.index import open_index as _open

    return _open(path)
