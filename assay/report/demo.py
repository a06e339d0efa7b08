"""The overview of a folder that holds other runs (the demo, an experiment): what is inside.

Each stage gets one line: what it is for and its headline result, linked to its section, so a
new user sees the whole job at a glance before reading any detail.
"""

from __future__ import annotations

from typing import Any

from assay.report import html as h
from assay.report.common import config_get, settings_block, unfinished_note
from assay.report.runs import Run

WHAT = {
    "build": "Gradient index: one projected loss gradient per training example",
    "score": "Attribution: which training examples drive each query",
    "coreset": "Data selection proven by retraining",
    "sae train": "Sparse autoencoder: features of the model's activations",
    "sae eval": "Sparse autoencoder evaluation",
    "eval": "Held-out loss",
    "finetune": "Fine-tuning run",
    "filter": "Selected training examples",
}


def _num(value: Any, digits: int = 3) -> str:
    return f"{value:.{digits}f}" if isinstance(value, int | float) else "–"


def headline(run: Run) -> str:
    """One line of the stage's main result, from its own files ('' when there is none yet)."""
    summary = run.json("summary.json") or {}
    if run.command == "build":
        meta = run.json("index.json") or {}
        n, dim, precision = meta.get("num_examples", 0), meta.get("dim", "?"), meta.get("precision", "?")
        return f"{n:,} examples × {dim} dims at {precision}"
    if run.command == "score":
        first = run.jsonl("top.jsonl", limit=1)
        if not first or not first[0].get("proponents"):
            return ""
        pid, value = first[0]["proponents"][0]
        latent = run.config.get("latent")
        what = (
            f"latent {latent}"
            if run.config.get("query_sae") and latent is not None
            else f"query {first[0]['query']}"
        )
        queries = summary.get("num_queries", "?")
        return f"{queries} queries; {what}'s top proponent: train #{pid} (score {value:.3f})"
    if run.command in ("sae train", "sae eval"):
        fvu, l0 = summary.get("eval/fvu", summary.get("fvu")), summary.get("eval/l0", summary.get("l0"))
        return f"FVU {_num(fvu)}, L0 {_num(l0, 1)}, CE loss score {_num(summary.get('eval/ce_loss_score'))}"
    if run.command == "coreset":
        return _coreset_headline(run.json("results.json") or {})
    if run.command == "eval":
        return f"{_num(summary.get('mean_loss'))} nats/token over {summary.get('examples', '?')} examples"
    if run.command == "finetune":
        return f"eval loss {_num(summary.get('eval_loss'))} after {summary.get('steps', '?')} steps"
    return ""


def _coreset_headline(results: dict[str, Any]) -> str:
    rows = results.get("rows") or {}
    chosen = {k: v for k, v in rows.items() if k not in ("full", "random")}
    if not chosen or "random" not in rows:
        return ""
    best = min(chosen, key=lambda k: chosen[k]["eval_loss_stats"]["mean"])
    mean = chosen[best]["eval_loss_stats"]["mean"]
    random = rows["random"]["eval_loss_stats"]["mean"]
    return f"best selection {chosen[best].get('label', best)}: eval loss {mean:.4f} vs random {random:.4f}"


GLOSSARY = {
    "build": [
        ("gradient index", "one projected loss gradient per training example, on disk (memory-mapped)"),
    ],
    "score": [
        ("TrackStar score", "cosine of query and training gradients after optimizer-moment correction, "
         "random projection and R^(-1/2) whitening; 1 = the same direction"),
        ("proponent / opponent", "a training example whose gradient step would lower / raise the query's "
         "loss (for an SAE latent query: raise / suppress the latent)"),
    ],
    "coreset": [
        ("coreset experiment", "retrain on a selected fraction of the data; a lower held-out loss than a "
         "random selection of the same size means the method found the useful examples"),
    ],
    "sae train": [
        ("FVU", "fraction of the activations' variance the SAE fails to reconstruct (0 is perfect)"),
        ("L0", "latents active per token on average"),
        ("CE loss score", "how much of the model's loss the SAE preserves when spliced in: "
         "(CE zero-ablated − CE spliced) / (CE zero-ablated − CE clean); 1 is perfect"),
    ],
}  # fmt: skip


def glossary(children: list[Run]) -> str:
    """The terms the stages present use, one line each (folded)."""
    seen = {c.command for c in children}
    items = [(t, d) for cmd, terms in GLOSSARY.items() if cmd in seen for t, d in terms]
    if not items:
        return ""
    rows = "".join(f"<tr><th>{h.esc(t)}</th><td>{h.esc(d)}</td></tr>" for t, d in items)
    return h.details("How to read this report", f'<table class="kv">{rows}</table>', cls="block")


def _number_tiles(run: Run) -> str:
    """Every top-level JSON file of flat values (e.g. the demo's losses.json) as headline tiles."""
    blocks = []
    for path in sorted(run.path.glob("*.json")):
        if path.name in ("config.json", "run.json"):
            continue
        data = run.json(path.name)
        if not isinstance(data, dict):
            continue
        flat = [
            (k, v) for k, v in data.items() if isinstance(v, int | float | str) and not isinstance(v, bool)
        ]
        nested = [(f"{k}: {k2}", v2) for k, v in data.items() if isinstance(v, dict) for k2, v2 in v.items()
                  if isinstance(v2, int | float) and not isinstance(v2, bool)]  # fmt: skip
        items = (flat + nested)[:16]
        if items:
            blocks.append(f"<h4>{h.esc(path.stem.replace('_', ' '))}</h4>" + h.tiles(items))
    return "".join(blocks)


def demo_overview(run: Run, children: list[Run]) -> h.Section:
    """Headline numbers and the list of stages, each with what it shows and its main result."""
    # A container whose stages are all finished is whole: its own run.json is written just after
    # the report (the demo writes report.html as its last step, inside OUT.part/).
    body = "" if all(c.finished for c in children) else unfinished_note(run)
    rows = []
    for child in children:
        anchor = h.slug(f"{child.command}-{child.name}")
        link = f'<a href="#{h.esc(anchor)}">{h.esc(child.name)}</a>'
        status = "" if child.finished else ' <span class="badge small">unfinished</span>'
        try:
            result = headline(child)
        except (KeyError, TypeError, ValueError):
            result = ""
        rows.append((link + status, f"assay {child.command}", WHAT.get(child.command, ""), result))
    model = config_get(run.config, "model")
    model = model if isinstance(model, str) else config_get(run.config, "model.model", "")
    intro = (
        f"One <code>assay {h.esc(run.command)}</code> made the {len(children)} runs below, each a folder of "
        "its own. This table says what each one shows and its main result; every stage has its own section "
        "further down (the contents on the left jump to them)."
    )
    body += f"<p>{intro}</p>"
    if rows:
        body += h.table(
            ["stage", "command", "what it shows", "main result"], rows, raw_columns=(0,), cls="stages"
        )
    body += _number_tiles(run)
    body += glossary(children)
    body += settings_block(run)
    subtitle = f"model {model}" if model else ""
    return h.Section(run.name, run.command, body, subtitle=subtitle)
