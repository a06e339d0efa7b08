"""The bundled experiments' data: a pool, a query set and a target eval set from abc-tunes.

- coreset:  pool = a seeded sample of training tunes from every collection; the pool is its
  own query; eval = a seeded sample of the held-out eval split (all collections).
- targeted: the same kind of pool; query = O'Neill (Irish) training tunes kept OUT of the pool;
  target eval = the O'Neill tunes of the held-out eval split (disjoint from the query).
- lds (`assay validate --preset abc`): the same kind of pool; query = a seeded sample of the
  held-out eval split (all collections); no eval set.

Files are written once into OUT/data as JSON lines (text, collection, title, source_row).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from assay.core.paths import cache_dir
from assay.core.runs import write_jsonl
from assay.lm import corpora

PRESETS = ("coreset", "targeted", "lds")
TARGET_COLLECTION = "oneill"


def _read(split: str) -> list[dict[str, Any]]:
    folder = corpora.prepare("abc-tunes", cache_dir())
    with open(folder / f"{split}.jsonl", encoding="utf-8") as f:  # not splitlines(): texts hold \x1c etc.
        rows = [json.loads(line) for line in f if line.strip()]
    return [r | {"source_row": i} for i, r in enumerate(rows)]


def prepare_preset(
    name: str, folder: Path, pool_size: int, query_size: int, eval_size: int
) -> dict[str, str]:
    """Write pool.jsonl (+ query.jsonl, target.jsonl) once; returns their paths by role."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = {role: folder / f"{role}.jsonl" for role in ("pool", "query", "eval")}
    if all(p.exists() for p in paths.values()):
        return {k: str(v) for k, v in paths.items()}
    train, held_out = _read("train"), _read("eval")
    order = np.random.default_rng(1234).permutation(len(train))
    pool = [int(i) for i in order[:pool_size]]  # an unbiased sample of every collection
    if name == "lds":
        picked = np.random.default_rng(9012).permutation(len(held_out))[:query_size]
        write_jsonl(paths["query"], [held_out[int(i)] for i in sorted(picked)])
        write_jsonl(paths["eval"], [])
    elif name == "targeted":
        rest = [int(i) for i in order[pool_size:] if train[i]["collection"] == TARGET_COLLECTION]
        write_jsonl(paths["query"], [train[i] for i in sorted(rest[:query_size])])
        write_jsonl(paths["eval"], [r for r in held_out if r["collection"] == TARGET_COLLECTION])
    else:
        write_jsonl(paths["query"], [])
        picked = np.random.default_rng(5678).permutation(len(held_out))[:eval_size]
        write_jsonl(paths["eval"], [held_out[int(i)] for i in sorted(picked)])
    write_jsonl(paths["pool"], [train[i] for i in sorted(pool)])
    return {k: str(v) for k, v in paths.items()}
