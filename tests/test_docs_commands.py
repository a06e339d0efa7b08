"""The commands the docs give still run as written: every flag of an `assay` command in README.md
and docs/*.md is one that command takes, every `python bench/...` or `python scripts/...` names a
script that exists and defines the flags given to it, and every `make` target exists. A renamed or
dropped flag would otherwise leave a documented figure without the command that reproduces it."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

from assay.cli import main
from assay.commands import COMMANDS

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9_-]*")


def _joined(path: Path) -> str:
    """The file with shell continuation lines joined, so a command is one line."""
    return re.sub(r"\\\n\s*", " ", path.read_text())


def _help_flags(name: str) -> set[str]:
    shown = io.StringIO()
    with contextlib.redirect_stdout(shown), contextlib.suppress(SystemExit):  # tyro exits after help
        main([*name.split(), "--help"])
    return set(FLAG.findall(shown.getvalue()))


def _documented(pattern: str) -> list[tuple[str, str, str]]:
    """(doc file, the command's first group, the rest of its line) for every match in the docs."""
    found = []
    for doc in DOCS:
        for match in re.finditer(pattern, _joined(doc), re.M):
            found.append((doc.name, match.group(1), match.group(2)))
    return found


def test_the_docs_mention_commands_at_all():
    # a pattern that matched nothing would make the tests below pass vacuously
    assert len(_documented(r"(?:^|[`\s(])assay ((?:sae )?[a-z]+)([^`\n]*)")) > 50
    assert len(_documented(r"python ((?:bench|scripts)/[\w/]+\.py)([^`\n]*)")) > 20


def test_every_documented_assay_flag_exists():
    flags = {name: _help_flags(name) for name in COMMANDS}
    unknown = []
    for doc, name, rest in _documented(r"(?:^|[`\s(])assay ((?:sae )?[a-z]+)([^`\n]*)"):
        if name not in COMMANDS:
            continue  # prose ("assay keeps ...") or `assay replay`, which takes a folder only
        for flag in FLAG.findall(rest.split(" -- ")[0].split("#")[0]):
            if flag not in flags[name] | {"--help"}:
                unknown.append(f"{doc}: assay {name} {flag}")
    assert not unknown, unknown


def test_every_documented_script_and_its_flags_exist():
    unknown = []
    for doc, script, rest in _documented(r"python ((?:bench|scripts)/[\w/]+\.py)([^`\n]*)"):
        path = ROOT / script
        if not path.exists():
            unknown.append(f"{doc}: {script} does not exist")
            continue
        source = path.read_text()
        for flag in FLAG.findall(rest.split(" -- ")[0].split("#")[0]):  # after --: the command it runs
            if flag != "--help" and f'"{flag}"' not in source:
                unknown.append(f"{doc}: {script} {flag}")
    assert not unknown, unknown


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_documented_make_target_exists(doc):
    targets = set(re.findall(r"^([a-z][a-z-]*):", (ROOT / "Makefile").read_text(), re.M))
    named = set(re.findall(r"`make ([a-z][a-z-]*)", doc.read_text()))
    assert named <= targets, named - targets
