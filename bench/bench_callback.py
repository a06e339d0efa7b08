"""Benchmark `assay.integrations.GradientCallback`: the same Trainer run with and without it.

The callback collects at every step but the first (the first has no Adam second moments yet), so
each of those steps pays the whole price: the model copy at the step's start, the hooks during its
forwards and backwards, the index written before the optimizer step. Each part is timed apart
(medians over the steps, after a warm-up step), next to the same steps of a run without it:

    forward+backward   the step's micro-batches, hooks included (the issue's goal: <= 15% more)
    copy               saving the model and tokenizer into the index (a collection's fixed cost)
    write              the rows, checksums and texts of the index

    .venv/bin/python bench/bench_callback.py --model smollm2-135m --steps 8 --batch_size 8 --seq_len 256
    .venv/bin/python bench/bench_callback.py --steps 4 --batch_size 2 --seq_len 32   # assay-tiny: a smoke run
    .venv/bin/python bench/bench_callback.py --model smollm2-135m --steps 10 --batch_size 8 --seq_len 256 \
        --repeats 1 --normalizers adafactor none --alternate

Runs alternate (without, then with the callback once per `--normalizers` entry) `--repeats` times;
the texts are random words, every token a target. Runs seconds apart can differ by more than the
hooks cost (a shared or throttled machine), so `--alternate` adds, per normalizer, a run collecting
at every other step and sets each collected step against the uncollected one after it.
The normalizer decides the hooks' cost: `adam`
divides each example's full [out, in] gradient by sqrt(v) before projecting it, so the hooks form
every per-example weight gradient (a second weight-gradient GEMM per layer, as bergson's Adam
normalizer does too); `adafactor` (the default: the optimizer's Adam moments factored into row and
column means, bergson's `to_adafactor`) and `none` only project the inputs and output gradients.
How far each normalizer's rows are from exact Adam's: the per-example cosine of the last collected
step's rows with the `adam` run's (same weights and examples: the runs are deterministic).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import Trainer, TrainerCallback, TrainingArguments

import assay
from assay.core.config import ModelConfig
from assay.core.precision import PrecisionPolicy
from assay.integrations import GradientCallback, LiveConfig
from assay.lm.models import load_model, load_tokenizer

sys.path.insert(0, str(Path(__file__).parent))
from bench_build import cosines  # noqa: E402  (bench/ is not a package)
from machine import header, machine  # noqa: E402


class Clock(TrainerCallback):
    """Times the events it sees: placed before and after the GradientCallback, two of them split
    each step into copy, forward+backward and write."""

    def __init__(self) -> None:
        self.marks: dict[str, list[float]] = {}

    def _mark(self, name: str) -> None:
        self.marks.setdefault(name, []).append(time.perf_counter())

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._mark("begin")

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._mark("pre_optimizer")


def dataset(tokenizer: Any, count: int, seq_len: int) -> list[dict[str, list[int]]]:
    words = "the king queen folk tune jig reel air of to and a in my love".split()
    rng = np.random.default_rng(0)
    rows = []
    for _ in range(count):
        ids = tokenizer(" ".join(rng.choice(words, seq_len)))["input_ids"][:seq_len]
        rows.append({"input_ids": ids})
    return rows


def collate(rows: list[dict[str, list[int]]]) -> dict[str, torch.Tensor]:
    width = max(len(r["input_ids"]) for r in rows)
    ids = torch.zeros((len(rows), width), dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r["input_ids"])] = torch.tensor(r["input_ids"])
        mask[i, : len(r["input_ids"])] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def one_run(
    opts: argparse.Namespace, tokenizer: Any, normalizer: str | None, root: Path, collect: range | None = None
) -> tuple[dict[str, list[float]], np.ndarray | None]:
    """Seconds of each part at each timed step (steps 2.. of the run: step 1 warms up), and the rows
    of the last step collected (None without the callback). `collect`: the steps the callback
    collects at (default: every step after the first)."""
    model = load_model(ModelConfig(model=opts.model), PrecisionPolicy.resolve("fp32", opts.device)).train()
    args = TrainingArguments(
        output_dir=str(root / "trainer"), per_device_train_batch_size=opts.batch_size, max_steps=opts.steps,
        learning_rate=1e-4, report_to=[], use_cpu=opts.device == "cpu", seed=0, save_strategy="no",
        logging_steps=10**6, disable_tqdm=True,
    )  # fmt: skip
    before, after = Clock(), Clock()
    callbacks: list[Any] = [before]
    if normalizer is not None:
        config = LiveConfig(projection_dim=opts.projection_dim, normalizer=normalizer, overwrite=True)  # type: ignore[arg-type]
        collect = collect or range(1, opts.steps)
        callbacks.append(GradientCallback(root / "grads", steps=collect, config=config))
    callbacks.append(after)
    data = dataset(tokenizer, opts.batch_size * opts.steps, opts.seq_len)
    Trainer(
        model=model, args=args, train_dataset=data, data_collator=collate, processing_class=tokenizer,
        callbacks=callbacks,
    ).train()  # fmt: skip
    steps = range(2, opts.steps)  # step 0 differs (no optimizer state), step 1 warms up
    begin, started = before.marks["begin"], after.marks["begin"]
    backward, written = before.marks["pre_optimizer"], after.marks["pre_optimizer"]
    rows = None
    if normalizer is not None and collect is not None:
        rows = np.asarray(assay.open_index(root / "grads" / f"step-{collect[-1]}").gradients, np.float32)
    return {
        "copy": [started[s] - begin[s] for s in steps],
        "forward+backward": [backward[s] - started[s] for s in steps],
        "write": [written[s] - backward[s] for s in steps],
    }, rows


def alternating_overhead(opts: argparse.Namespace, tokenizer: Any, normalizer: str, root: Path) -> float:
    """The hooks' cost measured inside one run: the callback collects at steps 2, 4, ... and each
    collected step's forward+backward is set against the uncollected step after it (same shapes,
    same process, seconds apart), so a machine whose speed drifts between runs cancels out;
    median over the pairs."""
    parts, _ = one_run(opts, tokenizer, normalizer, root, collect=range(2, opts.steps, 2))
    times = parts["forward+backward"]  # steps 2, 3, 4, ...: collected at even indices
    return statistics.median(times[i] / times[i + 1] for i in range(0, len(times) - 1, 2)) - 1


def agreement(rows: np.ndarray, exact: np.ndarray) -> dict[str, float]:
    """Per-example cosine of a normalizer's rows with the exact Adam normalizer's (same examples,
    same weights: the runs are deterministic): min and median."""
    cos = cosines(rows, exact)
    return {"min": float(cos.min()), "median": float(np.median(cos))}


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", default="assay-tiny", help="a model name or folder (default: the bundled one)"
    )
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--batch_size", type=int, default=4)
    parser.add_argument("--seq_len", type=int, default=128)
    parser.add_argument("--projection_dim", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--normalizers",
        nargs="+",
        default=["adam", "adafactor", "none"],
        choices=["adam", "adafactor", "none"],
        help="the callback's normalizer in each run with it (module docstring)",
    )
    parser.add_argument(
        "--alternate",
        action="store_true",
        help="also, per normalizer, one run collecting at every other step: the hooks' cost as collected "
        "against uncollected steps of that run (immune to the machine's speed drifting between runs)",
    )
    parser.add_argument("--out", type=Path, help="also write the result here (JSON)")
    return parser


def main() -> None:
    args = parser()
    opts = args.parse_args()
    if opts.steps < 4:
        args.error(
            "--steps must be at least 4 (a first step without optimizer state, a warm-up, then timed steps)"
        )
    tokenizer = load_tokenizer(ModelConfig(model=opts.model))
    print(header(), flush=True)
    variants: dict[str, str | None] = {"without": None} | {f"with-{n}": n for n in opts.normalizers}
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in variants}
    rows: dict[str, np.ndarray | None] = {}
    for _ in range(opts.repeats):
        for name, normalizer in variants.items():
            with tempfile.TemporaryDirectory() as tmp:
                parts, rows[name] = one_run(opts, tokenizer, normalizer, Path(tmp))
                runs[name].append({k: statistics.median(v) for k, v in parts.items()})
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(opts).items()}
    result: dict[str, Any] = {"settings": settings, "machine": machine()}
    for name, parts in runs.items():
        result[name] = {k: statistics.median(p[k] for p in parts) for k in parts[0]}
    if opts.alternate:
        for normalizer in opts.normalizers:
            with tempfile.TemporaryDirectory() as tmp:
                overhead = alternating_overhead(opts, tokenizer, normalizer, Path(tmp))
            result[f"with-{normalizer}:hook_overhead_alternating"] = overhead
    base = result["without"]
    for name in list(variants)[1:]:
        result[f"{name}:hook_overhead"] = result[name]["forward+backward"] / base["forward+backward"] - 1
        result[f"{name}:collection_overhead"] = sum(result[name].values()) / sum(base.values()) - 1
        exact, own = rows.get("with-adam"), rows[name]
        if exact is not None and own is not None and name != "with-adam":
            result[f"{name}:cosine_with_adam_rows"] = agreement(own, exact)
    text = json.dumps(result, indent=2)
    print(text)
    if opts.out:
        opts.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
