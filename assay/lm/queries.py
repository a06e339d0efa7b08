"""Queries: the texts whose gradients (or other objectives) are attributed to training data.

A query set is a dataset (`QueryConfig.query_dataset`, with its split, columns, filter and
size) and/or ad-hoc texts; each query keeps an id (its source row, or "text:i" for the i-th
ad-hoc text) and is tokenized exactly as the training examples it is compared with.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from assay.core.config import DataConfig, QueryConfig
from assay.core.errors import AssayError
from assay.lm.data import ID_COLUMN, Examples, load_table, note_cut, texts_of, tokenize
from assay.lm.table import Table


@dataclass
class Queries:
    """The queries' ids (source rows, or "text:i" for ad-hoc texts), texts and tokenized examples."""

    ids: list[Any]
    texts: list[str]
    examples: Examples


def load_queries(query: QueryConfig, max_length: int, tokenizer: Any) -> Queries:
    """Tokenize the query dataset and the ad-hoc texts, cut to `max_length` tokens."""
    if not query.given:
        raise AssayError("give queries: --query_dataset DATASET and/or --query_text TEXT")
    parts: list[Queries] = []
    data_cfg = query.data_config(max_length)
    if data_cfg is not None:
        table = load_table(data_cfg)
        ids: list[Any] = [int(i) for i in table[ID_COLUMN]]
        parts.append(Queries(ids, texts_of(table, data_cfg), tokenize(table, data_cfg, tokenizer)))
        note_cut(parts[-1].examples, f"queries {data_cfg.dataset}:{data_cfg.split}", max_length)
    if query.query_text:
        texts = list(query.query_text)
        table = Table.from_columns({"text": texts, ID_COLUMN: list(range(len(texts)))})
        text_cfg = DataConfig(dataset="query_text", max_length=max_length)
        ad_hoc = [f"text:{i}" for i in range(len(texts))]
        parts.append(Queries(ad_hoc, texts, tokenize(table, text_cfg, tokenizer)))
        note_cut(parts[-1].examples, "--query_text", max_length)
    queries = Queries(
        [i for p in parts for i in p.ids],
        [t for p in parts for t in p.texts],
        Examples.concatenate([p.examples for p in parts]),
    )
    empty = [q for q, n in zip(queries.ids, queries.examples.num_loss_tokens()) if n == 0]
    if empty:
        raise AssayError(f"query {empty[0]!r} has no tokens that carry loss (empty text or completion?)")
    return queries
