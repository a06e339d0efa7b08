"""SAE architectures, one file each, registered by name (`REGISTRY`).

Adding an architecture is adding a file here: a subclass of `base.Architecture` decorated
with `@register`. Every module of this package is imported when the package is, so the
registry (and `--architecture`'s choices) always list them all.
"""

from __future__ import annotations

import importlib
import pkgutil

from assay.core.errors import AssayError
from assay.sae.architectures.base import REGISTRY, Architecture, TrainOutput, register

__all__ = ["REGISTRY", "Architecture", "TrainOutput", "architecture_class", "names", "register"]

for _info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
    importlib.import_module(f"{__name__}.{_info.name}")

# The order of `--architecture`'s choices: the four classic ones first, then the rest by name.
_FIRST = ("relu", "topk", "batchtopk", "jumprelu")


def names() -> tuple[str, ...]:
    """Registered architecture names."""
    return tuple(n for n in _FIRST if n in REGISTRY) + tuple(sorted(set(REGISTRY) - set(_FIRST)))


def architecture_class(name: str) -> type[Architecture]:
    """The architecture registered as `name` (an AssayError naming the choices otherwise)."""
    if name not in REGISTRY:
        raise AssayError(f"--architecture must be one of {', '.join(names())}, got {name!r}")
    return REGISTRY[name]


def saved_as(saelens_name: str) -> type[Architecture] | None:
    """The architecture that reads a saved cfg.json `architecture` (None: not supported)."""
    return next((c for c in REGISTRY.values() if saelens_name in c.loads_from), None)
