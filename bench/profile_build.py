"""Where `assay build`'s collection loop spends its time next to the plain forward+backward floor:
torch.profiler over the same batches, operators grouped into a few kinds, shares of each pass.

    .venv/bin/python bench/profile_build.py --model assay-tiny --tokens 8000 --precision fp32 \
        --floors sdpa sdpa-causal --out profile.json

Shares (not absolute times) are what this is for: on a shared machine the split between kinds of
work stays meaningful when the wall time does not. The collector's hooks are wrapped in
record_function spans here (the collector itself is not changed), so "collector hooks" is the
whole time inside them, children included; the kinds below count operators' own (self) time.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections import Counter
from collections.abc import Callable
from functools import wraps
from pathlib import Path
from typing import Any

from torch.profiler import ProfilerActivity, profile, record_function

from assay.attribution.build import GradientSetup
from assay.attribution.collector import GradientCollector, linear_modules
from assay.attribution.projection import Projector
from assay.core.config import DataConfig, ModelConfig
from assay.core.memory import return_freed_memory
from assay.core.precision import PrecisionPolicy
from assay.lm.data import load_examples, token_batches
from assay.lm.lean import keep_compute_casts
from assay.lm.models import load_model, load_tokenizer

sys.path.insert(0, str(Path(__file__).parent))
from bench_build import collect_pass, pick_tunes  # noqa: E402
from floors import FLOORS, floor_batches, floor_pass, load_floor_models  # noqa: E402
from machine import header, machine  # noqa: E402

# operator name fragments -> kind, first match wins
KINDS = (
    ("attention", ("scaled_dot_product", "flash_attention", "_efficient_attention", "softmax")),
    ("GEMM", ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_mm", "aten::matmul")),
    ("copy / cast", ("copy_", "_to_copy", "clone", "contiguous", "aten::cat", "aten::stack")),
    ("allocation / fill", ("empty", "zeros", "fill_", "zero_", "aten::full", "ones")),
    (
        "indexing / masks",
        ("index", "gather", "scatter", "where", "masked", "aten::eq", "aten::ne", "aten::lt"),
    ),
    ("reductions", ("aten::sum", "aten::mean", "aten::amax", "aten::max", "logsumexp", "aten::norm")),
)
HOOK_SPANS = ("collector.forward_hook", "collector.backward_hook", "collector.flush")


def kind_of(name: str) -> str:
    for kind, fragments in KINDS:
        if any(f in name for f in fragments):
            return kind
    if name.startswith(("autograd::", "torch::autograd", "AccumulateGrad")) or "Backward" in name:
        return "autograd glue"
    return "elementwise / other"


def annotate_collector() -> None:
    """Wrap the collector's hooks in record_function spans (this process only)."""

    def spanned(fn: Callable[..., Any], label: str) -> Callable[..., Any]:
        @wraps(fn)
        def inner(*args: Any, **kwargs: Any) -> Any:
            with record_function(label):
                return fn(*args, **kwargs)

        return inner

    for attr, label in zip(("_forward_hook", "_backward_hook", "_flush"), HOOK_SPANS):
        setattr(GradientCollector, attr, spanned(getattr(GradientCollector, attr), label))


def summarize(prof: Any, wall_s: float) -> dict[str, Any]:
    """Self CPU time per kind (s and share of the wall time), op counts, hook spans."""
    kinds: Counter[str] = Counter()
    counts: Counter[str] = Counter()
    spans: dict[str, float] = {}
    top = []
    for evt in prof.key_averages():
        if evt.key in HOOK_SPANS:
            spans[evt.key] = evt.cpu_time_total / 1e6
            continue
        if evt.key.startswith("ProfilerStep") or evt.key in ("pass",):
            continue
        kinds[kind_of(evt.key)] += evt.self_cpu_time_total / 1e6
        counts[kind_of(evt.key)] += evt.count
        top.append((evt.self_cpu_time_total / 1e6, evt.key, evt.count))
    accounted = sum(kinds.values())
    kinds["outside operators (Python, hooks' own code, waiting)"] = max(wall_s - accounted, 0.0)
    top.sort(reverse=True)
    return {
        "wall_s": wall_s,
        "kinds_s": dict(kinds),
        "shares": {k: v / wall_s for k, v in kinds.items()},
        "op_counts": dict(counts),
        "ops_total": sum(counts.values()),
        "hook_spans_s": spans,
        "top_ops": [{"op": k, "self_s": s, "count": c} for s, k, c in top[:15]],
    }


