"""The SAE training loop keeps its freed [tokens, latents] temporaries for reuse
(`reuse_freed_memory`): 4,096 x 4,096 steps then fault in far fewer fresh pages (glibc).

Counted over six steps, not one: now and then a step still maps one 64 MiB temporary afresh
(16,384 pages; the heap's layout varies from run to run), which a single step's count makes
flaky, while six steps without the setting map about a million pages."""

from __future__ import annotations

import subprocess
import sys

import pytest

SCRIPT = """
import resource, sys, torch
from assay.core.memory import reuse_freed_memory
from assay.core.precision import PrecisionPolicy
from assay.sae.config import SaeArchConfig
from assay.sae.metrics import DeadLatents
from assay.sae.model import SparseAutoencoder
from assay.sae.optim import make_optimizer
from assay.sae.train import train_step
if sys.argv[1] == "on":
    reuse_freed_memory()
torch.manual_seed(0)
sae = SparseAutoencoder(64, 4096, SaeArchConfig(architecture="jumprelu"))
opt = make_optimizer(sae, 1e-3, "adam")
dead, policy, x = DeadLatents(4096, window=10**9), PrecisionPolicy.resolve("fp32"), torch.randn(4096, 64)
for i in range(3):  # the first steps size the heap
    train_step(sae, opt, x, dead, policy, 1e-3, 1.0, 1.0, i == 0)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(6):
    train_step(sae, opt, x, dead, policy, 1e-3, 1.0, 1.0, False)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc allocator behaviour")
def test_a_step_reuses_freed_temporaries():
    def faults(mode: str) -> int:
        out = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, check=True)
        return int(out.stdout.strip())

    kept, fresh = faults("on"), faults("off")
    assert fresh > 600_000  # 64 MiB temporaries mapped afresh: 16,384 pages each, several a step
    assert kept < fresh / 3
