"""Pieces every section uses: the views' options, the run's settings block, the generic view."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from assay.report import html as h
from assay.report.links import Links
from assay.report.runs import Run, flat_config


@dataclass
class ViewOptions:
    """What a view is given besides its run: display limits (from `assay report`'s flags) and the
    page's cross-links. Views only read run folders; nothing here makes them compute."""

    features: int = 32
    """SAE runs: latents shown per feature browser, at most what features.json holds (0: none)."""
    feature_examples: int = 8
    """SAE runs: top activating contexts shown per latent, at most what features.json holds."""
    links: Links = field(default_factory=Links)
    """Which SAE latents score runs on the page attribute (scanned before rendering)."""


# Config keys people look for first, in this order; the rest follow folded.
KEY_SETTINGS = ("model.model", "data.dataset", "data.split", "data.max_samples", "runtime.precision")


def settings_block(run: Run, extra: list[tuple[str, Any]] | None = None) -> str:
    """A folded block: where the run lives, when it finished, and every setting it ran with."""
    status = f"finished {run.done.get('finished', '')}" if run.done is not None else "unfinished (.part)"
    pairs = [("folder", str(run.path)), ("command", f"assay {run.command}"), ("status", status)]
    if run.version:
        pairs.append(("assay version", run.version))
    pairs += extra or []
    pairs += [(k, v) for k, v in flat_config(run.config) if k != "overwrite"]
    return h.details("Settings and provenance", h.kv_table(pairs), cls="block")


def unfinished_note(run: Run) -> str:
    if run.finished:
        return ""
    return h.note_box(
        f"{run.path.name} is unfinished: its command was interrupted or is still running; "
        "rerun the same command to complete it. What is shown is what has been written so far.",
        "warn",
    )


def missing_note(what: str, files: str) -> str:
    return h.note_box(f"No {what}: this run folder has no {files}.", "warn")


def config_get(config: dict[str, Any], dotted: str, default: Any = None) -> Any:
    """config["a"]["b"] for "a.b", or `default` when any level is missing."""
    value: Any = config
    for part in dotted.split("."):
        if not isinstance(value, dict) or part not in value:
            return default
        value = value[part]
    return value


def generic_section(run: Run, opts: ViewOptions | None = None) -> h.Section:
    """Any run the report has no dedicated view for: its summary numbers and settings."""
    summary = run.json("summary.json") or {}
    numbers = [(k, v) for k, v in summary.items() if isinstance(v, int | float) and not isinstance(v, bool)]
    body = unfinished_note(run)
    body += h.tiles(numbers[:8]) if numbers else h.note_box("This run folder has no summary.json.")
    if len(numbers) > 8:
        body += h.kv_table(numbers[8:])
    body += settings_block(run)
    return h.Section(run.name, run.command, body, subtitle=str(config_get(run.config, "model.model", "")))
