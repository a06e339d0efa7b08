"""Copy SAELens's synthetic-activation generator (MIT licensed) out of an environment that has
SAELens into DEST/sae_lens, for a machine that has torch but not SAELens (the GPU machine:
bench/gpu_prepare.sh, bench/sae_synthetic_stream.py).

The generator's modules need only torch, safetensors, huggingface_hub and transformers; the
sae_lens package's own __init__ files import its trainer, transformer_lens and more. So the
modules are copied unchanged and the two package files are replaced by stubs that import only
the generator.

  .venv-peers/bin/python bench/saelens_generator_copy.py .gpu/synth
"""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path

MODULES = [
    "constants.py",
    "util.py",
    *(
        f"synthetic/{m}.py"
        for m in (
            "activation_generator",
            "correlation",
            "feature_dictionary",
            "firing_magnitudes",
            "firing_probabilities",
            "registry",
            "synthetic_model",
        )
    ),
]
PACKAGE_STUB = 'import logging\n\nlogger = logging.getLogger("sae_lens")\n'
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


def copy_generator(dest: Path) -> Path:
    """DEST/sae_lens with the generator's modules; returns DEST (for PYTHONPATH)."""
    spec = importlib.util.find_spec("sae_lens")  # located, not imported
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("SAELens is not installed here: run with .venv-peers/bin/python (make test-interop)")
    src = Path(spec.submodule_search_locations[0])
    package = dest / "sae_lens"
    shutil.rmtree(package, ignore_errors=True)
    (package / "synthetic").mkdir(parents=True)
    for module in MODULES:
        shutil.copy(src / module, package / module)
    shutil.copytree(src / "synthetic" / "hierarchy", package / "synthetic" / "hierarchy",
                    ignore=shutil.ignore_patterns("__pycache__"))  # fmt: skip
    for license_file in src.parent.glob("sae_lens-*.dist-info/licenses/LICENSE"):
        shutil.copy(license_file, package / "LICENSE")
    (package / "__init__.py").write_text(PACKAGE_STUB)
    (package / "synthetic" / "__init__.py").write_text(SYNTHETIC_STUB)
    return dest


if __name__ == "__main__":
    print(copy_generator(Path(sys.argv[1] if len(sys.argv) > 1 else ".gpu/synth")))
