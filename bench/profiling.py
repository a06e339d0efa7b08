"""torch.profiler's table of one piece of benchmark work, for the benchmarks' --profile options."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def profile_table(run: Callable[[], Any], device: torch.device, rows: int) -> str:
    """The `rows` ops with the most self time on the device while `run()` runs (CUDA kernels
    where there are any, else the CPU's), with call counts."""
    from torch.profiler import ProfilerActivity, profile  # bench-only, and only when asked

    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        run()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=sort, row_limit=rows)
