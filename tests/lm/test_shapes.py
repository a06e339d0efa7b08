"""Row counts for low-precision CPU matmuls (`assay.lm.shapes`): few distinct sizes, each at
least the count it stands for and not much more; other dtypes and devices unchanged."""

from __future__ import annotations

import torch

from assay.lm.shapes import kernel_rows

CPU = torch.device("cpu")


def test_counts_round_up_to_few_sizes():
    sizes = set()
    for n in range(1, 2049):
        padded = kernel_rows(n, torch.bfloat16, CPU)
        assert n <= padded <= max(16, n + 16, 1.25 * n), n
        assert kernel_rows(padded, torch.bfloat16, CPU) == padded  # a rounded count stays
        sizes.add(padded)
    assert len(sizes) <= 25
    assert [kernel_rows(n, torch.float16, CPU) for n in (1, 100, 129, 500)] == [16, 112, 160, 512]


def test_counts_grow_with_n():
    counts = [kernel_rows(n, torch.bfloat16, CPU) for n in range(1, 4097)]
    assert counts == sorted(counts)  # a chunk's buffer sized for the largest count fits all


def test_fp32_and_gpu_counts_are_left_alone():
    assert [kernel_rows(n, torch.float32, CPU) for n in (1, 100, 129)] == [1, 100, 129]
    assert kernel_rows(100, torch.bfloat16, torch.device("cuda")) == 100
    assert kernel_rows(0, torch.bfloat16, CPU) == 0
