"""A small HTML layer: escaped building blocks, one stylesheet and one script, all inline.

Every piece of text from a run folder goes through `esc` (html.escape, quotes included); the
few functions that take ready-made HTML say so in their argument name (`body_html`, ...).
The page needs nothing outside itself: no network, no server, no external fonts or scripts.
"""

from __future__ import annotations

import html
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

GENERATOR = "assay report"


def esc(value: Any) -> str:
    """Text -> HTML-safe text (quotes too, so it is safe inside attributes)."""
    return html.escape(str(value), quote=True)


def fmt(value: Any, digits: int = 4) -> str:
    """A number for people: ints with thousands separators, floats to `digits` significant digits."""
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            return str(value)
        if value != 0 and (abs(value) >= 1e6 or abs(value) < 1e-3):
            return f"{value:.{digits - 1}e}"
        if abs(value) >= 1000:
            return f"{value:,.0f}"
        return (
            f"{value:.{digits}g}"
            if abs(value) < 1
            else f"{value:.{max(digits - 1, 1)}f}".rstrip("0").rstrip(".")
        )
    return str(value)


def slug(text: str) -> str:
    """An id-safe slug (letters, digits, dashes)."""
    out = "".join(c.lower() if c.isalnum() else "-" for c in text)
    return "-".join(p for p in out.split("-") if p) or "section"


@dataclass
class Section:
    """One run's part of the page: a title, a kind badge, its HTML and sub-headings for the TOC."""

    title: str
    kind: str
    body_html: str
    anchor: str = ""
    subtitle: str = ""
    toc: list[tuple[str, str]] = field(default_factory=list)  # (anchor, label) of sub-parts


def tiles(items: Iterable[tuple[str, Any]], hints: dict[str, str] | None = None) -> str:
    """A row of headline numbers: (label, value) pairs; values formatted with `fmt`."""
    hints = hints or {}
    cells = []
    for label, value in items:
        title = f' title="{esc(hints[label])}"' if label in hints else ""
        shown = fmt(value) if not isinstance(value, str) else value
        cells.append(
            f'<div class="tile"{title}><div class="tile-value">{esc(shown)}</div>'
            f'<div class="tile-label">{esc(label)}</div></div>'
        )
    return f'<div class="tiles">{"".join(cells)}</div>'


def table(
    headers: Sequence[str],
    rows: Iterable[Sequence[Any]],
    numeric: Sequence[int] = (),
    raw_columns: Sequence[int] = (),
    cls: str = "",
    highlight_row: int | None = None,
) -> str:
    """An HTML table. Cells are escaped and formatted, except columns in `raw_columns` (HTML)."""
    head = "".join(
        f'<th class="{"num" if i in numeric else ""}">{esc(h)}</th>' for i, h in enumerate(headers)
    )
    body = []
    for r, row in enumerate(rows):
        cells = []
        for i, value in enumerate(row):
            text = value if i in raw_columns else esc(fmt(value) if not isinstance(value, str) else value)
            cells.append(f'<td class="{"num" if i in numeric else ""}">{text}</td>')
        mark = ' class="best"' if r == highlight_row else ""
        body.append(f"<tr{mark}>{''.join(cells)}</tr>")
    inner = f"<thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody>"
    return f'<div class="table-wrap"><table class="{esc(cls)}">{inner}</table></div>'


def details(summary_html: str, body_html: str, open_: bool = False, cls: str = "") -> str:
    """A folded block (<details>): the summary stays visible, the body unfolds on click."""
    opened = " open" if open_ else ""
    return f'<details class="{esc(cls)}"{opened}><summary>{summary_html}</summary>{body_html}</details>'


def pre(text: str, cls: str = "text") -> str:
    return f'<pre class="{esc(cls)}">{esc(text)}</pre>'


