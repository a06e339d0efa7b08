"""`assay report RUN_DIR... -o report.html`: one self-contained HTML page for any run folders.

Each folder's kind comes from its config.json "command"; folders that hold other run folders
(a demo, an experiment) get their own overview followed by a section per nested run.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated

import tyro

from assay.core.console import note
from assay.core.errors import AssayError
from assay.report import html as h
from assay.report.links import Links, scan
from assay.report.runs import Run, open_run


@dataclass
class ReportConfig:
    """Write one self-contained HTML report (opens from disk, no network) for run folders."""

    runs: tyro.conf.Positional[Annotated[tuple[str, ...], tyro.conf.arg(metavar="RUN_DIR...")]]
    """Run folders: any output of build, score, coreset, sae train, eval, finetune or demo."""
    out: Annotated[str, tyro.conf.arg(aliases=("-o",))] = "report.html"
    """The HTML file to write (an existing assay report there is replaced)."""
    title: str | None = None
    """Page title (default: the run folders' names)."""
    features: int = 32
    """SAE runs: latents shown in the feature browser (the first live ones by index; 0: none)."""
    feature_examples: int = 200
    """SAE runs: texts read to find each latent's top activating contexts."""
    device: str = "auto"
    """Device for the SAE feature browser's forward passes (cpu, cuda, auto)."""

    def __post_init__(self) -> None:
        if not self.runs:
            raise AssayError("give at least one run folder: assay report RUN_DIR... -o report.html")
        if self.features < 0 or self.feature_examples < 1:
            raise AssayError("--features must be >= 0 and --feature_examples positive")


@dataclass
class Options:
    """What the section renderers may be asked to bound (from the config)."""

    features: int = 32
    feature_examples: int = 200
    device: str = "auto"
    links: Links = field(default_factory=Links)


def _renderer(command: str) -> Callable[[Run, Options], h.Section] | None:
    """The section view of a command's folders (imported lazily), or None for the generic one."""
    from assay.report import index_view, scores, training

    if command == "score":
        return lambda run, opts: scores.score_section(run, opts.links.card_of(run))
    simple: dict[str, Callable[[Run], h.Section]] = {
        "build": index_view.build_section,
        "eval": training.eval_section,
        "finetune": training.finetune_section,
    }
    if command in simple:
        fn = simple[command]
        return lambda run, opts: fn(run)
    if command == "coreset":
        from assay.report.coreset import coreset_section

        return lambda run, opts: coreset_section(run)
    if command in ("sae train", "sae eval", "sae"):
        from assay.report.sae import sae_section

        return lambda run, opts: sae_section(
            run, opts.features, opts.feature_examples, opts.device, opts.links.for_sae(run)
        )
    return None


def sections_of(run: Run, opts: Options, depth: int = 0) -> list[h.Section]:
    """The run's own section, then (for containers such as a demo) its nested runs' sections."""
    from assay.report.common import generic_section
    from assay.report.demo import demo_overview

    children = run.children() if depth < 2 else []
    render = _renderer(run.command)
    if render is not None:
        out = [render(run, opts)]
        nested = [] if run.command == "coreset" else children  # an experiment shows its own stages
    elif children:
        out, nested = [demo_overview(run, children)], children
    else:
        out, nested = [generic_section(run)], []
    for child in nested:
        try:
            out += sections_of(child, opts, depth + 1)
        except Exception as e:  # noqa: BLE001 - one broken stage must not hide the others
            out.append(_failed(child, e))
    return out


def _failed(run: Run, error: Exception) -> h.Section:
    note(f"report: could not render {run.path} ({type(error).__name__}: {error})")
    body = h.note_box(f"This section could not be rendered: {type(error).__name__}: {error}", "warn")
    return h.Section(run.name, run.command, body)


def _unique_anchors(sections: list[h.Section]) -> None:
    seen: set[str] = set()
    for s in sections:
        base = h.slug(f"{s.kind}-{s.title}")
        anchor, i = base, 2
        while anchor in seen:
            anchor, i = f"{base}-{i}", i + 1
        seen.add(anchor)
        s.anchor = anchor


def render_page(run_dirs: list[Path], title: str, opts: Options) -> str:
    runs = [open_run(p) for p in run_dirs]
    opts.links = scan(runs)
    sections: list[h.Section] = []
    for run in runs:
        try:
            sections += sections_of(run, opts)
        except AssayError:
            raise
        except Exception as e:  # noqa: BLE001 - show the others, say which one failed
            sections.append(_failed(run, e))
    _unique_anchors(sections)
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    intro = f"<p>{h.esc(', '.join(str(p) for p in run_dirs))}</p>"
    if any(r.command == "demo" for r in runs):
        intro = f"<p class='lead'>{h.esc(ABOUT)}</p>" + intro
    return h.page(
        title,
        sections,
        intro,
        footer=f"Generated by assay report on {when}. Self-contained: no network needed.",
    )


ABOUT = (
    "assay studies a language model through its training data (which training examples drive a "
    "prediction, found from mixed-precision per-example gradients, and proven by retraining on a "
    "selection) and through its features (sparse autoencoders, whose latents can themselves be "
    "attributed to training data)."
)


def _check_target(out: Path) -> None:
    """Replace an earlier assay report, never another file."""
    if out.is_dir():
        raise AssayError(f"{out} is a folder; give an .html file path with -o")
    if out.exists():
        head = out.read_text(errors="replace")[:2000]
        if f'content="{h.GENERATOR}"' not in head:
            raise AssayError(f"{out} exists and is not an assay report; choose another -o path")


def build_report(
    run_dirs: list[Path], out_html: Path, title: str | None = None, **options: int | str
) -> Path:
    """Write one HTML page with a section per run folder (and per nested stage); returns its path."""
    run_dirs = [Path(p) for p in run_dirs]
    out_html = Path(out_html)
    _check_target(out_html)
    title = title or "assay report — " + ", ".join(p.name for p in run_dirs)
    text = render_page(run_dirs, title, Options(**options))  # type: ignore[arg-type]
    out_html.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_html.with_name(out_html.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, out_html)
    return out_html
