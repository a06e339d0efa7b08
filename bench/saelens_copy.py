"""Copy SAELens (MIT licensed) out of an environment that has it into DEST, for a machine that has
torch but not SAELens (the GPU machine: bench/gpu_prepare.sh, bench/sae_synthetic_stream.py):
its synthetic-activation generator, and its training SAEs and SAETrainer.

SAELens's modules are copied unchanged; what its packages import for other uses is left out.
Its `__init__` keeps the SAE classes (imported on first use) and their registration, not the
LM-training runner, TransformerLens models or the pretrained-SAE loaders; `sae_lens.synthetic`'s
leaves out its plots (plotly). Of TransformerLens, only the hook-point modules the SAE classes
subclass are copied, with stubs for their package files; W&B is a stub that logs nothing (the
trainer imports it at module level; the benchmark runs with log_to_wandb off). The generator
needs torch, safetensors, huggingface_hub and transformers; the SAE classes and trainer also
einops, jaxtyping and simple_parsing (the last carried in .whl/peers for the GPU machine).

  .venv-peers/bin/python bench/saelens_copy.py .gpu/synth
"""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import shutil
import sys
from pathlib import Path

SYNTHETIC_STUB = """from sae_lens.synthetic.firing_magnitudes import (
    FoldedNormalMagnitudeConfig,
    LinearMagnitudeConfig,
)
from sae_lens.synthetic.firing_probabilities import ZipfianFiringProbabilityConfig
from sae_lens.synthetic.hierarchy import HierarchyConfig
from sae_lens.synthetic.synthetic_model import (
    LowRankCorrelationConfig,
    OrthogonalizationConfig,
    SyntheticModel,
    SyntheticModelConfig,
)
"""
"""The generator alone: SAELens's sae_lens.synthetic also imports its plots (plotly)."""
HOOK_MODULES = [  # TransformerLens's files that SAELens's SAE classes import, unchanged
    "hook_points.py",
    "HookedRootModule.py",
    "utilities/slice.py",
    "utilities/tensors.py",
    "utilities/devices.py",
    "conversion_utils/conversion_steps/base_tensor_conversion.py",
]
HOOK_STUBS = {  # its package files, reduced to what those modules import
    "__init__.py": "",
    "HookedTransformer.py": "from transformer_lens.HookedRootModule import HookedRootModule  # noqa: F401\n",
    "utilities/__init__.py": "from .devices import warn_if_mps\nfrom .slice import Slice, SliceInput\n",
    "conversion_utils/__init__.py": "",
    "conversion_utils/conversion_steps/__init__.py": "",
}
WANDB_STUB = '''"""Stands in for W&B where SAELens's trainer runs with log_to_wandb off: logs nothing."""


def log(*args, **kwargs):
    pass


class Histogram:
    def __init__(self, *args, **kwargs):
        pass
'''


PACKAGE_INIT = """__version__ = "{version}"

import logging

logger = logging.getLogger(__name__)


def __getattr__(name):  # the SAE classes on first use: the generator alone needs none of their imports
    import importlib

    _classes = importlib.import_module("sae_lens._classes")  # `from sae_lens import` would recurse
    try:
        return getattr(_classes, name)
    except AttributeError:
        raise AttributeError(f"module 'sae_lens' has no attribute {{name!r}}") from None
"""


def package_files(original: str, version: str) -> dict[str, str]:
    """SAELens's `__init__` split in two: `__init__` keeps the version and the logger, and hands
    any other name to `_classes`, which imports the SAE classes and registers them (saving an SAE
    looks its class up in that registry) on first use. Its imports of anything else (the trainers
    for LMs, TransformerLens models, the pretrained-SAE loaders) and the `__all__` and try blocks
    that go with them are left out."""
    keep = []
    for node in ast.parse(original).body:
        if isinstance(node, ast.ImportFrom):
            ok = node.module == "sae_lens.saes" or (node.level == 1 and node.module == "registry")
        else:
            ok = isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)  # the registrations
        if ok:
            keep.append(node)
    classes = "# ruff: noqa\n" + ast.unparse(ast.Module(body=keep, type_ignores=[])) + "\n"
    return {"__init__.py": PACKAGE_INIT.format(version=version), "_classes.py": classes}


def _source(package: str) -> Path:
    spec = importlib.util.find_spec(package)  # located, not imported
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"{package} is not installed here: run with .venv-peers/bin/python")
    return Path(spec.submodule_search_locations[0])


def copy_saelens(dest: Path) -> Path:
    """DEST/sae_lens, DEST/transformer_lens (hook points only) and DEST/wandb (a stub); returns
    DEST (for PYTHONPATH)."""
    src = _source("sae_lens")
    package = dest / "sae_lens"
    shutil.rmtree(package, ignore_errors=True)
    shutil.copytree(src, package, ignore=shutil.ignore_patterns("__pycache__", "tutorial"))
    for license_file in src.parent.glob("sae_lens-*.dist-info/licenses/LICENSE"):
        shutil.copy(license_file, package / "LICENSE")
    version = importlib.metadata.version("sae_lens")
    for name, text in package_files((src / "__init__.py").read_text(), version).items():
        (package / name).write_text(text)
    (package / "synthetic" / "__init__.py").write_text(SYNTHETIC_STUB)
    lens_src, lens = _source("transformer_lens"), dest / "transformer_lens"
    shutil.rmtree(lens, ignore_errors=True)
    for name, text in HOOK_STUBS.items():
        (lens / name).parent.mkdir(parents=True, exist_ok=True)
        (lens / name).write_text(text)
    for name in HOOK_MODULES:
        shutil.copy(lens_src / name, lens / name)
    (dest / "wandb").mkdir(parents=True, exist_ok=True)
    (dest / "wandb" / "__init__.py").write_text(WANDB_STUB)
    return dest


if __name__ == "__main__":
    print(copy_saelens(Path(sys.argv[1] if len(sys.argv) > 1 else ".gpu/synth")))
