"""Row counts for low-precision CPU matmuls whose row count changes from call to call.

torch runs bf16/fp16 matmuls on the CPU through oneDNN, which compiles a kernel for every new
shape and keeps up to 1,024 of them (about 0.6 MB each, whatever the matrices' size:
bench/bench_kernel_cache.py). A count that follows the data, such as an MoE expert's routed
tokens or the last chunk of a batch's output-head tokens, makes a new shape on most calls: a
compile each time, and on a long run hundreds of MB of kept kernels. An expert's matmuls run on
a count rounded up by `kernel_rows` (the extra rows zero or dropped), so a run sees about 24
counts up to 2,048 rows; the head's last chunk runs on as many rows as the others
(`assay.lm.head_loss`), so the head keeps one shape. fp32 CPU matmuls (MKL) and GPU ones keep
their counts.
"""

from __future__ import annotations

import torch

MIN_ROWS = 16


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a matmul of `x` runs in: autocast's on `x`'s device where it is on, else `x`'s."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype


def kept_per_shape(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether matmuls in `dtype` on `device` keep a compiled kernel per shape (oneDNN's)."""
    return device.type == "cpu" and dtype in (torch.bfloat16, torch.float16)


def kernel_rows(n: int, dtype: torch.dtype, device: torch.device) -> int:
    """`n` rounded up to a multiple of 16 or of an eighth of its power of two (beyond 128 rows,
    at most a quarter more) for a bf16/fp16 matmul on the CPU; `n` itself otherwise."""
    if not kept_per_shape(dtype, device) or n <= 0:
        return n
    step = 1 << max(MIN_ROWS.bit_length() - 1, (n - 1).bit_length() - 3)
    return -(-n // step) * step
