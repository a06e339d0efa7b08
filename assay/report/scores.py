"""The view of an `assay score` folder: each query with its top proponents and opponents.

Reads top.jsonl, queries.jsonl, summary.json and texts.jsonl (the training examples' texts and
losses, written by `assay score`); a latent-attribution run (`--query_sae/--latent`) also
latent.json (where the latent fires in each query), and a `--granularity token` run tokens.jsonl
(each top proponent's score split over its tokens: a heat map over its text). Only files of the
run folder are read.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from assay.report import html as h
from assay.report.common import ViewOptions, missing_note, settings_block, unfinished_note
from assay.report.links import LATENT_FILE
from assay.report.runs import Run
from assay.report.sae import context_html

MAX_QUERIES = 100  # cards on the page; the rest are counted
TEXTS_FILE = "texts.jsonl"
TOKENS_FILE = "tokens.jsonl"
SUPPORTS, OPPOSES = "22,163,74", "220,38,38"  # green: a token's share raises the score; red: lowers it


def train_examples(run: Run) -> tuple[dict[int, str], dict[int, float]]:
    """(training texts by id, summed loss by id) of the examples top.jsonl lists, from texts.jsonl."""
    texts: dict[int, str] = {}
    losses: dict[int, float] = {}
    for row in run.jsonl(TEXTS_FILE):
        if "id" not in row:
            continue
        if isinstance(row.get("text"), str):
            texts[int(row["id"])] = row["text"]
        if isinstance(row.get("loss"), int | float):
            losses[int(row["id"])] = float(row["loss"])
    return texts, losses


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
    after_html: str = "",
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
        + after_html
        + "</div>"
    )


def token_heat(record: dict[str, Any]) -> str:
    """One proponent's tokens shaded by their share of its score (green raises it, red lowers it;
    the value on hover), from a tokens.jsonl record."""
    shares = np.asarray(record.get("scores", []), dtype=np.float64)
    tokens = [str(t) for t in record.get("tokens", [])]
    scale = float(np.abs(shares).max()) if len(shares) else 0.0
    parts = []
    for tok, share in zip(tokens, shares):
        alpha = 0.0 if scale <= 0 else min(abs(share) / scale, 1.0) * 0.85
        color = SUPPORTS if share > 0 else OPPOSES
        style = f"background:rgba({color},{alpha:.2f})"
        parts.append(f'<span class="tok" style="{style}" title="{share:+.4f}">{h.esc(tok)}</span>')
    head = (
        f"train id {h.esc(record.get('id'))}: score {float(record.get('score', 0.0)):.4f}, "
        f"the sum of its tokens' shares {float(record.get('sum', 0.0)):.4f}"
    )
    return f'<p class="muted">{head}</p><div class="ctx">{"".join(parts)}</div>'


def token_heat_maps(run: Run) -> dict[str, str]:
    """{query: HTML of its top proponents' per-token heat maps}, from tokens.jsonl ({} without it)."""
    grouped: dict[str, list[dict[str, Any]]] = {}
    for record in run.jsonl(TOKENS_FILE):
        grouped.setdefault(str(record.get("query")), []).append(record)
    title = "Which tokens drive the score (the top proponents' scores split over their tokens)"
    return {
        q: h.details(h.esc(title), "".join(token_heat(r) for r in rs), cls="block")
        for q, rs in grouped.items()
    }


def latent_subtitle(run: Run) -> str | None:
    """For a latent-attribution run (`--query_sae/--latent`), what the query is."""
    sae, latent = run.config.get("query_sae"), run.config.get("latent")
    if not sae or latent is None:
        return None
    return f"query: SAE latent {latent} of {sae} — which training examples most increase this feature?"


def latent_in_queries(saved: dict[str, Any]) -> dict[str, str]:
    """{query id: HTML of its tokens shaded by the latent's activation}, from latent.json.

    Shows where in each query the feature fires, i.e. which tokens the query gradient comes from.
    """
    latent = saved.get("latent", "?")
    out: dict[str, str] = {}
    for q in saved.get("queries", []):
        acts = np.asarray(q.get("acts", []), dtype=np.float64)
        if not len(acts):
            continue
        peak = int(np.argmax(acts))
        ctx = {"tokens": q.get("tokens", []), "acts": list(acts), "peak": peak, "max_act": float(acts[peak])}
        ctx["example"] = q.get("query")
        head = f"Where latent {latent} fires in this query (sum {acts.sum():.3f}, peak {acts[peak]:.3f})"
        out[str(q.get("query"))] = f"<h4>{h.esc(head)}</h4>" + context_html(ctx, float(acts[peak]))
    return out


def _latent_block(run: Run, latent: str, card: str | None) -> tuple[str, dict[str, str]]:
    """(the note above the cards, {query: where the latent fires}) of a latent-attribution run."""
    body = h.note_box(latent + " Proponents are the examples whose training step raises the latent.")
    if card:
        body += f'<p><a href="#{h.esc(card)}">See this latent in the feature browser →</a></p>'
    saved = run.json(LATENT_FILE)
    if not isinstance(saved, dict):
        body += h.note_box(
            f"Where the latent fires in each query is not shown: this run folder has no {LATENT_FILE} "
            "(written by `assay score --query_sae SAE --latent L`).",
            "warn",
        )
        return body, {}
    return body, latent_in_queries(saved)


def _score_tiles(run: Run, summary: dict, num_queries: int) -> str:
    """The run's figures at a glance: queries, rows, mode, precision, speed."""
    return h.tiles(
        [
            ("queries", int(summary.get("num_queries", num_queries))),
            ("training examples", int(summary.get("num_rows", 0))),
            ("mode", str(summary.get("mode", run.config.get("mode", "–")))),
            ("aggregate", str(summary.get("aggregate", run.config.get("aggregate", "none")))),
            ("precision", str(summary.get("precision", "–"))),
            ("λ (query mix)", summary.get("mix")),
            ("rows / s", summary.get("rows_per_s")),
        ],
        hints={"λ (query mix)": "R = λ·R_query + (1-λ)·R_train (TrackStar)"},
    )


def score_view(run: Run, opts: ViewOptions) -> h.Section:
    """Queries with their proponents and opponents; a latent query links to its browser card."""
    summary = run.json("summary.json") or {}
    records = run.jsonl("top.jsonl")
    body = unfinished_note(run)
    if not records:
        body += missing_note("scores", "top.jsonl")
        return h.Section(run.name, "score", body + settings_block(run))
    queries = {str(q.get("query")): q.get("text", "") for q in run.jsonl("queries.jsonl")}
    texts, losses = train_examples(run)
    index_path = str(summary.get("index") or run.config.get("index") or "?")
    body += _score_tiles(run, summary, len(queries) or len(records))
    if run.file(TEXTS_FILE) is None:
        body += h.note_box(
            f"Training texts and losses are not shown: this run folder has no {TEXTS_FILE} "
            "(written by `assay score`; rerun it to add them).",
            "warn",
        )
    labels = ("Proponents (a step on them lowers the query's loss)", "Opponents (a step on them raises it)")
    fires: dict[str, str] = {}
    latent = latent_subtitle(run)
    if latent:
        block, fires = _latent_block(run, latent, opts.links.card_of(run))
        body += block
        labels = ("Proponents (a step on them raises the latent)", "Opponents (a step on them suppresses it)")
    shown = records[:MAX_QUERIES]
    for r in shown:  # an aggregate column lists the texts of the queries it averages
        if r.get("queries") is not None:
            r["query_texts"] = [queries.get(str(q), str(q)) for q in r["queries"]]
    heat = token_heat_maps(run)
    cards = [
        query_card(
            r,
            queries.get(str(r.get("query"))),
            texts,
            losses,
            labels,
            fires.get(str(r.get("query")), ""),
            heat.get(str(r.get("query")), ""),
        )
        for r in shown
    ]
    more = (
        f"<p class='muted'>{len(records) - MAX_QUERIES} more queries in top.jsonl.</p>"
        if len(records) > MAX_QUERIES
        else ""
    )
    scope = f"{h.slug(run.name)}-queries"
    body += h.search_box(scope, "Search queries and training texts…")
    body += f'<div id="{h.esc(scope)}">{"".join(cards)}</div>{more}'
    body += settings_block(run, [("index", index_path)])
    subtitle = f"{len(records)} score column{'s' if len(records) != 1 else ''} against {index_path}"
    return h.Section(run.name, "score", body, subtitle=subtitle)
