"""Charts as inline SVG: matplotlib (Agg, no display) rendered to an SVG string.

Text stays text (`svg.fonttype = none`), so numbers on the axes are in the page's DOM and
searchable. Each figure gets its own hash salt so element ids never collide between the many
SVGs inlined in one page. Long series are thinned to at most MAX_POINTS points per line.
"""

from __future__ import annotations

import html
import io
import itertools
import re
from collections.abc import Mapping, Sequence

import numpy as np
from numpy.typing import ArrayLike

MAX_POINTS = 600
PALETTE = ["#2563eb", "#dc2626", "#059669", "#d97706", "#7c3aed", "#0891b2", "#db2777", "#4b5563"]
_counter = itertools.count()


def _plt():
    # imported on first chart, not with the module: the Agg backend must be chosen before pyplot
    # loads, and a page without charts (or `assay --help`) need not pay matplotlib's import
    import matplotlib  # lazy: only pages with charts

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt  # after use("Agg"): no display

    return plt


def _style(ax) -> None:
    ax.spines[["top", "right"]].set_visible(False)
    ax.grid(True, color="#e5e7eb", linewidth=0.7)
    ax.set_axisbelow(True)
    ax.tick_params(labelsize=8.5, colors="#374151")
    ax.ticklabel_format(axis="y", useOffset=False)  # no "+5.686" offsets: read values directly


def to_svg(fig) -> str:
    """The figure as an <svg> element (no XML prolog, no fixed pixel size), then closed."""
    plt = _plt()
    buf = io.StringIO()
    with plt.rc_context({"svg.fonttype": "none", "svg.hashsalt": f"assay-{next(_counter)}"}):
        fig.savefig(buf, format="svg", bbox_inches="tight")
    plt.close(fig)
    svg = buf.getvalue()
    svg = svg[svg.index("<svg") :]
    svg = re.sub(r"<metadata>.*?</metadata>", "", svg, flags=re.S)
    used = set(re.findall(r"#([\w.-]+)\)?", svg))  # ids referenced by url(#..) / href="#.."
    svg = re.sub(r'\sid="([^"]*)"', lambda m: m.group(0) if m.group(1) in used else "", svg)
    end = svg.index(">")  # the opening <svg ...> tag: drop its pixel size, keep the viewBox
    head = re.sub(r'\s(?:width|height)="[^"]*"', "", svg[:end])
    return head + ' role="img"' + svg[end:]


