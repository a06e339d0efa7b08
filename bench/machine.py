"""What a benchmark ran on: CPU model, the ISA features that decide which kernels torch picks, torch's
version and threads, the load. Printed in every timing benchmark's header and saved in its JSON,
because the same code runs at different ratios on different CPU families (e.g. bf16 GEMMs use AMX
tiles on recent Intel Xeons and AVX512-BF16 dot products on AMD EPYC; fp16 GEMMs with fp32
accumulation need AMX-FP16 or AVX512-FP16).

Imports only the standard library and torch: the peers' venv runs it too.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any

import torch

# /proc/cpuinfo flag -> the name printed; in the order that matters for bf16/fp16 GEMMs
ISA_FLAGS = {
    "amx_bf16": "AMX-BF16",
    "amx_fp16": "AMX-FP16",
    "amx_tile": "AMX-TILE",
    "avx512_bf16": "AVX512-BF16",
    "avx512_fp16": "AVX512-FP16",
    "avx512_vnni": "AVX512-VNNI",
    "avx512f": "AVX512F",
    "avx2": "AVX2",
    "fma": "FMA",
}


def _cpuinfo() -> tuple[str, set[str]]:
    """(model name, flags) of the first processor in /proc/cpuinfo; ("", {}) off Linux."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "", set()
    model, flags = "", set[str]()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and not model:
            model = value.strip()
        elif key == "flags" and not flags:
            flags = set(value.split())
        if model and flags:
            break
    return model, flags


def machine() -> dict[str, Any]:
    """The record: cpu, isa (present features, ISA_FLAGS order), torch, its CPU capability, threads,
    cores, load average, and the CUDA device when there is one."""
    model, flags = _cpuinfo()
    info: dict[str, Any] = {
        "cpu": model or platform.processor() or "unknown",
        "isa": [name for flag, name in ISA_FLAGS.items() if flag in flags],
        "torch": torch.__version__,
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "threads": torch.get_num_threads(),
        "cores": os.cpu_count(),
        "load_avg": [round(x, 2) for x in os.getloadavg()],
    }
    if torch.cuda.is_available():
        info["cuda_device"] = torch.cuda.get_device_name(0)
        info["cuda"] = torch.version.cuda
    return info


def header(info: dict[str, Any] | None = None) -> str:
    """One line for a benchmark's header."""
    m = info or machine()
    isa = ", ".join(m["isa"]) or "none of " + ", ".join(ISA_FLAGS.values())
    no_amx = "" if any(f.startswith("AMX") for f in m["isa"]) else " (no AMX)"
    gpu = f"; GPU {m['cuda_device']} (CUDA {m['cuda']})" if "cuda_device" in m else ""
    load = "/".join(f"{x:.2f}" for x in m["load_avg"])
    return (
        f"CPU: {m['cpu']}{no_amx}; ISA: {isa}; torch {m['torch']} ({m['torch_cpu_capability']}), "
        f"{m['threads']} thread(s) of {m['cores']} core(s); load average {load}{gpu}"
    )


if __name__ == "__main__":
    print(header())