def folded_text(text: str, preview_chars: int = 160, preview_lines: int = 2, inline_chars: int = 240) -> str:
    """Text shown whole when short (up to `inline_chars` and 3 lines), else folded behind a preview."""
    text = text.rstrip()
    lines = [ln for ln in text.splitlines() if ln.strip()]
    if len(text) <= inline_chars and len(lines) <= 3:
        return f'<span class="snippet whole">{esc(text)}</span>'
    preview = " ⏎ ".join(ln.strip() for ln in lines[:preview_lines])
    if len(preview) > preview_chars:
        preview = preview[: preview_chars - 1] + "…"
    more = f"{len(text):,} chars, {len(lines)} lines"
    return details(
        f'<span class="snippet">{esc(preview)}</span> <span class="muted">({esc(more)})</span>',
        pre(text),
        cls="fold",
    )


def figure(svg: str, caption: str = "") -> str:
    """A chart (inline SVG markup from charts.py) with an optional caption."""
    cap = f"<figcaption>{esc(caption)}</figcaption>" if caption else ""
    return f'<figure class="chart">{svg}{cap}</figure>'


def grid(*cells_html: str) -> str:
    """Side-by-side blocks that wrap on narrow screens."""
    return '<div class="grid">' + "".join(f"<div>{c}</div>" for c in cells_html if c) + "</div>"


def note_box(text: str, level: str = "info") -> str:
    return f'<div class="note {esc(level)}">{esc(text)}</div>'


def bar_cell(value: float, scale: float, label: str | None = None) -> str:
    """A number with a small horizontal bar (positive: accent, negative: red), scaled to `scale`."""
    width = 0.0 if scale <= 0 else min(abs(value) / scale, 1.0) * 100
    cls = "neg" if value < 0 else "pos"
    return (
        f'<span class="bar-cell"><span class="bar {cls}" style="width:{width:.1f}%"></span>'
        f'<span class="bar-label">{esc(label if label is not None else fmt(value))}</span></span>'
    )


def kv_table(pairs: Iterable[tuple[str, Any]]) -> str:
    """A two-column key/value table (settings)."""
    rows = "".join(f"<tr><th>{esc(k)}</th><td>{esc(fmt(v))}</td></tr>" for k, v in pairs)
    return f'<table class="kv">{rows}</table>'


def h3(text: str, anchor: str = "") -> str:
    return heading(text, 3, anchor)


def heading(text: str, level: int, anchor: str = "") -> str:
    """<hN> (optionally with an id to link to)."""
    ident = f' id="{esc(anchor)}"' if anchor else ""
    return f"<h{level}{ident}>{esc(text)}</h{level}>"


def section_html(sec: Section) -> str:
    sub = f'<p class="subtitle">{esc(sec.subtitle)}</p>' if sec.subtitle else ""
    return (
        f'<section class="run" id="{esc(sec.anchor)}" data-kind="{esc(sec.kind)}">'
        f'<header><span class="badge">{esc(sec.kind)}</span><h2>{esc(sec.title)}</h2>{sub}</header>'
        f"{sec.body_html}</section>"
    )


def toc_html(sections: Sequence[Section]) -> str:
    items = []
    for s in sections:
        subs = "".join(f'<li><a href="#{esc(a)}">{esc(label)}</a></li>' for a, label in s.toc)
        sub_list = f"<ul>{subs}</ul>" if subs else ""
        items.append(
            f'<li><a href="#{esc(s.anchor)}"><span class="badge small">{esc(s.kind)}</span> '
            f"{esc(s.title)}</a>{sub_list}</li>"
        )
    return f'<nav class="toc"><div class="toc-title">Contents</div><ul>{"".join(items)}</ul></nav>'


