"""Benchmark `assay finetune`'s training loop against a plain training loop, side by side.

Both loops see the very same batches of real ABC tunes, the same model and AdamW; the plain
loop is the textbook `loss = model(..., labels=...).loss; loss.backward(); opt.step()` under
the same autocast. Ours adds the token-mean loss over the effective batch, gradient clipping,
the schedule and bookkeeping. Reported: tokens/s (real, non-padding tokens) of each loop at
fp32 and bf16, medians over alternating warmed-up repeats, and our overhead in percent.

    .venv/bin/python bench/bench_finetune.py --model assay-tiny --examples 256 --repeats 3
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

from assay.core.config import DataConfig, ModelConfig
from assay.core.precision import PrecisionPolicy
from assay.lm.data import collate, load_examples
from assay.lm.models import load_model, load_tokenizer
from assay.training.finetune import optimizer_update, train_step

sys.path.insert(0, str(Path(__file__).parent))
from machine import header, machine  # noqa: E402


def plain_epoch(model, examples, steps, policy, pad_id, opt) -> int:
    tokens = 0
    for positions in steps:
        batch = collate(examples, positions, pad_id, policy.device)
        with policy.autocast():
            loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        tokens += int(batch["attention_mask"].sum())
    return tokens


def our_epoch(model, examples, steps, policy, pad_id, opt) -> int:
    tokens = 0
    for positions in steps:
        _, _, real = train_step(model, examples, positions, len(positions), policy, pad_id, None)
        optimizer_update(model, opt, None, 1.0, 1e-4)
        tokens += real
    return tokens


def measure(fn, model, examples, steps, policy, pad_id) -> float:
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, foreach=False)
    start = time.perf_counter()
    tokens = fn(model, examples, steps, policy, pad_id, opt)
    return tokens / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="assay-tiny")
    ap.add_argument("--examples", type=int, default=256)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--max_length", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--precisions", default="fp32,bf16")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args()
    print(header(), flush=True)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    mcfg = ModelConfig(model=args.model)
    tok = load_tokenizer(mcfg)
    _, examples = load_examples(
        DataConfig(dataset="abc-tunes", max_samples=args.examples, max_length=args.max_length), tok
    )
    rng = np.random.default_rng(0)
    order = rng.permutation(len(examples))
    steps = [order[i : i + args.batch] for i in range(0, len(order), args.batch)]
    results = {}
    for precision in args.precisions.split(","):
        policy = PrecisionPolicy.resolve(precision)
        model = load_model(mcfg, policy).train()
        for fn in (plain_epoch, our_epoch):  # warm-up: kernel set-up per shape
            measure(fn, model, examples, steps[:4], policy, tok.pad_token_id)
        runs: dict[str, list[float]] = {"plain": [], "assay": []}
        for _ in range(args.repeats):
            runs["plain"].append(measure(plain_epoch, model, examples, steps, policy, tok.pad_token_id))
            runs["assay"].append(measure(our_epoch, model, examples, steps, policy, tok.pad_token_id))
        med = {k: statistics.median(v) for k, v in runs.items()}
        results[precision] = {
            "plain_tokens_per_s": med["plain"],
            "assay_tokens_per_s": med["assay"],
            "overhead_pct": 100 * (med["plain"] / med["assay"] - 1),
        }
        print(f"{precision}: plain {med['plain']:,.0f} tok/s, assay {med['assay']:,.0f} tok/s "
              f"(overhead {results[precision]['overhead_pct']:+.1f}%)")  # fmt: skip
    if "fp32" in results and "bf16" in results:
        ratio = results["bf16"]["assay_tokens_per_s"] / results["fp32"]["assay_tokens_per_s"]
        print(f"bf16 / fp32 (assay loop): {ratio:.2f}x")
    info = machine()
    print(json.dumps({"machine": info, "args": vars(args), "results": results, "threads": info["threads"]}))


if __name__ == "__main__":
    main()
