"""How `assay score` shows its results on the terminal: each query with its top proponents and
its strongest opponent, then where the results are written."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from assay.core.console import say
from assay.core.runs import final_location


def print_results(
    records: list[dict],
    query_texts: dict[Any, str],
    texts: dict[int, str],
    show: int,
    out: str | Path,
    save_scores: bool,
) -> None:
    """The table, then where the scores are (once the run, and any run it is a stage of, has
    finished: `final_location`)."""
    print_table(records, query_texts, texts, show)
    saved = "top.jsonl, queries.jsonl" + (", scores.npy" if save_scores else "")
    say(f"results in {final_location(out)}/ ({saved})")


def fold(text: str, width: int = 90) -> str:
    """One line: newlines shown as ' / ', cut to `width` characters."""
    line = " / ".join(part.strip() for part in text.strip().splitlines() if part.strip())
    return line if len(line) <= width else line[: width - 1] + "…"


def print_table(records: list[dict], query_texts: dict[Any, str], texts: dict[int, str], show: int) -> None:
    """Each query's text, then its top proponents: rank, score, train id, text."""
    for r in records:
        label = r["query"]
        text = query_texts.get(label) or f"{label} of {len(r.get('queries', []))} queries"
        say(f"\nquery {label}: {fold(text)}")
        say(f"  {'rank':>4}  {'score':>8}  {'train id':>8}  text")
        for rank, (pid, value) in enumerate(r["proponents"][:show], 1):
            say(f"  {rank:>4}  {value:>8.4f}  {pid:>8}  {fold(texts.get(pid, ''), 70)}")
        if r["opponents"]:
            pid, value = r["opponents"][0]
            say(f"  {'opp.':>4}  {value:>8.4f}  {pid:>8}  {fold(texts.get(pid, ''), 70)}")
