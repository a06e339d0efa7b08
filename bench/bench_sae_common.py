"""The shared protocol of the SAE benchmarks (ours: bench_sae.py; peers: bench_sae_peers.py).

Both read the same cached activations (assay's cache format: activations.npy + meta.json),
normalise them by the same scale (mean norm sqrt(d_in), from the first 65,536 rows), and
feed every library the same batches in the same order: batch i = rows perm[i*B:(i+1)*B]
of one seeded permutation. Timing starts after WARMUP steps. Quality is measured on the
same held-out activations: FVU, L0 and the dead fraction (latents that did not fire on the
last DEAD_WINDOW_STEPS training batches).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from machine import machine as cpu_record  # noqa: E402

WARMUP = 5
DEAD_WINDOW_STEPS = 25


def matryoshka_widths(d_sae: int) -> list[int]:
    """Matryoshka levels for both libraries (assay's default): d_sae / 16, / 8, / 4, / 2, d_sae."""
    return [d_sae >> j for j in range(4, -1, -1)]


def saelens_topk_kind(arch: str, d_in: int, d_sae: int, k: int) -> Any:
    """SAELens's training SAE of a TopK kind (topk, batchtopk, matryoshka) at its recommended
    settings (peers' environment)."""
    import sae_lens as sl

    if arch == "batchtopk":
        return sl.BatchTopKTrainingSAE(sl.BatchTopKTrainingSAEConfig(d_in=d_in, d_sae=d_sae, k=k))
    if arch == "matryoshka":
        widths = matryoshka_widths(d_sae)
        cfg = sl.MatryoshkaBatchTopKTrainingSAEConfig(d_in=d_in, d_sae=d_sae, k=k, matryoshka_widths=widths)
        return sl.MatryoshkaBatchTopKTrainingSAE(cfg)
    return sl.TopKTrainingSAE(sl.TopKTrainingSAEConfig(d_in=d_in, d_sae=d_sae, k=k))


def load_split(folder: Path) -> np.ndarray:
    meta = json.loads((folder / "meta.json").read_text())
    arr = np.load(folder / "activations.npy", mmap_mode="r", allow_pickle=False)
    return np.asarray(arr, dtype=np.float32).reshape(-1, int(meta["d_in"]))


def scale_of(train: np.ndarray) -> float:
    sample = train[:65536]
    return float(np.sqrt(train.shape[1]) / np.linalg.norm(sample, axis=1).mean())


def batches(train: np.ndarray, scale: float, batch: int, steps: int, seed: int = 0) -> list[torch.Tensor]:
    perm = np.random.default_rng(seed).permutation(len(train))
    if steps * batch > len(train):
        raise SystemExit(f"need {steps * batch} cached tokens, have {len(train)}")
    return [torch.from_numpy(train[np.sort(perm[i * batch : (i + 1) * batch])] * scale) for i in range(steps)]


def quality(reconstruct: Any, encode: Any, held_out: torch.Tensor) -> dict[str, float]:
    """FVU and L0 on held-out activations (fp64 sums)."""
    with torch.no_grad():
        x_hat, z = reconstruct(held_out), encode(held_out)
    x = held_out.double()
    err = (x - x_hat.double()).pow(2).sum()
    var = (x - x.mean(0)).pow(2).sum()
    return {"fvu": float(err / var), "l0": float((z != 0).sum(-1).float().mean())}


class Timer:
    """Wall time of steps WARMUP.. end (the first steps allocate and warm caches)."""

    def __init__(self) -> None:
        self.start: float | None = None
        self.steps = 0

    def step(self, i: int) -> None:
        if i == WARMUP:
            self.start = time.perf_counter()
        if i >= WARMUP:
            self.steps += 1

    def tokens_per_s(self, batch: int) -> float:
        assert self.start is not None
        return self.steps * batch / (time.perf_counter() - self.start)


def machine() -> dict[str, Any]:
    """CPU model and ISA features, torch, threads, load (bench/machine.py), in every result line."""
    return cpu_record()


def record(
    name: str, precision: str, d_in: int, d_sae: int, args: Any, speed: float, q: dict, dead: float
) -> dict[str, Any]:
    """One result line, the same fields for every library."""
    return {
        "library": name,
        "precision": precision,
        "d_in": d_in,
        "d_sae": d_sae,
        "k": args.k,
        "batch": args.batch,
        "steps": args.steps,
        "tokens_per_s": speed,
        **q,
        "dead_fraction": dead,
        **machine(),
    }


def firing_trace(fired_per_step: list[int], last_fired: torch.Tensor, dead: torch.Tensor) -> dict[str, Any]:
    """--trace_firing's record: latents firing at each step, and the step each latent dead at the
    end last fired on (-1: never), as counts: when the dead latents stopped."""
    steps, counts = torch.unique(last_fired[dead], return_counts=True)
    return {"fired_per_step": fired_per_step, "dead_last_fired": dict(zip(steps.tolist(), counts.tolist()))}