def by_shape(prof: Any, n: int) -> list[dict[str, Any]]:
    """The `n` operators with the most self time, each (name, input shapes) apart."""
    events = sorted(prof.key_averages(group_by_input_shape=True), key=lambda e: -e.self_cpu_time_total)
    events = [e for e in events if e.key not in HOOK_SPANS and e.key != "pass"]
    return [
        {"op": e.key, "shapes": str(e.input_shapes), "self_s": e.self_cpu_time_total / 1e6, "count": e.count}
        for e in events[:n]
    ]


def profiled(run: Callable[[], Any], shapes: int = 0) -> dict[str, Any]:
    import time

    run()  # warm-up: every shape once
    with profile(activities=[ProfilerActivity.CPU], record_shapes=shapes > 0) as prof:
        t = time.perf_counter()
        with record_function("pass"):
            run()
        wall = time.perf_counter() - t
    result = summarize(prof, wall)
    if shapes:
        result["top_ops_by_shape"] = by_shape(prof, shapes)
    return result


def print_table(results: dict[str, dict[str, Any]]) -> None:
    names = list(results)
    kinds = sorted(
        {k for r in results.values() for k in r["shares"]},
        key=lambda k: -results[names[-1]]["shares"].get(k, 0),
    )
    print(f"{'share of wall time':<56}" + "".join(f"{n:>16}" for n in names))
    for k in kinds:
        print(f"{k:<56}" + "".join(f"{results[n]['shares'].get(k, 0):>16.1%}" for n in names))
    print(f"{'operators run':<56}" + "".join(f"{results[n]['ops_total']:>16,}" for n in names))
    base = results[names[0]]["wall_s"]
    print(
        f"{'wall time vs ' + names[0]:<56}" + "".join(f"{results[n]['wall_s'] / base:>15.2f}x" for n in names)
    )
    for n, r in results.items():
        if r["hook_spans_s"]:
            spans = ", ".join(
                f"{k.split('.')[1]} {v / r['wall_s']:.1%}" for k, v in r["hook_spans_s"].items()
            )
            print(f"{n}: time inside the collector's hooks (children included): {spans}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="assay-tiny")
    ap.add_argument("--tokens", type=int, default=8000)
    ap.add_argument("--max_length", type=int, default=512)
    ap.add_argument("--precision", default="fp32")
    ap.add_argument("--token_batch_size", type=int, default=2048)
    ap.add_argument("--p", type=int, default=16)
    ap.add_argument("--floors", nargs="+", default=["sdpa", "sdpa-causal"], choices=list(FLOORS))
    ap.add_argument(
        "--shapes", type=int, default=0, help="also list the loop's N costliest operators by input shape"
    )
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    return_freed_memory()  # as the `assay` command does
    info = machine()
    print(header(info), flush=True)
    policy = PrecisionPolicy.resolve(args.precision, "cpu")
    tokenizer = load_tokenizer(ModelConfig(model=args.model))
    with tempfile.TemporaryDirectory() as tmp:
        data, _ = pick_tunes(tokenizer, args.tokens, args.max_length, Path(tmp))
        _, examples = load_examples(DataConfig(dataset=str(data)), tokenizer)
    positions = token_batches(examples, args.token_batch_size)
    results: dict[str, dict[str, Any]] = {}
    models = load_floor_models(args.model, args.floors, policy)
    for name in args.floors:
        batches = floor_batches(FLOORS[name], examples, positions, tokenizer.pad_token_id, policy.device)
        model = models[FLOORS[name].attention]
        results[f"floor {name}"] = profiled(lambda: floor_pass(model, batches, policy))  # noqa: B023
    collected = load_model(ModelConfig(model=args.model), policy)
    keep_compute_casts(collected, policy)
    pad = tokenizer.pad_token_id
    setup = GradientSetup(
        collected, tokenizer, policy, linear_modules(collected), Projector(args.p), None, pad
    )
    annotate_collector()
    loop = profiled(lambda: collect_pass(setup, examples, positions), args.shapes)
    results["assay build loop"] = loop
    print_table(results)
    for op in loop.get("top_ops_by_shape", []):
        print(f"{op['op']:<24} {op['count']:>6} {op['self_s'] * 1e3:>9.1f} ms  {op['shapes'][:100]}")
    if args.out:
        record = {"machine": info, "args": vars(args), "results": results}
        Path(args.out).write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
