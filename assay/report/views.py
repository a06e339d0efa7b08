"""Which view renders a run folder: one table keyed by the command that made it.

A view takes the run and the page's `ViewOptions` and returns its section; it only reads files
of run folders. A command missing from the table gets the generic view (its summary numbers and
settings), or the container overview when the folder holds other runs (a demo).
"""

from __future__ import annotations

from collections.abc import Callable

from assay.report import coreset, index_view, sae, scores, selection, training
from assay.report import html as h
from assay.report.common import ViewOptions
from assay.report.runs import Run

View = Callable[[Run, ViewOptions], h.Section]


def _plain(section: Callable[[Run], h.Section]) -> View:
    """A view that needs no options."""

    def view(run: Run, opts: ViewOptions) -> h.Section:
        return section(run)

    return view


VIEWS: dict[str, View] = {
    "build": _plain(index_view.build_section),
    "score": scores.score_view,
    "coreset": _plain(coreset.coreset_section),
    "filter": _plain(selection.filter_section),
    "sae train": sae.sae_view,
    "sae eval": sae.sae_view,
    "sae": sae.sae_view,
    "eval": _plain(training.eval_section),
    "finetune": _plain(training.finetune_section),
}
"""command (config.json's "command") -> its view."""


def view_of(command: str) -> View | None:
    """The view of a command's folders, or None for the generic one."""
    return VIEWS.get(command)
