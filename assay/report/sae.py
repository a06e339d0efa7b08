"""The view of an `assay sae train` folder: metrics, training curves and the feature browser.

Curves come from metrics.jsonl (train lines: loss, fvu, l0, dead_fraction, ...; evaluation
lines: eval/ce_loss_score, eval/fvu, ...). The feature browser comes from features.json, which
`assay sae train` writes after training (assay/sae/features.py); a latent attributed by a score
run on the page comes from that run's latent.json. Both are read as plain JSON: the report loads
no model and no SAE.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from assay.report import charts
from assay.report import html as h
from assay.report.common import ViewOptions, config_get, missing_note, settings_block, unfinished_note
from assay.report.links import Attributed, card_anchor
from assay.report.runs import Run

FEATURES_FILE = "features.json"
"""What `assay sae train` writes for the report (see assay/sae/features.py)."""
NO_BROWSER = (
    f"No feature browser: this run folder has no {FEATURES_FILE}. `assay sae train` writes it after "
    "training (--browser_latents, default 32; 0 skips it); rerunning the same command on a finished "
    "run writes it without retraining."
)

CURVES = (
    ("loss", "Training loss", False),
    ("fvu", "FVU (fraction of variance unexplained)", False),
    ("l0", "L0 (active latents per token)", False),
    ("dead_fraction", "Dead fraction", False),
    ("eval/ce_loss_score", "CE loss score (held-out, spliced)", False),
    ("eval/ce_spliced", "CE loss with the SAE spliced in", False),
)


def _series(records: list[dict], key: str) -> tuple[list[float], list[float]]:
    pts = [(r["step"], r[key]) for r in records if isinstance(r.get(key), int | float) and "step" in r]
    return [p[0] for p in pts], [p[1] for p in pts]


def training_curves(records: list[dict]) -> str:
    blocks = []
    for key, title, logy in CURVES:
        xs, ys = _series(records, key)
        if not xs:
            continue
        series = {key: (xs, ys)}
        if key == "fvu":
            ex, ey = _series(records, "eval/fvu")
            if ex:
                series = {"train": (xs, ys), "held-out": (ex, ey)}
        blocks.append(h.figure(charts.line_chart(series, title, logy=logy, markers=len(xs) < 12)))
    return h.grid(*blocks) if blocks else missing_note("training curves", "metrics.jsonl")


def final_metrics(run: Run, records: list[dict]) -> dict[str, Any]:
    """The last value of each metric (eval/... from the final evaluation), summary.json on top."""
    last: dict[str, Any] = {}
    for r in records:
        last.update({k: v for k, v in r.items() if v is not None})
    summary = run.json("summary.json") or {}
    flat = {k: v for k, v in summary.items() if not isinstance(v, dict)}
    for section in ("eval", "train"):
        if isinstance(summary.get(section), dict):
            prefix = "eval/" if section == "eval" else ""
            flat.update({prefix + k: v for k, v in summary[section].items()})
    return {**last, **flat}


def metric_tiles(m: dict[str, Any]) -> str:
    def pick(*keys: str) -> Any:
        return next((m[k] for k in keys if isinstance(m.get(k), int | float)), None)

    return h.tiles(
        [
            ("FVU (held-out)", pick("eval/fvu", "fvu")),
            ("L0", pick("eval/l0", "l0")),
            ("CE loss score", pick("eval/ce_loss_score", "ce_loss_score")),
            ("CE clean → spliced", _ce_pair(m)),
            ("dead fraction", pick("dead_fraction", "eval/dead_fraction_eval")),
            ("tokens trained", pick("tokens")),
            ("tokens / s", pick("tokens_per_s")),
        ],
        hints={
            "CE loss score": "(CE zero-ablated − CE spliced) / (CE zero-ablated − CE clean); 1 is perfect"
        },
    )


def _ce_pair(m: dict[str, Any]) -> str:
    clean, spliced = m.get("eval/ce_clean"), m.get("eval/ce_spliced")
    if isinstance(clean, int | float) and isinstance(spliced, int | float):
        return f"{clean:.3f} → {spliced:.3f}"
    return "–"


def context_html(ctx: dict[str, Any], scale: float) -> str:
    """Tokens shaded by activation (peak outlined, value on hover); inactive tokens stay plain text
    (one span per active token only keeps a page of dozens of latents small). `ctx` holds tokens,
    acts, peak (an index into tokens), max_act and example (a context of features.json)."""
    parts = []
    peak = int(ctx.get("peak", -1))
    for i, (tok, act) in enumerate(zip(ctx["tokens"], ctx["acts"])):
        alpha = 0.0 if scale <= 0 else min(max(act, 0.0) / scale, 1.0) * 0.85
        if act <= 0 and i != peak:
            parts.append(h.esc(tok))
            continue
        cls = "tok peak" if i == peak else "tok"
        style = f' style="background:rgba(234,88,12,{max(alpha, 0.06):.2f})"'
        parts.append(f'<span class="{cls}"{style} title="{act:.3f}">{h.esc(tok)}</span>')
    where = f"example {h.esc(ctx.get('example', '?'))}, peak {float(ctx.get('max_act', 0.0)):.3f}"
    return f'<div class="ctx" title="{where}">{"".join(parts)}</div>'


def token_chips(pairs: list, cls: str) -> str:
    chips = "".join(f'<span class="{cls}" title="{float(v):+.3f}">{h.esc(t)}</span>' for t, v in pairs)
    return f'<div class="tokens">{chips}</div>'


def feature_card(f: dict[str, Any], sae_run_name: str, anchors: list[str], contexts: int) -> str:
    """One latent of features.json: its top `contexts` contexts, activation histogram and logit
    effects; `anchors` name the score sections attributing it."""
    max_act = float(f.get("max_act", 0.0))
    shown = "".join(context_html(c, max_act) for c in f.get("contexts", [])[:contexts])
    side = h.figure(
        charts.histogram_bars(
            f.get("histogram", []), max_act, f"activations ({int(f.get('nonzero', 0)):,} tokens)"
        )
    )
    if f.get("promoted"):
        side += "<h4>Promotes</h4>" + token_chips(f["promoted"], "up")
        side += "<h4>Suppresses</h4>" + token_chips(f.get("suppressed", []), "down")
    facts = f"fires on {float(f.get('density', 0.0)):.2%} of tokens · max {max_act:.3f}"
    main = shown or "<p class='muted'>no activations</p>"
    return _card(int(f["latent"]), sae_run_name, anchors, facts, main, side)


def _card(latent: int, sae_run_name: str, anchors: list[str], facts: str, main: str, side: str) -> str:
    attributed = "".join(
        f' <a class="badge" href="#{h.esc(a)}">attributed to training data: {h.esc(a)}</a>' for a in anchors
    )
    head = (
        f'<div class="feature-head"><h4>Latent {latent}</h4><span class="muted">{h.esc(facts)}</span>'
        f"{attributed}</div>"
    )
    return (
        f'<div class="feature searchable" id="{h.esc(card_anchor(sae_run_name, latent))}">{head}'
        f'<div class="feature-grid"><div>{main}</div><div>{side}</div></div></div>'
    )


def pinned_cards(run: Run, saved: dict[int, dict], pinned: dict[int, Attributed], contexts: int) -> str:
    """The latents score runs on the page attribute: their record from features.json, else from the
    score run's latent.json, else a card saying why there is none."""
    cards = []
    for latent, link in sorted(pinned.items()):
        record = saved.get(latent) or link.record
        if record is not None:
            cards.append(feature_card(record, run.name, link.anchors, contexts))
        else:
            why = link.note or "no latent.json of those runs has its browser record"
            cards.append(
                _card(latent, run.name, link.anchors, "", h.note_box(f"No browser record: {why}"), "")
            )
    return "".join(cards)


