"""The view of an `assay score` folder: each query with its top proponents and opponents.

Reads top.jsonl, queries.jsonl and summary.json; training texts come from the index's saved
data config (when that dataset can still be loaded), else only ids are shown.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from assay.core.console import note
from assay.report import html as h
from assay.report.common import missing_note, settings_block, unfinished_note
from assay.report.runs import Run

MAX_QUERIES = 100  # cards on the page; the rest are counted


def index_info(run: Run, summary: dict[str, Any]) -> tuple[dict[int, str], dict[int, float], str]:
    """(training texts by id, summed loss by id, index path) for the ids shown, when reachable."""
    from assay.attribution.index import open_index
    from assay.attribution.score import train_texts
    from assay.core.errors import AssayError

    path = _find_index(run, str(summary.get("index") or run.config.get("index") or ""))
    records = run.jsonl("top.jsonl")
    wanted = {
        int(pid) for r in records[:MAX_QUERIES] for pid, _ in r.get("proponents", []) + r.get("opponents", [])
    }
    try:
        index = open_index(Path(path))
    except (AssayError, OSError) as e:
        note(f"report: training texts unavailable for {run.name} ({e})")
        return {}, {}, str(path)
    losses = {int(i): float(v) for i, v in zip(index.ids, np.asarray(index.losses))}
    try:
        texts = train_texts(index, wanted)
    except Exception as e:  # noqa: BLE001 - a dataset that no longer loads: show ids only
        note(f"report: training texts unavailable for {run.name} ({type(e).__name__}: {e})")
        texts = {}
    return texts, {i: losses[i] for i in wanted if i in losses}, str(path)


def _find_index(run: Run, saved: str) -> Path:
    """The index a score run used: as saved, else beside the run (a moved or copied demo folder)."""
    p = Path(saved)
    for candidate in (p, run.path.parent / p, run.path.parent / p.name, run.path.parent.parent / p):
        if (candidate / "index.json").exists():
            return candidate
    return p


def ranked_table(pairs: list, texts: dict[int, str], losses: dict[int, float], scale: float) -> str:
    rows = []
    for rank, (pid, value) in enumerate(pairs, 1):
        text = texts.get(int(pid))
        rows.append(
            (
                rank,
                h.bar_cell(float(value), scale, f"{float(value):.4f}"),
                int(pid),
                losses.get(int(pid)),
                h.folded_text(text) if text is not None else '<span class="muted">(text unavailable)</span>',
            )
        )
    return h.table(
        ["#", "score", "train id", "loss (sum)", "text"],
        rows,
        numeric=(0, 2, 3),
        raw_columns=(1, 4),
        cls="ranked",
    )


def query_card(
    record: dict,
    query_text: str | None,
    texts: dict,
    losses: dict,
    labels: tuple[str, str],
    extra_html: str = "",
) -> str:
    pros, opps = record.get("proponents", []), record.get("opponents", [])
    scale = max([abs(float(v)) for _, v in pros + opps] or [1.0])
    label = record.get("query")
    if record.get("queries") is not None:
        head = f"{label} over {len(record['queries'])} queries"
        listed = "".join(f"<li>{h.folded_text(str(q))}</li>" for q in record.get("query_texts", []))
        text_html = (
            h.details(f"the {len(record['queries'])} queries", f"<ul>{listed}</ul>", cls="block")
            if listed
            else ""
        )
    else:
        head = f"query {label}"
        text_html = h.folded_text(query_text, preview_chars=220, preview_lines=3) if query_text else ""
        text_html = f'<div class="query-text">{text_html}</div>' if text_html else ""
    text_html += extra_html
    return (
        f'<div class="card searchable"><h4>{h.esc(head)}</h4>{text_html}'
        f"<h4>{h.esc(labels[0])}</h4>{ranked_table(pros, texts, losses, scale)}"
        + (h.details(h.esc(labels[1]), ranked_table(opps, texts, losses, scale), cls="block") if opps else "")
        + "</div>"
    )


def _latent_views(run: Run, index_path: Path, texts: dict[str, str]) -> dict[str, str]:
    if not latent_subtitle(run) or not any(texts.values()):
        return {}
    try:
        return latent_in_queries(run, index_path, {k: v for k, v in texts.items() if v})
    except Exception as e:  # noqa: BLE001 - the scores stay useful without the highlighting
        note(f"report: cannot show where the latent fires in {run.name}'s queries ({type(e).__name__}: {e})")
        return {}


def latent_subtitle(run: Run) -> str | None:
    """For a latent-attribution run (`--query_sae/--latent`), what the query is."""
    sae, latent = run.config.get("query_sae"), run.config.get("latent")
    if not sae or latent is None:
        return None
    return f"query: SAE latent {latent} of {sae} — which training examples most increase this feature?"


def score_section(run: Run, latent_card: str | None = None) -> h.Section:
    """Queries with their proponents and opponents; `latent_card` links a latent query to its card."""
    summary = run.json("summary.json") or {}
    records = run.jsonl("top.jsonl")
    body = unfinished_note(run)
    latent = latent_subtitle(run)
    if not records:
        body += missing_note("scores", "top.jsonl")
        return h.Section(run.name, "score", body + settings_block(run))
    queries = {str(q.get("query")): q.get("text", "") for q in run.jsonl("queries.jsonl")}
    texts, losses, index_path = index_info(run, summary)
    body += h.tiles(
        [
            ("queries", int(summary.get("num_queries", len(queries) or len(records)))),
            ("training examples", int(summary.get("num_rows", 0))),
            ("mode", str(summary.get("mode", run.config.get("mode", "–")))),
            ("aggregate", str(summary.get("aggregate", run.config.get("aggregate", "none")))),
            ("precision", str(summary.get("precision", "–"))),
            ("λ (query mix)", summary.get("mix")),
            ("rows / s", summary.get("rows_per_s")),
        ],
        hints={"λ (query mix)": "R = λ·R_query + (1-λ)·R_train (TrackStar)"},
    )
    labels = ("Proponents (a step on them lowers the query's loss)", "Opponents (a step on them raises it)")
    if latent:
        body += h.note_box(latent + " Proponents are the examples whose training step raises the latent.")
        if latent_card:
            body += f'<p><a href="#{h.esc(latent_card)}">See this latent in the feature browser →</a></p>'
        labels = ("Proponents (a step on them raises the latent)", "Opponents (a step on them suppresses it)")
    scope = f"{h.slug(run.name)}-queries"
    shown = records[:MAX_QUERIES]
    fires = _latent_views(
        run, Path(index_path), {str(r["query"]): queries.get(str(r["query"]), "") for r in shown}
    )
    for r in shown:  # an aggregate column lists the texts of the queries it averages
        if r.get("queries") is not None:
            r["query_texts"] = [queries.get(str(q), str(q)) for q in r["queries"]]
    cards = [
        query_card(
            r, queries.get(str(r.get("query"))), texts, losses, labels, fires.get(str(r.get("query")), "")
        )
        for r in shown
    ]
    more = (
        f"<p class='muted'>{len(records) - MAX_QUERIES} more queries in top.jsonl.</p>"
        if len(records) > MAX_QUERIES
        else ""
    )
    body += h.search_box(scope, "Search queries and training texts…")
    body += f'<div id="{h.esc(scope)}">{"".join(cards)}</div>{more}'
    body += settings_block(run, [("index", index_path)])
    subtitle = f"{len(records)} score column{'s' if len(records) != 1 else ''} against {index_path}"
    return h.Section(run.name, "score", body, subtitle=subtitle)


def latent_in_queries(run: Run, index_path: Path, texts: dict[str, str]) -> dict[str, str]:
    """For a latent query: {query id: HTML of its tokens shaded by the latent's activation}.

    Shows where in each query the feature fires, i.e. which tokens the query gradient comes from.
    The model and tokenizer are the index's; the texts are tokenized as `assay score` does.
    """
    import torch

    from assay.attribution.index import open_index
    from assay.bridge.latent import load_hooked_sae
    from assay.core.config import DataConfig, ModelConfig
    from assay.core.precision import PrecisionPolicy
    from assay.core.runs import config_from_dict
    from assay.lm.data import ID_COLUMN, tokenize
    from assay.lm.models import load_model, load_tokenizer
    from assay.lm.table import Table
    from assay.report.features import _context, _latents
    from assay.report.sae import context_html

    latent = int(run.config["latent"])
    meta = open_index(index_path).meta
    model_cfg = config_from_dict(ModelConfig, meta["config"]["model"])
    tokenizer = load_tokenizer(model_cfg)
    model = load_model(model_cfg, PrecisionPolicy.resolve("fp32", "cpu")).eval()
    sae = load_hooked_sae(run.config["query_sae"]).to("cpu")
    ids = list(texts)
    table = Table.from_columns({"text": [texts[i] for i in ids], ID_COLUMN: list(range(len(ids)))})
    examples = tokenize(
        table, DataConfig(dataset="query_text", max_length=int(meta["data"]["max_length"])), tokenizer
    )
    out: dict[str, str] = {}
    cache: dict[int, str] = {}
    for pos, qid in enumerate(ids):
        seq = examples.tokens_of(pos)
        ids_t = torch.from_numpy(seq[None].astype(np.int64))
        acts = _latents(model, sae, ids_t, torch.ones_like(ids_t))[0, :, latent].numpy()  # [T]
        ctx = _context(seq, acts, pos, tokenizer, cache, before=len(seq), after=len(seq))
        total = float(acts.sum())
        head = f"<h4>Where latent {latent} fires in this query (sum {total:.3f}, peak {ctx.max_act:.3f})</h4>"
        out[qid] = head + context_html(ctx, ctx.max_act)
    return out
