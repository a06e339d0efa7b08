"""Which examples a fine-tune trains on, and in what order.

Order is a plan of example *ids* per epoch, saved as `order.json` by every run. A subset
run with `--ordered FULL_RUN` replays the full run's plan, skipping ids it does not have,
so a comparison between subsets is not confounded by the order the data was seen in.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from assay.core.errors import AssayError
from assay.core.runs import read_json, write_json

ORDER_FILE = "order.json"
SELECTION_FILES = ("selected_ids.txt", "selection.jsonl")


def read_ids(path: str | Path) -> np.ndarray:
    """Example ids from an `assay filter` folder, a .txt (one per line), .json, .jsonl or .npy."""
    path = Path(path)
    if path.is_dir():
        for name in SELECTION_FILES:
            if (path / name).exists():
                return read_ids(path / name)
        raise AssayError(
            f"{path} holds no selection ({' or '.join(SELECTION_FILES)}); is it an assay filter run?"
        )
    if not path.exists():
        raise AssayError(f"subset file {path} not found")
    if path.suffix == ".npy":
        ids = _as_ids(np.load(path, allow_pickle=False), path)
    elif path.suffix == ".jsonl":
        ids = _as_ids([r["id"] for r in selection_records(path)], path)
    elif path.suffix == ".json":
        data = read_json(path)
        if isinstance(data, dict) and "ids" not in data:
            raise AssayError(f'{path} has no "ids": a .json selection is a list of ids or {{"ids": [...]}}')
        ids = _as_ids(data["ids"] if isinstance(data, dict) else data, path)
    else:
        ids = _as_ids(_text(path).split(), path)
    if len(ids) == 0:
        raise AssayError(f"subset {path} is empty")
    if len(np.unique(ids)) != len(ids):
        raise AssayError(f"subset {path} lists some example ids more than once")
    return ids


def selection_records(path: Path) -> list[dict]:
    """The records of a selection.jsonl, each a JSON object with an "id"."""
    records = []
    for n, line in enumerate(_text(path).splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            record = None
        if not isinstance(record, dict) or "id" not in record:
            raise AssayError(f'line {n} of {path} is not a record with an "id" (one {{"id": N}} per line)')
        records.append(record)
    return records


def _as_ids(values: object, path: Path) -> np.ndarray:
    """Integer example ids (whole numbers; "12" in a .txt), or one line naming the first that is not."""
    if isinstance(values, np.ndarray) and values.dtype.kind in "iu":  # an .npy of ids: no loop
        return values.astype(np.int64).reshape(-1)
    flat = np.asarray(values, dtype=object).reshape(-1)
    ids = np.empty(len(flat), dtype=np.int64)
    for i, value in enumerate(flat):
        try:
            ids[i] = _integer(value)
        except (TypeError, ValueError, OverflowError):
            raise AssayError(f"{path} lists {value!r}, not an example id (ids are whole numbers)") from None
    return ids


def _integer(value: object) -> int:
    if isinstance(value, (bool, np.bool_)):
        raise TypeError("a boolean is not an id")
    if isinstance(value, str):
        return int(value)
    number = float(value)  # type: ignore[arg-type]
    if not number.is_integer():
        raise ValueError("not a whole number")
    return int(value)  # type: ignore[call-overload]


def _text(path: Path) -> str:
    try:
        return path.read_text()
    except UnicodeDecodeError:
        raise AssayError(f"{path} is not a text file; a selection lists example ids") from None


def read_weights(path: str | Path) -> dict[int, float] | None:
    """{id: weight} of a selection whose examples carry weights (an `assay filter` folder or its
    selection.jsonl, with a "weight" per record), else None (every example counts once)."""
    path = Path(path)
    if path.is_dir():
        path = path / "selection.jsonl"
    if path.suffix != ".jsonl" or not path.exists():
        return None
    records = selection_records(path)
    if not records or "weight" not in records[0]:
        return None
    ids = _as_ids([r["id"] for r in records], path)
    weights = {}
    for i, record in zip(ids.tolist(), records):
        try:
            weights[i] = float(record["weight"])
        except (KeyError, TypeError, ValueError):
            raise AssayError(f'{path}: example {i} has no numeric "weight"; every record needs one') from None
    bad = [i for i, w in weights.items() if not (w > 0 and np.isfinite(w))]
    if bad:
        raise AssayError(f"{path}: example {bad[0]} has weight {weights[bad[0]]}; weights must be positive")
    return weights


def shuffled_plan(ids: np.ndarray, num_epochs: int, seed: int) -> list[np.ndarray]:
    """A fresh permutation of `ids` per epoch, from (seed, epoch) only."""
    return [ids[np.random.default_rng([seed, epoch]).permutation(len(ids))] for epoch in range(num_epochs)]


def replayed_plan(full_run: str | Path, ids: np.ndarray, num_epochs: int) -> list[np.ndarray]:
    """The full run's visit order restricted to `ids` (non-selected examples skipped)."""
    path = Path(full_run) / ORDER_FILE
    if not path.exists():
        raise AssayError(
            f"--ordered {full_run}: no {ORDER_FILE} there; point it at a finished assay finetune run"
        )
    epochs = [np.asarray(e, dtype=np.int64) for e in read_json(path)["epochs"]]
    if num_epochs > len(epochs):
        raise AssayError(
            f"--ordered {full_run} recorded {len(epochs)} epoch(s); this run asks for {num_epochs}. "
            "Use --num_epochs <= the full run's"
        )
    missing = np.setdiff1d(ids, epochs[0])
    if len(missing):
        raise AssayError(f"--ordered {full_run} never visited example id {int(missing[0])} of this subset")
    return restricted_plan(epochs[:num_epochs], ids)


def restricted_plan(plan: list[np.ndarray], ids: np.ndarray) -> list[np.ndarray]:
    """`plan`'s visit order with only `ids` kept (every other example skipped)."""
    return [e[np.isin(e, ids)].astype(np.int64) for e in plan]


def write_plan(path: Path, plan: list[np.ndarray]) -> None:
    write_json(path, {"epochs": [e.tolist() for e in plan]})
