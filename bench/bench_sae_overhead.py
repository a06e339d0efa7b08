"""The host's share of one SAE training step: torch calls per step and milliseconds per step at a
size where the arithmetic is negligible (d = 16, 256 latents, batches of 64), per architecture.

On a GPU the host issues every kernel of a step, so a step can take no less than this however
fast the GPU is; on the H200 the published-width synthetic run's BatchTopK steps took about 9 ms beyond the
generator's draw (docs/BENCHMARKS.md), where their matrix products need well under one. This
measures that floor
on the CPU: `assay.sae.loop.train_step` as assay trains, one thread, after warm-up steps; torch
calls are counted with a TorchFunctionMode (every call made from assay's own code).

    OMP_NUM_THREADS=1 python bench/bench_sae_overhead.py
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

sys.path.insert(0, str(Path(__file__).parent))
from bench_sae_common import matryoshka_widths  # noqa: E402
from machine import header, machine  # noqa: E402

ARCHS = ("topk", "batchtopk", "matryoshka", "jumprelu", "relu")


class CallCounter(TorchFunctionMode):
    """Counts torch function calls made from assay's modules, by file."""

    def __init__(self) -> None:
        super().__init__()
        self.by_file: Counter[str] = Counter()

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        frame = sys._getframe(1)
        while frame is not None and "/assay/" not in frame.f_code.co_filename:
            frame = frame.f_back  # type: ignore[assignment]
        if frame is not None:
            self.by_file[frame.f_code.co_filename.split("/assay/")[-1]] += 1
        return func(*args, **(kwargs or {}))


def measure(arch: str, args: argparse.Namespace) -> dict[str, Any]:
    from assay.core.precision import PrecisionPolicy
    from assay.sae.config import SaeArchConfig
    from assay.sae.metrics import DeadLatents
    from assay.sae.model import SparseAutoencoder
    from assay.sae.optim import make_optimizer
    from assay.sae.train import train_step

    torch.manual_seed(0)
    widths = {"matryoshka_widths": matryoshka_widths(args.d_sae)} if arch == "matryoshka" else {}
    cfg = SaeArchConfig(architecture=arch, k=args.k, **widths)
    sae = SparseAutoencoder(args.d_in, args.d_sae, cfg)
    x = torch.randn(args.batch, args.d_in)
    opt = make_optimizer(sae, 1e-3, "signum" if cfg.unit_decoder else "adam")
    dead = DeadLatents(args.d_sae, window=4 * args.batch, aux_window=2 * args.batch)
    policy = PrecisionPolicy.resolve(args.precision, "cpu")
    coef = 0.0 if cfg.unit_decoder else 1.0  # the penalised kinds pay their penalty's ops too

    def step(first: bool = False) -> None:
        train_step(sae, opt, x, dead, policy, 1e-3, coef, 1.0, first)

    for i in range(args.warmup):
        step(i == 0)
    counter = CallCounter()
    with counter:
        step()
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    ms = (time.perf_counter() - start) / args.steps * 1e3
    calls = sum(counter.by_file.values())
    return {"arch": arch, "calls": calls, "ms_per_step": ms, "by_file": counter.by_file}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--archs", nargs="+", default=list(ARCHS), choices=ARCHS)
    ap.add_argument("--d_in", type=int, default=16)
    ap.add_argument("--d_sae", type=int, default=256)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--warmup", type=int, default=12, help="untimed steps (AuxK starts once latents die)")
    ap.add_argument("--steps", type=int, default=50)
    args = ap.parse_args()
    print(header(machine()), flush=True)
    print("| architecture | torch calls per step | ms per step | calls by file (top 3) |")
    print("|---|---:|---:|---|")
    for arch in args.archs:
        r = measure(arch, args)
        top = ", ".join(f"{name} {n}" for name, n in r["by_file"].most_common(3))
        print(f"| {arch} | {r['calls']} | {r['ms_per_step']:.2f} | {top} |", flush=True)


if __name__ == "__main__":
    main()
