"""The only place assay writes to the terminal: results to stdout, notes to stderr.

Under torch.distributed only rank 0 speaks, so N processes don't print N copies.
"""

from __future__ import annotations

import os
import sys


def _is_main_process() -> bool:
    return os.environ.get("RANK", "0") == "0"


def say(message: str = "") -> None:
    """A result the user asked for (stdout)."""
    if _is_main_process():
        print(message, flush=True)


def note(message: str) -> None:
    """Progress and diagnostics (stderr), kept apart from results."""
    if _is_main_process():
        print(message, file=sys.stderr, flush=True)
