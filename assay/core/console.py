"""The only place assay writes to the terminal: results to stdout, notes and warnings through
`logging` (the "assay" logger).

`say` prints a result the user asked for. `note` (progress, diagnostics) and `warn` (something
the user should look at) go to the "assay" logger, so a program or notebook decides what it
sees: `logging.getLogger("assay").setLevel(logging.WARNING)` keeps the warnings only (progress
bars hide too), `logging.basicConfig(level=logging.INFO)` shows the notes. The `assay` command
installs a handler (`install_cli_handler`) that prints each record as one plain line on stderr,
as the tool always did; `--quiet` keeps the warnings only.

Under torch.distributed only rank 0 speaks, so N processes don't print N copies.
"""

from __future__ import annotations

import logging
import os
import sys

LOGGER = logging.getLogger("assay")


def _is_main_process() -> bool:
    return os.environ.get("RANK", "0") == "0"


def say(message: str = "") -> None:
    """A result the user asked for (stdout)."""
    if _is_main_process():
        print(message, flush=True)


def note(message: str) -> None:
    """Progress and diagnostics (the "assay" logger at INFO), kept apart from results."""
    if _is_main_process():
        LOGGER.info(message)


def warn(message: str) -> None:
    """Something the user should look at (the "assay" logger at WARNING; shown even with --quiet)."""
    if _is_main_process():
        LOGGER.warning(message)


def quiet() -> bool:
    """Whether notes are switched off on the "assay" logger itself (--quiet, or a program's
    `setLevel(WARNING)`): progress bars then hide too."""
    return LOGGER.level > logging.INFO


class _StderrLines(logging.Handler):
    """Each record as one plain line on the current `sys.stderr` (looked up per record, so a
    redirected or captured stderr receives it)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            print(self.format(record), file=sys.stderr, flush=True)
        except Exception:  # a closed stream must not turn a note into a crash
            self.handleError(record)


def install_cli_handler(quiet: bool = False) -> None:
    """The command line's output: notes and warnings as plain lines on stderr (warnings only with
    `quiet`). Idempotent."""
    if not any(isinstance(h, _StderrLines) for h in LOGGER.handlers):
        handler = _StderrLines()
        handler.setFormatter(logging.Formatter("%(message)s"))
        LOGGER.addHandler(handler)
    LOGGER.setLevel(logging.WARNING if quiet else logging.INFO)
