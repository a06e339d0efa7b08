"""`assay score --granularity token`: tokens.jsonl, the top proponents' scores split over their tokens.

One record per (score column, proponent) of the first records: {"query", "id", "score" (as in
top.jsonl), "sum" (of the per-token scores: the score again, recomputed), "tokens" (each token's
text), "scores" (each token's share)}. `assay report` shows them as a heat map over the text.
The arithmetic is attribution/tokens.py's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from assay.attribution.build import GradientSetup
from assay.attribution.index import GradientIndex, segments
from assay.attribution.kernel import QueryPlan, plan_queries
from assay.attribution.precondition import Whitening
from assay.attribution.tokens import column_of, token_record, token_scores
from assay.core.config import DataConfig
from assay.core.errors import AssayError
from assay.core.runs import write_jsonl
from assay.lm.data import Examples, load_examples
from assay.sae.features import token_text

TOKENS_FILE = "tokens.jsonl"


def wanted(records: list[dict], per_column: int) -> list[tuple[int, Any, int, float]]:
    """(score column, its name, proponent id, score) of the first `per_column` proponents of each record."""
    return [
        (col, r["query"], int(pid), float(score))
        for col, r in enumerate(records)
        for pid, score in r["proponents"][:per_column]
    ]


def write_tokens(
    path: Path,
    setup: GradientSetup,
    examples: Examples,
    position_of: dict[int, int],
    plan: QueryPlan,
    records: list[dict],
    cfg: Any,
) -> int:
    """Write tokens.jsonl for `records` (examples[position_of[id]] is training example `id`); returns
    how many records it holds."""
    pairs = [w for w in wanted(records, cfg.token_proponents) if w[2] in position_of]
    found = token_scores(
        setup, examples, sorted({position_of[w[2]] for w in pairs}), plan, cfg.token_batch_size
    )
    cache: dict[int, str] = {}
    out = []
    for col, name, pid, score in pairs:
        split = found[position_of[pid]]
        tokens = [token_text(setup.tokenizer, int(t), cache) for t in examples.tokens_of(split.position)]
        out.append(
            token_record(name, pid, score, tokens, split.terms[column_of(col, plan.reduce_max, split)])
        )
    write_jsonl(path, out)
    return len(out)


def index_tokens(
    folder: Path,
    cfg: Any,
    setup: GradientSetup,
    index: GradientIndex,
    queries: torch.Tensor,
    whitening: Whitening | None,
    records: list[dict],
) -> int:
    """tokens.jsonl of a score run over an index: the proponents' examples are read from the index's
    datasets (each segment's), tokenized as the index's rows were."""
    mode = cfg.options.mode
    curvature = index.meta.get("preconditioner") in ("kfac", "ekfac")
    if mode == "influence" and curvature and index.meta["projection_dim"] == 0:
        raise AssayError("--granularity token is not available for influence with unprojected K-FAC rows")
    plan = plan_queries(queries, mode, cfg.options.aggregate, whitening)
    ids = {w[2] for w in wanted(records, cfg.token_proponents)}
    examples, position_of = index_examples(index, ids, setup.tokenizer)
    return write_tokens(folder / TOKENS_FILE, setup, examples, position_of, plan, records, cfg)


def index_examples(index: GradientIndex, ids: set[int], tokenizer: Any) -> tuple[Examples, dict[int, int]]:
    """(the tokenized examples of these training ids, {id: position}) from the index's datasets."""
    rows = np.flatnonzero(np.isin(index.ids, np.fromiter(ids, dtype=np.int64, count=len(ids))))
    parts: list[Examples] = []
    for seg in segments(index.meta):
        start, stop = seg["rows"]
        mine = [int(index.ids[r]) for r in rows if start <= r < stop]
        if not mine:
            continue
        _, source = load_examples(DataConfig(**seg["data"]), tokenizer)
        offset = int(seg["id_offset"])
        part = source.subset(source.positions_of([i - offset for i in mine]))
        part.ids = part.ids + offset
        parts.append(part)
    examples = Examples.concatenate(parts)
    return examples, {int(i): k for k, i in enumerate(examples.ids)}
