"""Freed tensor memory goes back to the OS once `return_freed_memory` has run (glibc); the peak
resident memory of a block is seen even when freed before the block ends."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from assay.core.memory import MATMUL_CACHE, PeakResident, small_matmul_cache
from assay.core.precision import cpu_has_fast_bf16

SCRIPT = """
import sys, torch
from assay.core.memory import return_freed_memory
if sys.argv[1] == "on":
    return_freed_memory()
def rss_mb():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmRSS:")) / 1024
warm = torch.ones(2 << 20)  # 8 MiB allocated and freed: glibc raises its threshold past it
del warm
tensors = [torch.ones(1 << 20) for _ in range(64)]  # 64 x 4 MiB
held = rss_mb()
del tensors[::2]  # free every other one: holes between live blocks
print(held - rss_mb())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc allocator behaviour")
def test_freed_tensors_leave_the_process():
    def returned(mode: str) -> float:
        out = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, check=True)
        return float(out.stdout.strip())

    assert returned("on") > 100  # 128 MiB freed in holes: given back
    assert returned("off") < 50  # glibc's default keeps them: the test can tell the difference


FROZEN = """
import gc, sys
from assay.cli import entry
sys.argv = ["assay", *sys.argv[1:]]
before = gc.get_freeze_count()
try:
    entry()
except SystemExit:
    pass
libraries = ["torch" in sys.modules, "transformers.modeling_utils" in sys.modules]
print(*libraries, gc.isenabled(), gc.get_freeze_count() > before)
"""


def test_entry_imports_a_command_frozen_and_help_stays_light():
    """`assay CMD` imports the command and the model libraries with their objects frozen out of
    the garbage collector (which stays on); `assay --help` imports none of them."""

    def run(*args: str) -> list[str]:
        out = subprocess.run(
            [sys.executable, "-c", FROZEN, *args], capture_output=True, text=True, check=True
        )
        return out.stdout.splitlines()[-1].split()  # after the command's own output

    assert run("--help") == ["False", "False", "True", "True"]  # frozen at the end only
    assert run("eval", "--help")[1:3] == ["False", "True"]  # the config class needs torch only
    frozen = run("eval", "--model", "nonexistent-model-dir", "--dataset", "x.jsonl")  # fails fast
    assert frozen == ["True", "True", "True", "True"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_peak_resident_sees_a_transient_allocation():
    with PeakResident() as base:
        time.sleep(0.05)
    with PeakResident() as peak:
        block = np.ones(300 * 2**20 // 8)  # 300 MiB, touched
        time.sleep(0.05)
        del block
    assert peak.gb - base.gb > 0.25  # seen although freed before the block ended
    assert peak.gb < base.gb + 1.0


CACHE = """
import ctypes, os, sys, torch
from assay.core.memory import MATMUL_CACHE, small_matmul_cache
os.environ.pop(MATMUL_CACHE, None)
if sys.argv[1] == "on":
    small_matmul_cache()
libc = ctypes.CDLL("libc.so.6")
class Info(ctypes.Structure):  # glibc's mallinfo2: bytes in use on the heap and in mappings
    names = "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost"
    _fields_ = [(n, ctypes.c_size_t) for n in names.split()]
libc.mallinfo2.restype = Info
def used_mb():
    info = libc.mallinfo2()
    return (info.uordblks + info.hblkhd) / 2**20
w = torch.randn(512, 128)
def step(n):  # a bf16 autocast linear layer's forward and backward, one shape
    x = torch.randn(n, 128, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = torch.nn.functional.linear(x, w)
    y.float().sum().backward()
step(8)
before = used_mb()
for n in range(1, 31):
    step(16 * n)
print(used_mb() - before)
"""


def test_small_matmul_cache_keeps_the_users_choice(monkeypatch):
    monkeypatch.delenv(MATMUL_CACHE, raising=False)  # restored after the test either way
    small_matmul_cache()
    assert os.environ[MATMUL_CACHE] == "1"
    monkeypatch.setenv(MATMUL_CACHE, "64")
    small_matmul_cache()
    assert os.environ[MATMUL_CACHE] == "64"


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or not torch.backends.mkldnn.is_available(),
    reason="glibc's allocator statistics; ideep (oneDNN) matmuls",
)
@pytest.mark.skipif(
    not cpu_has_fast_bf16(),
    reason="no AMX or AVX512-BF16: bf16 linear layers take torch's own kernel, which keeps no ideep cache",
)
def test_small_matmul_cache_stops_memory_growing_per_shape():
    """30 input shapes of a bf16 linear layer: ideep kept about 0.5 MB per shape (31 MB, against
    16 MB with one entry, where oneDNN's own primitive cache is what grows). If torch stopped
    reading the variable, the two would be level."""

    def growth(mode: str) -> float:
        out = subprocess.run([sys.executable, "-c", CACHE, mode], capture_output=True, text=True, check=True)
        return float(out.stdout.strip())

    assert growth("on") < 0.75 * growth("off")
