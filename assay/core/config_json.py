"""Configs as JSON: what a run's `config.json` holds, and the dataclass config rebuilt from it.

`config_to_dict` writes a (nested) dataclass config as plain JSON data; `config_from_dict` reads
it back, checking each value against its field's type (a hand-edited or damaged config.json is one
line, not a failure deep inside a command), and never taking `trust_remote_code` from the file.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from collections.abc import Iterable
from typing import Any

from assay.core.errors import AssayError


def config_to_dict(cfg: Any) -> dict[str, Any]:
    """A dataclass config as plain JSON data."""
    return json.loads(json.dumps(dataclasses.asdict(cfg), default=str))


def config_from_dict(cls: type, data: dict[str, Any], trust_remote_code: bool = False) -> Any:
    """Rebuild a (nested) dataclass config from `config_to_dict` output.

    A field missing from `data` takes the class's `LEGACY_DEFAULTS` entry when it has one (what
    runs did before the field existed, so an old config replays as it ran), else its default.
    Every `trust_remote_code` field takes the argument, never the saved value: a folder's JSON
    (perhaps received from someone else) must not be able to run code shipped with a model;
    only the command line turns it on.
    """
    hints = typing.get_type_hints(cls)
    legacy = getattr(cls, "LEGACY_DEFAULTS", {})
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name == "trust_remote_code":
            kwargs[f.name] = trust_remote_code
        elif f.name in data:
            if not _fits(hints[f.name], data[f.name]):
                kind = _strip_annotated(hints[f.name])
                name = kind.__name__ if isinstance(kind, type) else kind
                raise AssayError(f"--{f.name} {data[f.name]!r} is not of type {name}")
            kwargs[f.name] = _from_json(hints[f.name], data[f.name], trust_remote_code)
        elif f.name in legacy:
            kwargs[f.name] = legacy[f.name]
    return cls(**kwargs)


def _from_json(tp: Any, value: Any, trust_remote_code: bool) -> Any:
    tp = _strip_annotated(tp)
    if dataclasses.is_dataclass(tp) and isinstance(value, dict):
        return config_from_dict(tp, value, trust_remote_code)  # type: ignore[arg-type]
    if typing.get_origin(tp) is tuple and isinstance(value, list):
        return tuple(value)
    if typing.get_origin(tp) in (typing.Union, types.UnionType) and isinstance(value, dict):
        for arg in typing.get_args(tp):
            if dataclasses.is_dataclass(_strip_annotated(arg)):
                return _from_json(arg, value, trust_remote_code)
    return value


def _fits(tp: Any, value: Any) -> bool:
    """Whether a JSON value can be a field of type `tp` (numbers, strings, flags, their lists and
    tuples, literals, nested configs); other types are not checked here."""
    tp = _strip_annotated(tp)
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return any(_fits(arg, value) for arg in args)
    if origin is typing.Literal:
        return value in args
    if tp is type(None):
        return value is None
    if tp is bool:
        return isinstance(value, bool)
    if tp in (int, float):
        return isinstance(value, (int, float) if tp is float else int) and not isinstance(value, bool)
    if tp is str:
        return isinstance(value, str)
    if origin in (tuple, list):
        if not isinstance(value, list):
            return False
        inner = args[:1] * len(value) if origin is list or args[-1:] == (...,) else args
        return len(inner) == len(value) and all(_fits(a, v) for a, v in zip(inner, value))
    if dataclasses.is_dataclass(tp):
        return isinstance(value, dict)
    return True


def _strip_annotated(tp: Any) -> Any:
    while typing.get_origin(tp) is typing.Annotated:
        tp = typing.get_args(tp)[0]
    return tp


def first_difference(old: dict[str, Any], new: dict[str, Any], free: Iterable[str] = ()) -> str | None:
    """The flag-style name (--x) of the first setting that differs, looking into nested configs,
    with both values: "--max_samples (100, now 200)"."""
    free = set(free)
    for key in sorted(set(old) | set(new)):
        if key in free:
            continue
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            found = first_difference(a, b, free)
            if found:
                return found
        elif a != b:
            return f"--{key} ({a!r}, now {b!r})"
    return None
