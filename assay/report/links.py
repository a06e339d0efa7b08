"""Cross-links between sections: a latent attributed by a score run <-> its card in the SAE's browser.

Scanned before rendering: which SAE runs are on the page, and which of their latents some score
run on the page attributes (`assay score --query_sae SAE --latent L`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from assay.report import html as h
from assay.report.runs import Run


def section_anchor(run: Run) -> str:
    """The anchor a run's section gets (before de-duplication; see command._unique_anchors)."""
    return h.slug(f"{run.command}-{run.name}")


def card_anchor(sae_run_name: str, latent: int) -> str:
    """The anchor of a latent's card in an SAE run's feature browser."""
    return f"{h.slug(sae_run_name)}-latent-{latent}"


@dataclass
class Links:
    sae_runs: dict[Path, Run] = field(default_factory=dict)  # resolved SAE folder -> its run
    attributed: dict[Path, dict[int, list[str]]] = field(default_factory=dict)  # -> latent -> anchors

    def for_sae(self, run: Run) -> dict[int, list[str]]:
        """{latent: [score section anchors]} of the latents score runs attribute in this SAE."""
        return self.attributed.get(_key(run.path), {})

    def card_of(self, score_run: Run) -> str | None:
        """The anchor of the attributed latent's card, when its SAE run is on the page."""
        sae, latent = _sae_of(score_run)
        if sae is None or latent is None or sae not in self.sae_runs:
            return None
        return card_anchor(self.sae_runs[sae].name, latent)


def _key(path: Path) -> Path:
    """Resolved, with a trailing `.part` dropped (the report may be made inside OUT.part/)."""
    p = path.resolve()
    return p.with_name(p.name.removesuffix(".part"))


def _sae_of(run: Run) -> tuple[Path | None, int | None]:
    saved, latent = run.config.get("query_sae"), run.config.get("latent")
    if not saved or latent is None:
        return None, None
    p = Path(str(saved))
    for candidate in (p, run.path.parent / p.name, run.path.parent / p):
        if candidate.exists() or candidate.with_name(candidate.name + ".part").exists():
            return _key(candidate), int(latent)
    return _key(p), int(latent)


def _walk(runs: list[Run], depth: int = 0) -> list[Run]:
    out = []
    for run in runs:
        out.append(run)
        if depth < 2 and run.command != "coreset":
            out += _walk(run.children(), depth + 1)
    return out


def scan(runs: list[Run]) -> Links:
    links = Links()
    every = _walk(runs)
    for run in every:
        if run.command in ("sae train", "sae"):
            links.sae_runs[_key(run.path)] = run
    for run in every:
        sae, latent = _sae_of(run) if run.command == "score" else (None, None)
        if sae is not None and latent is not None:
            links.attributed.setdefault(sae, {}).setdefault(latent, []).append(section_anchor(run))
    return links