def browser_summary(data: dict[str, Any]) -> str:
    """Tiles and the density histogram of every latent, from features.json's firing counts."""
    fired = np.asarray(data.get("fired", []), dtype=np.float64)
    tokens = int(data.get("tokens", 0))
    density = fired / max(tokens, 1)
    live = density[density > 0]
    source = data.get("source") or {}
    tiles = h.tiles(
        [
            ("texts read", int(data.get("examples", 0))),
            ("tokens", tokens),
            ("live latents", f"{len(live):,} of {len(fired):,}"),
            ("L0 on these texts", float(fired.sum()) / max(tokens, 1)),
            ("held-out texts", f"{source.get('dataset', '?')}:{source.get('split', '?')}"),
        ]
    )
    if not len(live):
        return tiles
    hist = charts.histogram(
        np.log10(live), "Latent density (live latents)", "log10 fraction of tokens fired", bins=30
    )
    return tiles + h.grid(h.figure(hist))


def browser_html(run: Run, opts: ViewOptions) -> str:
    """The feature browser: the latents attributed on the page first, then features.json's sample."""
    data = run.json(FEATURES_FILE)
    pinned = opts.links.for_sae(run)
    if data is not None and not isinstance(data.get("features"), list):
        data = None
        body = h.note_box(f"{FEATURES_FILE} is unreadable; rerun `assay sae train` to rewrite it.", "warn")
    else:
        body = "" if data is not None else h.note_box(NO_BROWSER, "warn")
    if data is None and not pinned:
        return body
    saved = {int(f["latent"]): f for f in (data or {}).get("features", [])}
    sample = [f for latent, f in saved.items() if latent not in pinned][: opts.features]
    scope = f"{h.slug(run.name)}-features"
    cards = pinned_cards(run, saved, pinned, opts.feature_examples)
    cards += "".join(feature_card(f, run.name, [], opts.feature_examples) for f in sample)
    if data is not None:
        body += browser_summary(data)
    body += f"<p class='muted'>{_which(len(pinned), len(sample))} " + (
        "Each shows its top activating held-out contexts (orange: activation, outlined: peak token; "
        "hover for values), the distribution of its nonzero activations, and the output tokens its "
        "decoder direction promotes and suppresses (W_dec·W_Uᵀ, final norm ignored).</p>"
    )
    return body + h.search_box(scope, "Search latents by token…") + f'<div id="{h.esc(scope)}">{cards}</div>'


