"""Where does bf16 autocast start paying on this CPU? fp32 vs bf16 by model width.

For random Llama models of growing width (2 layers, MLP 8/3 × width, vocab 8192), times a
plain forward+backward and `assay build`'s collection loop (p=16) over the same token batch,
fp32 and bf16 autocast alternated, medians after a warm-up. Prints the bf16 speed-up of each.

    .venv/bin/python bench/bench_bf16_crossover.py --widths 64 128 256 512 768 --tokens 1024
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from assay.attribution.collector import GradientCollector, linear_modules
from assay.attribution.projection import Projector
from assay.core.precision import PrecisionPolicy
from assay.lm.data import Examples, collate
from assay.lm.losses import example_losses

sys.path.insert(0, str(Path(__file__).parent))
from machine import header, machine  # noqa: E402


def make_model(width: int, vocab: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=width,
        intermediate_size=(8 * width // 3 + 63) // 64 * 64,
        num_hidden_layers=2,
        num_attention_heads=max(width // 64, 1),
        num_key_value_heads=max(width // 64, 1),
        max_position_embeddings=1024,
    )
    return LlamaForCausalLM(cfg).eval()


def make_batch(tokens: int, length: int, vocab: int) -> dict[str, torch.Tensor]:
    n = tokens // length
    rng = np.random.default_rng(0)
    ex = Examples(
        ids=np.arange(n),
        offsets=np.arange(n + 1) * length,
        tokens=rng.integers(0, vocab, n * length).astype(np.int32),
        loss_start=np.ones(n, dtype=np.int64),
    )
    return collate(ex, np.arange(n), 0, pad_to=length)


def plain(model, batch, policy) -> None:
    with policy.autocast():
        loss = example_losses(model, batch).sum()
    loss.backward()
    model.zero_grad(set_to_none=True)


def collect(model, modules, batch, policy, lowp: bool = False) -> tuple[float, torch.Tensor]:
    with GradientCollector(model, modules, Projector(16), policy, project_in_compute_dtype=lowp) as col:
        t = time.perf_counter()
        rows, _ = col.gradients(batch, example_losses)
        return time.perf_counter() - t, rows


def timings(width: int, args) -> dict:
    model = make_model(width, args.vocab)
    batch = make_batch(args.tokens, args.length, args.vocab)
    fp32, bf16 = PrecisionPolicy.resolve("fp32", "cpu"), PrecisionPolicy.resolve("bf16", "cpu")
    modules = linear_modules(model)
    runs: dict[str, list[float]] = {}
    rows = {}
    for rep in range(args.repeats + 1):  # the first round warms every kernel up
        times = {}
        for name, policy in (("fp32", fp32), ("bf16", bf16)):
            t = time.perf_counter()
            plain(model, batch, policy)
            times[f"plain_{name}"] = time.perf_counter() - t
            times[f"collect_{name}"], rows[name] = collect(model, modules, batch, policy)
        times["collect_bf16_lowp"], rows["bf16_lowp"] = collect(model, modules, batch, bf16, lowp=True)
        if rep:
            for k, v in times.items():
                runs.setdefault(k, []).append(v)
    med = {k: statistics.median(v) for k, v in runs.items()}
    cos = {
        k: torch.nn.functional.cosine_similarity(rows[k], rows["fp32"], dim=1) for k in ("bf16", "bf16_lowp")
    }
    return {
        "width": width,
        "params_m": round(sum(p.numel() for p in model.parameters()) / 1e6, 2),
        **{f"{k}_tok_s": round(args.tokens / v, 1) for k, v in med.items()},
        "plain_bf16_speedup": round(med["plain_fp32"] / med["plain_bf16"], 2),
        "collect_bf16_speedup": round(med["collect_fp32"] / med["collect_bf16"], 2),
        "collect_bf16_lowp_speedup": round(med["collect_fp32"] / med["collect_bf16_lowp"], 2),
        "collect_over_plain_fp32": round(med["collect_fp32"] / med["plain_fp32"], 2),
        "collect_over_plain_bf16": round(med["collect_bf16"] / med["plain_bf16"], 2),
        **{f"min_cos_{k}_vs_fp32": round(float(c.min()), 5) for k, c in cos.items()},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--widths", type=int, nargs="+", default=[64, 128, 256, 512, 768])
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--length", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    info = machine()
    print(header(info), flush=True)
    for width in args.widths:
        print(json.dumps({**timings(width, args), "machine": info}), flush=True)


if __name__ == "__main__":
    main()
