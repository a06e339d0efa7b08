"""The view of an `assay sae train` folder: training curves and the feature browser.

Curves come from metrics.jsonl (train lines: loss, fvu, l0, dead_fraction, ...; evaluation
lines: eval/ce_loss_score, eval/fvu, ...). The feature browser needs the model, the SAE and
held-out text: it is computed here (bounded; see features.py) from the run's saved config.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from assay.core.console import note
from assay.report import charts
from assay.report import html as h
from assay.report.common import config_get, missing_note, settings_block, unfinished_note
from assay.report.features import Feature, FeatureBrowser
from assay.report.links import card_anchor
from assay.report.runs import Run

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


def context_html(ctx: Any, scale: float) -> str:
    """Tokens shaded by activation (peak outlined, value on hover); inactive tokens stay plain text
    (one span per active token only keeps a page of dozens of latents small)."""
    parts = []
    for i, (tok, act) in enumerate(zip(ctx.tokens, ctx.acts)):
        alpha = 0.0 if scale <= 0 else min(max(act, 0.0) / scale, 1.0) * 0.85
        if act <= 0 and i != ctx.peak:
            parts.append(h.esc(tok))
            continue
        cls = "tok peak" if i == ctx.peak else "tok"
        style = f' style="background:rgba(234,88,12,{max(alpha, 0.06):.2f})"'
        parts.append(f'<span class="{cls}"{style} title="{act:.3f}">{h.esc(tok)}</span>')
    return f'<div class="ctx" title="example {ctx.example}, peak {ctx.max_act:.3f}">{"".join(parts)}</div>'


def token_chips(pairs: list[tuple[str, float]], cls: str) -> str:
    chips = "".join(f'<span class="{cls}" title="{v:+.3f}">{h.esc(t)}</span>' for t, v in pairs)
    return f'<div class="tokens">{chips}</div>'


def feature_card(f: Feature, sae_run_name: str, links: dict[int, list[str]]) -> str:
    """One latent: contexts, histogram, logit effects; `links` name score sections attributing it."""
    contexts = (
        "".join(context_html(c, f.max_act) for c in f.contexts) or "<p class='muted'>no activations</p>"
    )
    side = h.figure(charts.small_histogram(f.values, f"activations ({len(f.values):,} tokens)"))
    if f.promoted:
        side += "<h4>Promotes</h4>" + token_chips(f.promoted, "up")
        side += "<h4>Suppresses</h4>" + token_chips(f.suppressed, "down")
    attributed = "".join(
        f' <a class="badge" href="#{h.esc(a)}">attributed to training data: {h.esc(a)}</a>'
        for a in links.get(f.latent, [])
    )
    head = (
        f'<div class="feature-head"><h4>Latent {f.latent}</h4><span class="muted">fires on '
        f"{f.density:.2%} of tokens · max {f.max_act:.3f}</span>{attributed}</div>"
    )
    return (
        f'<div class="feature searchable" id="{h.esc(card_anchor(sae_run_name, f.latent))}">{head}'
        f'<div class="feature-grid"><div>{contexts}</div><div>{side}</div></div></div>'
    )


def browser_html(run: Run, fb: FeatureBrowser, links: dict[int, list[str]]) -> str:
    scope = f"{h.slug(run.name)}-features"
    dens = fb.density[fb.density > 0]
    summary = h.tiles(
        [
            ("texts read", fb.examples),
            ("tokens", fb.tokens),
            ("live latents", f"{len(dens):,} of {len(fb.density):,}"),
            ("L0 on these texts", fb.l0),
        ]
    )
    hist = h.figure(
        charts.histogram(
            np.log10(dens), "Latent density (live latents)", "log10 fraction of tokens fired", bins=30
        )
    )
    intro = (
        f"<p class='muted'>{_which(fb, links)} "
        "Each shows its top activating held-out contexts (orange: activation, outlined: peak token; "
        "hover for values), the distribution of its nonzero activations, and the output tokens its "
        "decoder direction promotes and suppresses (W_dec·W_Uᵀ, final norm ignored).</p>"
    )
    cards = "".join(feature_card(f, run.name, links) for f in fb.features)
    return (
        summary + h.grid(hist) + intro + h.search_box(scope, "Search latents by token…")
        + f'<div id="{h.esc(scope)}">{cards}</div>'
    )  # fmt: skip


def _which(fb: FeatureBrowser, links: dict[int, list[str]]) -> str:
    pinned = sum(1 for f in fb.features if f.latent in links)
    sample = f"the first {len(fb.features) - pinned} live latents by index (an unbiased sample)."
    return (
        (f"The {pinned} latent(s) attributed to training data in this report, then " + sample)
        if pinned
        else (sample[0].upper() + sample[1:])
    )


def compute_browser(
    run: Run, num_latents: int, num_examples: int, device: str, first: tuple[int, ...] = ()
) -> FeatureBrowser:
    """Load model, tokenizer, SAE and held-out texts from the run's config; run features.browse."""
    from assay.bridge.latent import load_hooked_sae
    from assay.core.config import DataConfig, ModelConfig, RuntimeConfig
    from assay.core.runs import config_from_dict
    from assay.lm.data import load_examples
    from assay.lm.models import load_model, load_tokenizer, setup_runtime
    from assay.report.features import browse

    cfg = run.config
    sae = load_hooked_sae(run.path, hookpoint=cfg.get("hookpoint"))
    model_cfg = config_from_dict(ModelConfig, cfg.get("model") or {})
    data = config_from_dict(DataConfig, cfg.get("data") or {})
    data = dataclasses.replace(data, split=cfg.get("eval_split", "eval"), max_samples=num_examples)
    dev, policy = setup_runtime(RuntimeConfig(precision="fp32", device=device))  # type: ignore[arg-type]
    tokenizer = load_tokenizer(model_cfg)
    _, examples = load_examples(data, tokenizer)
    model = load_model(model_cfg, policy, "auto").eval()
    length = int(cfg.get("context_length") or 128)
    seqs = [examples.tokens_of(i)[:length] for i in range(len(examples))]
    keep = [i for i, s in enumerate(seqs) if len(s) > 1]
    return browse(
        model,
        tokenizer,
        sae,
        [seqs[i] for i in keep],
        [int(examples.ids[i]) for i in keep],
        num_latents,
        dev,
        first=first,
    )


