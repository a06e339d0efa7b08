"""A dataset split as columns in memory: the part of a `datasets.Dataset` that assay uses.

JSON-lines files (the bundled corpora among them) are read with the standard library:
importing `datasets` costs a process ~90 MB of resident memory and ~0.4 s, more than reading
a file of tunes takes. Every other source (parquet, csv, text, saved folders, the hub) is read
by `datasets` and kept as the columns a run needs.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from assay.core.errors import AssayError


@dataclass(frozen=True)
class Table:
    """Rows as named columns of equal length, with a fingerprint that identifies the rows."""

    columns: dict[str, list[Any]]
    fingerprint: str  # changes whenever the rows do: keys the tokenization cache

    @classmethod
    def from_columns(cls, columns: dict[str, list[Any]]) -> Table:
        """A table of in-memory values (e.g. query texts), fingerprinted by its content."""
        return cls(columns, _digest(json.dumps(columns, sort_keys=True, default=str)))

    @classmethod
    def from_jsonl(cls, path: Path) -> Table:
        """One row per non-blank line, each a JSON object; a key missing from a row reads as None."""
        data = path.read_bytes()
        rows = []
        for number, line in enumerate(data.split(b"\n"), 1):  # not splitlines: JSON strings may hold U+2028
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except UnicodeDecodeError:
                raise AssayError(f"could not read {path}: line {number} is not UTF-8 text") from None
            except json.JSONDecodeError as e:
                raise AssayError(f"could not read {path}: line {number} is not JSON ({e.msg})") from None
            if not isinstance(row, dict):
                raise AssayError(f"could not read {path}: line {number} is not a JSON object")
            rows.append(row)
        names = list(dict.fromkeys(key for row in rows for key in row))
        columns = {name: [row.get(name) for row in rows] for name in names}
        return cls(columns, _digest("jsonl", data))

    @classmethod
    def from_dataset(cls, dataset: Any, keep: Sequence[str]) -> Table:
        """The columns `keep` of a `datasets.Dataset` (those it has), under its own fingerprint."""
        names = [c for c in keep if c in dataset.column_names]
        return cls({c: list(dataset[c]) for c in names}, str(dataset._fingerprint))

    @property
    def column_names(self) -> list[str]:
        return list(self.columns)

    def __len__(self) -> int:
        return len(next(iter(self.columns.values()), []))

    def __getitem__(self, key: str | int) -> Any:
        """A column (by name) as a list, or a row (by position) as a dict."""
        if isinstance(key, str):
            return self.columns[key]
        return {name: values[key] for name, values in self.columns.items()}

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return (self[i] for i in range(len(self)))

    def select(self, positions: Sequence[int]) -> Table:
        """The rows at these positions, in this order."""
        picked = [int(p) for p in positions]
        columns = {name: [values[p] for p in picked] for name, values in self.columns.items()}
        return Table(columns, _digest(self.fingerprint, json.dumps(picked)))

    def with_column(self, name: str, values: list[Any]) -> Table:
        if len(values) != len(self):
            raise ValueError(f"column {name!r} has {len(values)} values for {len(self)} rows")
        added = json.dumps(values, default=str)
        return Table({**self.columns, name: values}, _digest(self.fingerprint, "column", name, added))


def _digest(*parts: str | bytes) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(part if isinstance(part, bytes) else part.encode())
        h.update(b"\0")
    return h.hexdigest()[:32]
