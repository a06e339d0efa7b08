"""Cross-links between sections: a latent attributed by a score run <-> its card in the SAE's browser.

Scanned before rendering: which SAE runs are on the page, and which of their latents some score
run on the page attributes (`assay score --query_sae SAE --latent L`). The latent's own browser
record comes from that score run's latent.json, so the SAE's browser can pin it first even when
its features.json does not hold it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from assay.report import html as h
from assay.report.runs import SHOWS_OWN_STAGES, Run

LATENT_FILE = "latent.json"
"""What `assay score --query_sae --latent` writes for the report (see assay/commands/score.py)."""


def section_anchor(run: Run) -> str:
    """The anchor a run's section gets (before de-duplication; see command.unique_anchors)."""
    return h.slug(f"{run.command}-{run.name}")


def card_anchor(sae_run_name: str, latent: int) -> str:
    """The anchor of a latent's card in an SAE run's feature browser."""
    return f"{h.slug(sae_run_name)}-latent-{latent}"


@dataclass
class Attributed:
    """A latent that score runs on the page attribute to training data."""

    anchors: list[str] = field(default_factory=list)
    """The sections of those score runs."""
    record: dict[str, Any] | None = None
    """The latent's feature-browser record (from the first latent.json that has one)."""
    note: str = ""
    """Why no latent.json had a record (shown on the latent's card)."""


@dataclass
class Links:
    """Which SAE runs are on the page, and the latents of each that score runs attribute."""

    sae_runs: dict[Path, Run] = field(default_factory=dict)
    """Resolved SAE folder -> its run."""
    attributed: dict[Path, dict[int, Attributed]] = field(default_factory=dict)
    """Resolved SAE folder -> latent -> the score runs attributing it."""
    queried: dict[Path, tuple[Path, int]] = field(default_factory=dict)
    """Resolved score folder -> (resolved SAE folder, latent) it attributes."""

    def for_sae(self, run: Run) -> dict[int, Attributed]:
        """{latent: Attributed} of the latents score runs on the page attribute in this SAE."""
        return self.attributed.get(folder_key(run.path), {})

    def card_of(self, score_run: Run) -> str | None:
        """The anchor of the attributed latent's card, when its SAE run is on the page."""
        sae, latent = self.queried.get(folder_key(score_run.path), (None, None))
        if sae is None or latent is None or sae not in self.sae_runs:
            return None
        return card_anchor(self.sae_runs[sae].name, latent)


def folder_key(path: Path) -> Path:
    """Resolved, with a trailing `.part` dropped (the report may be made inside OUT.part/)."""
    p = path.resolve()
    return p.with_name(p.name.removesuffix(".part"))


def sae_of(run: Run, on_page: Iterable[Path] = ()) -> tuple[Path | None, int | None]:
    """(the SAE folder, the latent) a latent-attribution score run names; (None, None) otherwise.
    A saved relative or moved path is looked up beside the run too (a copied demo folder); a
    candidate that is on the page wins."""
    saved, latent = run.config.get("query_sae"), run.config.get("latent")
    if run.command != "score" or not saved or latent is None:
        return None, None
    p = Path(str(saved))
    candidates = (p, run.path.parent / p.name, run.path.parent / p)
    found = [c for c in candidates if c.exists() or c.with_name(c.name + ".part").exists()]
    keys = [folder_key(c) for c in found] or [folder_key(p)]
    page = set(on_page)
    return next((k for k in keys if k in page), keys[0]), int(latent)


def walk(runs: list[Run], depth: int = 0) -> list[Run]:
    """The runs and their nested stages (two levels; an experiment's own stages excluded)."""
    out = []
    for run in runs:
        out.append(run)
        if depth < 2 and run.command not in SHOWS_OWN_STAGES:
            out += walk(run.children(), depth + 1)
    return out


def scan(runs: list[Run]) -> Links:
    """The links between the SAE runs and the latent-attribution score runs among `runs`."""
    links = Links()
    every = walk(runs)
    for run in every:
        if run.command in ("sae train", "sae"):
            links.sae_runs[folder_key(run.path)] = run
    for run in every:
        sae, latent = sae_of(run, links.sae_runs)
        if sae is None or latent is None:
            continue
        links.queried[folder_key(run.path)] = (sae, latent)
        entry = links.attributed.setdefault(sae, {}).setdefault(latent, Attributed())
        entry.anchors.append(section_anchor(run))
        saved = run.json(LATENT_FILE)
        if entry.record is None and isinstance(saved, dict) and isinstance(saved.get("feature"), dict):
            entry.record = saved["feature"]
        elif entry.record is None and not entry.note:
            entry.note = (
                str(saved.get("feature_note") or "")
                if isinstance(saved, dict)
                else f"{run.name} has no {LATENT_FILE} (written by `assay score --query_sae --latent`)"
            )
    return links