def page(title: str, sections: Sequence[Section], intro_html: str = "", footer: str = "") -> str:
    """The whole self-contained document."""
    body = "".join(section_html(s) for s in sections)
    toc = toc_html(sections) if len(sections) > 1 or any(s.toc for s in sections) else ""
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<meta name="generator" content="{GENERATOR}">
<title>{esc(title)}</title>
<style>{CSS}</style></head>
<body><div class="layout">{toc}<main>
<header class="page-head"><h1>{esc(title)}</h1>{intro_html}</header>
{body}
<footer>{esc(footer)}</footer>
</main></div>
<script>{SCRIPT}</script>
</body></html>
"""


CSS = """
:root{--fg:#1f2430;--muted:#6b7280;--line:#e5e7eb;--bg:#f6f7f9;--card:#fff;--accent:#2563eb;
--accent-soft:#dbeafe;--neg:#dc2626;--neg-soft:#fee2e2;--good:#059669;--mono:ui-monospace,SFMono-Regular,
Menlo,Consolas,"DejaVu Sans Mono",monospace}
*{box-sizing:border-box}
body{margin:0;background:var(--bg);color:var(--fg);font:15px/1.5 system-ui,-apple-system,"Segoe UI",
Roboto,"DejaVu Sans",sans-serif}
.layout{display:flex;align-items:flex-start;max-width:1500px;margin:0 auto}
nav.toc{position:sticky;top:0;width:250px;flex:none;max-height:100vh;overflow:auto;
padding:24px 12px 24px 20px;
font-size:13px}
nav.toc ul{list-style:none;margin:0;padding:0}nav.toc ul ul{padding-left:14px;margin:2px 0 6px}
nav.toc li{margin:3px 0}nav.toc a{color:var(--fg);text-decoration:none}
nav.toc a:hover{color:var(--accent)}
.toc-title{font-weight:600;text-transform:uppercase;letter-spacing:.06em;color:var(--muted);
font-size:11px;
margin-bottom:8px}
main{flex:1;min-width:0;padding:24px 28px 60px}
.page-head h1{margin:0 0 4px;font-size:28px}.page-head p.lead{color:var(--fg);font-size:16px;max-width:900px}
.page-head p{margin:4px 0;color:var(--muted)}
section.run{background:var(--card);border:1px solid var(--line);border-radius:12px;padding:20px 24px;
margin:22px 0;box-shadow:0 1px 2px rgba(0,0,0,.04)}
section.run>header{display:flex;align-items:baseline;gap:10px;flex-wrap:wrap;
border-bottom:1px solid var(--line);
padding-bottom:10px;margin-bottom:14px}
section.run h2{margin:0;font-size:21px}.subtitle{margin:0;color:var(--muted);font-size:13px;width:100%}
h3{font-size:16px;margin:22px 0 8px}h4{font-size:14px;margin:14px 0 6px}
.badge{display:inline-block;background:var(--accent-soft);color:var(--accent);border-radius:999px;
padding:1px 9px;font-size:12px;font-weight:600;white-space:nowrap}.badge.small{font-size:10px;
padding:0 6px}
.tiles{display:flex;flex-wrap:wrap;gap:10px;margin:10px 0 6px}
.tile{border:1px solid var(--line);border-radius:10px;padding:8px 14px;min-width:118px;
background:#fbfcfe}
.tile-value{font-size:20px;font-weight:600;font-variant-numeric:tabular-nums}
.tile-label{font-size:12px;color:var(--muted)}
.table-wrap{overflow-x:auto}
table{border-collapse:collapse;width:100%;font-size:13.5px;margin:6px 0}
th,td{text-align:left;padding:5px 9px;border-bottom:1px solid var(--line);vertical-align:top}
thead th{background:#f9fafb;font-weight:600;position:sticky;top:0}
td.num,th.num{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
tr.best td{background:#ecfdf5;font-weight:600}
table.stages td:first-child{white-space:nowrap}
table.kv{width:auto}table.kv th{font-weight:500;color:var(--muted);padding-right:18px}
.grid{display:grid;grid-template-columns:repeat(auto-fill,minmax(400px,1fr));gap:14px;align-items:start}
.grid figure.chart{max-width:760px}.feature figure.chart{max-width:none;border:none;padding:0}
figure.chart{max-width:760px;margin:8px 0;background:#fff;border:1px solid var(--line);
border-radius:10px;padding:6px}
figure.chart svg{width:100%;height:auto;display:block}
figcaption{font-size:12px;color:var(--muted);padding:2px 6px 4px}
details{margin:2px 0}summary{cursor:pointer}details.fold>summary{list-style:none}
details.fold>summary::-webkit-details-marker{display:none}
details.fold>summary::before{content:"▸ ";color:var(--muted)}
details.fold[open]>summary::before{content:"▾ "}
details.block{border:1px solid var(--line);border-radius:8px;padding:6px 10px;margin:8px 0;
background:#fcfcfd}
details.block>summary{font-weight:600}
pre.text{white-space:pre-wrap;word-break:break-word;font:12.5px/1.45 var(--mono);background:#f8fafc;
border:1px solid var(--line);border-radius:6px;padding:8px 10px;margin:6px 0;max-height:420px;
overflow:auto}
.snippet{font:12.5px/1.45 var(--mono);word-break:break-word}.snippet.whole{white-space:pre-wrap;
display:block}
.muted{color:var(--muted);font-size:12px}
.note{border-left:3px solid var(--accent);background:#f0f6ff;padding:8px 12px;margin:10px 0;
font-size:13.5px;
border-radius:0 6px 6px 0}.note.warn{border-color:#d97706;background:#fffbeb}
.search{width:100%;max-width:480px;padding:8px 12px;border:1px solid var(--line);border-radius:8px;
font-size:14px;margin:6px 0 4px}
.search-count{font-size:12px;color:var(--muted);margin-left:8px}
.card{border:1px solid var(--line);border-radius:10px;padding:10px 14px;margin:12px 0;background:#fff}
.card h4{margin:8px 0 6px}.query-text{background:#f8fafc;border:1px solid var(--line);border-radius:6px;
padding:6px 10px}.hidden{display:none!important}
.bar-cell{position:relative;display:inline-block;min-width:92px;height:20px;width:100%}
.bar{position:absolute;left:0;top:3px;height:14px;border-radius:3px;opacity:.28}
.bar.pos{background:var(--accent)}.bar.neg{background:var(--neg)}
.bar-label{position:relative;padding-left:4px;font-variant-numeric:tabular-nums}
.ctx{font:12.5px/1.9 var(--mono);white-space:pre-wrap;word-break:break-word;
border-bottom:1px dashed var(--line);
padding:3px 0}
.ctx .tok{border-radius:3px}.ctx .peak{outline:1.5px solid #c2410c}
.tokens{display:flex;flex-wrap:wrap;gap:4px;margin:4px 0}
.tokens span{font:12px var(--mono);border-radius:4px;padding:1px 6px;white-space:pre}
.tokens .up{background:#dcfce7;color:#065f46}.tokens .down{background:var(--neg-soft);color:#991b1b}
.feature{border:1px solid var(--line);border-radius:10px;padding:10px 14px;margin:12px 0}
.feature-head{display:flex;gap:12px;align-items:baseline;flex-wrap:wrap}
.feature-grid{display:grid;grid-template-columns:minmax(0,2fr) minmax(260px,1fr);gap:14px}
@media (max-width:900px){nav.toc{display:none}.feature-grid{grid-template-columns:1fr}}
footer{color:var(--muted);font-size:12px;margin-top:30px}
"""

# Search boxes filter the cards of their section by text; nothing else runs on load.
SCRIPT = """
(function(){
  document.querySelectorAll('input.search').forEach(function(box){
    var scope = document.getElementById(box.getAttribute('data-scope'));
    if (!scope) return;
    var items = scope.querySelectorAll('.searchable');
    var count = document.getElementById(box.getAttribute('data-count'));
    function apply(){
      var q = box.value.trim().toLowerCase(), shown = 0;
      items.forEach(function(el){
        var hit = !q || el.textContent.toLowerCase().indexOf(q) !== -1;
        el.classList.toggle('hidden', !hit);
        if (hit) { shown += 1; if (q) { el.querySelectorAll('details.fold').forEach(function(d){
          if (d.textContent.toLowerCase().indexOf(q) !== -1) d.open = true; }); } }
      });
      if (count) count.textContent = shown + ' of ' + items.length + ' shown';
    }
    box.addEventListener('input', apply);
    apply();
  });
})();
"""


def search_box(scope_id: str, placeholder: str) -> str:
    """A filter box for the `.searchable` items inside the element with id `scope_id`."""
    return (
        f'<div><input class="search" type="search" placeholder="{esc(placeholder)}" '
        f'data-scope="{esc(scope_id)}" data-count="{esc(scope_id)}-count" aria-label="{esc(placeholder)}">'
        f'<span class="search-count" id="{esc(scope_id)}-count"></span></div>'
    )