def _which(pinned: int, sample: int) -> str:
    first = f"the first {sample} live latents by index (an unbiased sample)."
    if pinned:
        return f"The {pinned} latent(s) attributed to training data in this report, then " + first
    return first[0].upper() + first[1:]


def sae_parts(run: Run) -> list[tuple[str, Run]]:
    """(name, run) of each SAE in the folder: the run itself, or, for several SAEs from one pass
    (--hookpoints, --sweep_d_sae, --sweep_k), each SAE's subfolder as a run at its own hookpoint."""
    summary = run.json("summary.json") or {}
    saes = summary.get("saes") if isinstance(summary.get("saes"), dict) else None
    names = list(saes) if saes else [p.name for p in sorted(run.path.iterdir()) if (p / "cfg.json").is_file()]
    if not names or (run.path / "cfg.json").is_file():
        return [("", run)]
    parts = []
    for name in names:
        hook = (saes or {}).get(name, {}).get("hookpoint") or name
        config = {**run.config, "hookpoint": hook, "hookpoints": []}
        parts.append((name, Run(run.path / name, run.command, config, run.done, run.version)))
    return parts


def _sae_body(run: Run, opts: ViewOptions, anchor: str, level: int = 3) -> str:
    """One SAE's metric tiles, training curves and feature browser, under headings of `level`."""
    records = run.jsonl("metrics.jsonl")
    metrics = final_metrics(run, records)
    eval_json = run.json("eval.json") or {}
    metrics.update({f"eval/{k}": v for k, v in eval_json.items() if isinstance(v, int | float)})
    body = metric_tiles(metrics) + h.heading("Training curves", level) + training_curves(records)
    body += h.heading("Feature browser", level, anchor)
    if opts.features > 0:
        return body + browser_html(run, opts)
    return body + h.note_box("Feature browser hidden (--features 0).")


def sae_view(run: Run, opts: ViewOptions) -> h.Section:
    """Metrics, curves and the feature browser (of each SAE, when the run trained several); latents
    that score runs on the page attribute are pinned to the top of the browser, linked both ways."""
    parts = sae_parts(run)
    body, toc = unfinished_note(run), []
    for name, part in parts:
        anchor = f"{h.slug(run.name)}-{h.slug(name)}-browser" if name else f"{h.slug(run.name)}-browser"
        if name:
            body += h.heading(f"SAE {name}", 3)
        body += _sae_body(part, opts, anchor, 4 if name else 3)
        toc.append((anchor, f"Feature browser: {name}" if name else "Feature browser"))
    arch = config_get(run.config, "sae.architecture", "?")
    hooks = ", ".join(dict.fromkeys(str(part.config.get("hookpoint", "?")) for _, part in parts))
    count = f"{len(parts)} {arch} SAEs" if len(parts) > 1 else f"{arch} SAE"
    subtitle = f"{count} at {hooks} of {config_get(run.config, 'model.model', '?')}"
    sec = h.Section(run.name, run.command, body + settings_block(run), subtitle=subtitle)
    sec.toc = toc
    return sec