def sae_section(
    run: Run,
    num_latents: int = 32,
    num_examples: int = 200,
    device: str = "auto",
    links: dict[int, list[str]] | None = None,
) -> h.Section:
    """Metrics, curves and the feature browser; `links` {latent: [score section anchors]} pins the
    latents attributed elsewhere in the report to the top of the browser, linked both ways."""
    records = run.jsonl("metrics.jsonl")
    body = unfinished_note(run)
    metrics = final_metrics(run, records)
    eval_json = run.json("eval.json") or {}
    metrics.update({f"eval/{k}": v for k, v in eval_json.items() if isinstance(v, int | float)})
    body += metric_tiles(metrics)
    body += h.h3("Training curves") + training_curves(records)
    anchor = f"{h.slug(run.name)}-browser"
    body += h.h3("Feature browser", anchor)
    if num_latents > 0:
        try:
            links = links or {}
            fb = compute_browser(run, num_latents, num_examples, device, tuple(links))
            body += browser_html(run, fb, links)
        except Exception as e:  # noqa: BLE001 - the curves stay useful without the browser
            note(f"report: feature browser of {run.name} unavailable ({type(e).__name__}: {e})")
            body += h.note_box(f"Feature browser unavailable: {type(e).__name__}: {e}", "warn")
    else:
        body += h.note_box("Feature browser switched off (--features 0).")
    arch = config_get(run.config, "sae.architecture", "?")
    subtitle = (
        f"{arch} SAE at {run.config.get('hookpoint', '?')} of {config_get(run.config, 'model.model', '?')}"
    )
    sec = h.Section(run.name, run.command, body + settings_block(run), subtitle=subtitle)
    sec.toc = [(anchor, "Feature browser")]
    return sec