def _thin(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    if len(x) <= MAX_POINTS:
        return x, y
    idx = np.unique(np.linspace(0, len(x) - 1, MAX_POINTS).round().astype(int))
    return x[idx], y[idx]


def _figure(width: float = 5.6, height: float = 3.0):
    plt = _plt()
    with plt.rc_context({"font.family": "DejaVu Sans"}):
        fig, ax = plt.subplots(figsize=(width, height), dpi=100)
    _style(ax)
    return fig, ax


def line_chart(
    series: Mapping[str, tuple[ArrayLike, ArrayLike]],
    title: str = "",
    xlabel: str = "step",
    ylabel: str = "",
    logy: bool = False,
    markers: bool = False,
    styles: dict[str, str] | None = None,
) -> str:
    """Lines, one per label: {label: (x, y)}. `styles` maps labels to '-', '--' or ':'."""
    fig, ax = _figure()
    for i, (label, (x, y)) in enumerate(series.items()):
        xs, ys = _thin(np.asarray(x, dtype=float), np.asarray(y, dtype=float))
        ok = np.isfinite(ys)
        ax.plot(
            xs[ok], ys[ok], label=label, color=PALETTE[i % len(PALETTE)], linewidth=1.6,
            linestyle=(styles or {}).get(label, "-"), marker="o" if markers else None, markersize=3,
        )  # fmt: skip
    if logy:
        ax.set_yscale("log")
    ax.set_title(title, fontsize=10.5, loc="left")
    ax.set_xlabel(xlabel, fontsize=9)
    ax.set_ylabel(ylabel, fontsize=9)
    if len(series) > 1:
        ax.legend(fontsize=7.5, frameon=True, framealpha=0.85, edgecolor="#e5e7eb")
    return to_svg(fig)


def histogram(
    values: ArrayLike,
    title: str = "",
    xlabel: str = "",
    bins: int = 40,
    logy: bool = False,
    color: str = "",
) -> str:
    """A histogram of finite values, with the mean and median marked."""
    v = np.asarray(values, dtype=float)
    v = v[np.isfinite(v)]
    fig, ax = _figure(5.0, 2.7)
    if len(v):
        ax.hist(v, bins=bins, color=color or PALETTE[0], alpha=0.85, edgecolor="white", linewidth=0.4)
        ax.axvline(
            float(np.mean(v)), color="#111827", linewidth=1, linestyle="--", label=f"mean {np.mean(v):.3g}"
        )
        ax.axvline(
            float(np.median(v)),
            color="#d97706",
            linewidth=1,
            linestyle=":",
            label=f"median {np.median(v):.3g}",
        )
        ax.legend(fontsize=8, frameon=False)
    if logy:
        ax.set_yscale("log")
    ax.set_title(title, fontsize=10.5, loc="left")
    ax.set_xlabel(xlabel, fontsize=9)
    ax.set_ylabel("count", fontsize=9)
    return to_svg(fig)


def bar_chart(
    labels: Sequence[str],
    values: Sequence[float],
    title: str = "",
    ylabel: str = "",
    errors: Sequence[float] | None = None,
    highlight: int | None = None,
    reference: tuple[str, float] | None = None,
) -> str:
    """Vertical bars with optional error bars, one bar highlighted and a reference line."""
    fig, ax = _figure(5.6, 3.0)
    colors = [PALETTE[0] if i != highlight else PALETTE[2] for i in range(len(labels))]
    x = np.arange(len(labels))
    ax.bar(x, values, color=colors, alpha=0.85, yerr=errors, capsize=3 if errors is not None else 0)
    for xi, v in zip(x, values):
        ax.annotate(
            f"{v:.3f}",
            (xi, v),
            ha="center",
            va="bottom",
            fontsize=7.5,
            xytext=(0, 2),
            textcoords="offset points",
        )
    if reference is not None:
        ax.axhline(reference[1], color="#6b7280", linestyle="--", linewidth=1, label=reference[0])
        ax.legend(fontsize=8, frameon=False)
    lo = min(list(values) + ([reference[1]] if reference else []))
    hi = max(list(values) + ([reference[1]] if reference else []))
    pad = (hi - lo) * 0.25 or abs(hi) * 0.05 or 1.0
    ax.set_ylim(max(lo - pad, 0) if lo >= 0 else lo - pad, hi + pad)
    ax.set_xticks(
        x,
        labels,
        rotation=20 if max(len(s) for s in labels) > 8 else 0,
        ha="right" if max(len(s) for s in labels) > 8 else "center",
    )
    ax.set_title(title, fontsize=10.5, loc="left")
    ax.set_ylabel(ylabel, fontsize=9)
    return to_svg(fig)


def histogram_bars(counts: Sequence[int], hi: float, title: str = "") -> str:
    """Counts of equal bins over [0, hi] drawn directly as SVG rectangles (the feature browser
    draws dozens; matplotlib would take ~0.5 s each). Count axis is linear."""
    w, hgt, left, bottom, top = 320.0, 120.0, 34.0, 20.0, 18.0
    parts = [f'<text x="{left}" y="12" font-size="11" fill="#374151">{_xml(title)}</text>']
    if len(counts) and sum(counts):
        hi = hi or 1.0
        bins = len(counts)
        edges = np.linspace(0.0, hi, bins + 1)
        peak = max(max(counts), 1)
        bw = (w - left - 6) / bins
        for i, c in enumerate(counts):
            bh = (hgt - bottom - top) * c / peak
            parts.append(
                f'<rect x="{left + i * bw:.1f}" y="{hgt - bottom - bh:.1f}" width="{max(bw - 1, 0.5):.1f}" '
                f'height="{bh:.1f}" fill="#ea580c" fill-opacity="0.85">'
                f"<title>{edges[i]:.3g}–{edges[i + 1]:.3g}: {c}</title></rect>"
            )
        axis = 'stroke="#9ca3af" stroke-width="1"'
        label = 'font-size="10" fill="#6b7280"'
        parts += [
            f'<line x1="{left}" y1="{hgt - bottom}" x2="{w - 6}" y2="{hgt - bottom}" {axis}/>',
            f'<line x1="{left}" y1="{top}" x2="{left}" y2="{hgt - bottom}" {axis}/>',
            f'<text x="{left}" y="{hgt - 6}" {label}>0</text>',
            f'<text x="{w - 6}" y="{hgt - 6}" {label} text-anchor="end">{hi:.3g}</text>',
            f'<text x="{left - 4}" y="{top + 8}" {label} text-anchor="end">{peak}</text>',
        ]
    head = f'<svg viewBox="0 0 {w:.0f} {hgt:.0f}" xmlns="http://www.w3.org/2000/svg" role="img">'
    return head + "".join(parts) + "</svg>"


def _xml(text: str) -> str:
    return html.escape(text, quote=True)
