"""What a process keeps for two kinds of per-shape work (the figures of docs/BENCHMARKS.md's
"A kernel per row count" and "Scatters that kept what they did not need"):

    .venv/bin/python bench/bench_kernel_cache.py counts --counts 300
    .venv/bin/python bench/bench_kernel_cache.py saved --model bench-out/moe-8x --dataset TUNES

`counts`: a bf16 CPU product [n, K] x [K, N] over `--counts` distinct row counts n, against one
count repeated as often, and over the same counts rounded by `assay.lm.shapes.kernel_rows`: the
anonymous resident memory each leaves behind (oneDNN's kept kernels) and its time.
`saved`: the bytes autograd keeps for backward over the first token batch of `assay build`'s
collection (distinct storages, parameters included), and the lines of assay or transformers
that saved the most.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
import traceback
from collections import Counter
from pathlib import Path

import torch

from assay.attribution.build import GradientSetup, iter_gradients
from assay.attribution.collector import linear_modules
from assay.attribution.projection import Projector
from assay.core.config import DataConfig, ModelConfig
from assay.core.memory import small_matmul_cache
from assay.core.precision import PrecisionPolicy
from assay.lm.data import load_examples, token_batches
from assay.lm.lean import keep_compute_casts
from assay.lm.models import load_model, load_tokenizer
from assay.lm.shapes import kernel_rows

sys.path.insert(0, str(Path(__file__).parent))
from machine import header  # noqa: E402


def anonymous_mb() -> float:
    with open("/proc/self/status") as f:
        return int(re.search(r"RssAnon:\s+(\d+)", f.read()).group(1)) / 1024  # type: ignore[union-attr]


def products(counts: list[int], k: int, n: int) -> tuple[float, float]:
    """(MB of anonymous memory added, seconds) for one bf16 product per row count."""
    weight = torch.randn(n, k, dtype=torch.bfloat16)
    before, start = anonymous_mb(), time.perf_counter()
    for rows in counts:
        torch.nn.functional.linear(torch.randn(rows, k, dtype=torch.bfloat16), weight)
    return anonymous_mb() - before, time.perf_counter() - start


def counts_command(args: argparse.Namespace) -> None:
    small_matmul_cache()  # as the `assay` commands run: ideep's own per-shape cache at one entry
    distinct = list(range(args.first, args.first + args.counts))
    cpu = torch.device("cpu")
    runs = {
        "one count repeated": [args.first + args.counts] * args.counts,
        "distinct counts": distinct,
        "distinct counts, kernel_rows": [kernel_rows(c, torch.bfloat16, cpu) for c in distinct],
    }
    print(f"[n, {args.k}] x [{args.k}, {args.n}] bf16, {args.counts} products each")
    for name, counts in runs.items():  # the repeated count first: nothing compiled before it
        mb, seconds = products(counts, args.k, args.n)
        print(f"{name}: {len(set(counts))} shapes, +{mb:.1f} MB anonymous, {seconds:.3f} s", flush=True)


def saved_command(args: argparse.Namespace) -> None:
    policy = PrecisionPolicy.resolve(args.precision, "cpu")
    tokenizer = load_tokenizer(ModelConfig(model=args.model))
    _, examples = load_examples(DataConfig(dataset=args.dataset), tokenizer)
    batch = token_batches(examples, args.token_batch_size)[:1]
    model = load_model(ModelConfig(model=args.model), policy)
    modules = linear_modules(model)
    keep_compute_casts(model, policy)
    setup = GradientSetup(model, tokenizer, policy, modules, Projector(16), None, tokenizer.pad_token_id)
    sizes: dict[int, int] = {}
    sources: Counter[str] = Counter()

    def keep(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in sizes:
            sizes[storage.data_ptr()] = storage.nbytes()
            frames = [
                f
                for f in traceback.extract_stack()
                if "/assay/" in f.filename or "transformers" in f.filename
            ]
            where = f"{Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else "?"
            sources[f"{where} [..., {t.shape[-1] if t.dim() else ''}]"] += storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        for _ in iter_gradients(setup, examples, batch):
            pass
    tokens = int(examples.lengths[batch[0]].sum())
    total = sum(sizes.values()) / 2**20
    print(f"{args.model}, {args.precision}, one batch of {tokens:,} tokens: {total:.1f} MB saved")
    for where, nbytes in sources.most_common(args.top):
        print(f"  {nbytes / 2**20:6.1f} MB  {where}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    counts = sub.add_parser("counts", help="oneDNN's kept kernels per row count")
    counts.add_argument("--counts", type=int, default=300, help="distinct row counts")
    counts.add_argument("--first", type=int, default=200, help="the smallest row count")
    counts.add_argument("--k", type=int, default=128, help="inner dimension")
    counts.add_argument("--n", type=int, default=1024, help="output columns")
    saved = sub.add_parser("saved", help="what one collection batch keeps for backward")
    saved.add_argument("--model", required=True)
    saved.add_argument("--dataset", required=True, help="JSON-lines texts (the bench's tunes.jsonl)")
    saved.add_argument("--precision", default="fp32")
    saved.add_argument("--token_batch_size", type=int, default=2048)
    saved.add_argument("--top", type=int, default=12, help="how many saving lines to list")
    args = ap.parse_args()
    print(header(), flush=True)
    counts_command(args) if args.command == "counts" else saved_command(args)


if __name__ == "__main__":
    main()
