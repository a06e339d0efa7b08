"""The layout's rules, checked: modules stay readable, and hidden imports say why they are hidden.

(The import contracts between layers are checked by `lint-imports` in `make lint`.)"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "assay"
MAX_LINES = 500


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_no_module_is_longer_than_the_budget():
    long = {
        str(p.relative_to(PACKAGE)): n
        for p in _modules()
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def test_function_local_imports_say_why():
    """Imports belong at the top of a module; one inside a function (to keep `assay --help` fast,
    to avoid loading a heavy optional library) carries a comment on its line saying so."""
    silent = []
    for path in _modules():
        lines = path.read_text().splitlines()
        for node in ast.walk(ast.parse("\n".join(lines))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                for inner in ast.walk(node):
                    if isinstance(inner, ast.Import | ast.ImportFrom):
                        line = lines[inner.lineno - 1] + (
                            lines[inner.end_lineno - 1] if inner.end_lineno else ""
                        )
                        if "#" not in line:
                            silent.append(f"{path.relative_to(PACKAGE)}:{inner.lineno}")
    assert not silent, f"function-local imports without a reason: {sorted(set(silent))}"
