"""The public API: every advertised name resolves, and `import assay` loads no heavy library."""

from __future__ import annotations

import subprocess
import sys

import assay


def test_every_public_name_resolves():
    for name in assay.__all__:
        assert getattr(assay, name) is not None, name


def test_import_assay_is_light():
    heavy = "('torch', 'transformers', 'numpy')"
    code = f"import sys, assay; print(sorted(m for m in {heavy} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
