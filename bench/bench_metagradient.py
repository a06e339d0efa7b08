"""Metagradients through a fine-tune (`assay.counterfactual.metagradient`): time and memory vs training.

assay-tiny fine-tuned on real ABC tunes with assay's own loop (`train_step` + `optimizer_update`:
AdamW, warm-up + cosine, clipping at 1.0), then the same run replayed and differentiated for a
batch of held-out query tunes. Each phase runs in a fresh process, so its peak resident memory
(ru_maxrss) is its own; "working" memory is that peak minus the resident memory once the model and
data are loaded. Each phase runs its work twice and reports the second (the first sets CPU
kernels up per tensor shape). Reported:

- training: the fine-tune's time and memory (the reference);
- replay: the functional forward replay (with checkpoints), which must equal training's time;
- reverse, Q = 1 (the aggregate of the queries) and Q = --queries (one metagradient per query,
  one shared reverse pass): time relative to training, peak memory relative to training, and
  where the reverse pass's time goes (segment recomputation, adjoint arithmetic, double backward);
- precision: the aggregate scores of a bf16-autocast replay against fp32's (Spearman, relative
  L2 distance), at Adam's eps of the run.

    .venv/bin/python bench/bench_metagradient.py --examples 64 --batch 16 --micro 8 --queries 4 --threads 1

Goal (issue #19): reverse pass <= 4x the training run's time per query batch, <= 2x its memory.
Timings on a shared machine are provisional.
"""

from __future__ import annotations

import argparse
import copy
import json
import resource
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from assay.core.config import DataConfig, ModelConfig
from assay.core.memory import return_freed_memory
from assay.core.precision import PrecisionPolicy
from assay.counterfactual import metagradient as mg
from assay.counterfactual.replay import AdamWSettings, Replay, TrainingRun, balanced_interval, finetune_order
from assay.lm.data import load_examples
from assay.lm.models import load_model, load_tokenizer
from assay.training.finetune import optimizer_update, train_step
from assay.training.schedule import lr_factor, warmup_steps_for

sys.path.insert(0, str(Path(__file__).parent))
from machine import header, machine  # noqa: E402


def rss_mib() -> float:
    """Resident memory now."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class Setup:
    """Model, data, the run's steps and hyperparameters, as `assay finetune` would make them."""

    def __init__(self, args: argparse.Namespace, precision: str):
        self.policy = PrecisionPolicy.resolve(precision)
        mcfg = ModelConfig(model="assay-tiny")
        tok = load_tokenizer(mcfg)
        self.pad = tok.pad_token_id
        data = DataConfig(dataset="abc-tunes", max_samples=args.examples, max_length=args.max_length)
        _, self.train = load_examples(data, tok)
        queries = DataConfig(
            dataset="abc-tunes", split="eval", max_samples=args.queries, max_length=args.max_length
        )
        _, self.queries = load_examples(queries, tok)
        self.model = load_model(mcfg, self.policy).train()
        rng = np.random.default_rng(0)
        plan = [rng.permutation(len(self.train)) for _ in range(args.epochs)]
        self.steps = [
            finetune_order(self.train.lengths, e[i : i + args.batch])
            for e in plan
            for i in range(0, len(e), args.batch)
        ]
        total = len(self.steps)
        warmup = warmup_steps_for(total, 0.1, 0)
        lrs = tuple(args.lr * lr_factor(t, total, warmup, "cosine") for t in range(total))
        self.opt = AdamWSettings(lrs, (0.9, 0.999), args.adam_eps, weight_decay=0.0, max_grad_norm=1.0)
        self.micro = args.micro

    def run(self, args: argparse.Namespace) -> TrainingRun:
        loss_fn, curvature = mg.lm_loss_fns(self.train, self.pad, self.policy.device)
        return TrainingRun(
            self.steps,
            self.train.num_loss_tokens(),
            loss_fn,
            self.opt,
            self.micro,
            policy=self.policy,
            curvature_loss_fn=curvature,
            curvature_micro_batch_size=args.hvp_micro,
        )

    def query_fn(self) -> mg.LossFn:
        return mg.lm_loss_fns(self.queries, self.pad, self.policy.device)[1]


def train_once(setup: Setup) -> float:
    """assay finetune's loop over the run's steps, from a fresh copy of the model; seconds."""
    model = copy.deepcopy(setup.model)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, betas=setup.opt.betas, weight_decay=0.0, foreach=False)
    start = time.perf_counter()
    for t, positions in enumerate(setup.steps):
        train_step(model, setup.train, positions, setup.micro, setup.policy, setup.pad, None)
        optimizer_update(model, opt, None, setup.opt.max_grad_norm, setup.opt.lrs[t])
    return time.perf_counter() - start


def timed(fn: Callable[..., Any], bucket: dict[str, float], key: str) -> Callable[..., Any]:
    def wrapper(*a: Any, **k: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            bucket[key] += time.perf_counter() - start

    return wrapper


def reverse_once(setup: Setup, args: argparse.Namespace, q: int) -> dict[str, Any]:
    """Forward replay + one reverse pass for q queries (q = 1: their aggregate); seconds and breakdown."""
    folder = tempfile.TemporaryDirectory() if args.offload else None
    offload = Path(folder.name) if folder else None
    k = balanced_interval(len(setup.steps)) if args.checkpoint_every < 0 else args.checkpoint_every
    replay = Replay(copy.deepcopy(setup.model), setup.run(args), k, offload)
    start = time.perf_counter()
    replay.forward()
    forward_s = time.perf_counter() - start
    groups = [np.array([i]) for i in range(len(setup.queries))]
    grads = mg.objective_gradients(replay.model, setup.query_fn(), groups, setup.policy)
    grads = [mg.summed(grads)] if q == 1 else grads[:q]
    parts: dict[str, float] = defaultdict(float)
    saved = (Replay.segment, mg.curvature_products, mg.gradient_adjoint)
    Replay.segment = timed(Replay.segment, parts, "recompute")  # type: ignore[method-assign]
    mg.curvature_products = timed(mg.curvature_products, parts, "double_backward")
    mg.gradient_adjoint = timed(mg.gradient_adjoint, parts, "adjoint_arithmetic")
    try:
        start = time.perf_counter()
        scores = -mg.metagradients(replay, grads)
        reverse_s = time.perf_counter() - start
    finally:
        Replay.segment, mg.curvature_products, mg.gradient_adjoint = saved  # type: ignore[method-assign]
        if folder is not None:
            folder.cleanup()
    return {"forward_s": forward_s, "reverse_s": reverse_s, "parts": dict(parts), "scores": scores.numpy(),
            "checkpoint_every": k}  # fmt: skip


def phase(args: argparse.Namespace) -> dict[str, Any]:
    """One measurement in this process: 'train', 'reverse1', 'reverseQ' or 'precision'."""
    return_freed_memory()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    setup = Setup(args, args.precision)
    base = rss_mib()
    out: dict[str, Any] = {"phase": args.phase, "base_mib": base, "steps": len(setup.steps)}
    out["tokens"] = int(sum(setup.train.lengths[s].sum() for s in setup.steps))
    if args.phase == "train":
        train_once(setup)
        out["seconds"] = train_once(setup)
    elif args.phase in ("reverse1", "reverseQ"):
        q = 1 if args.phase == "reverse1" else args.queries
        reverse_once(setup, args, q)
        result = reverse_once(setup, args, q)
        out |= {k: v for k, v in result.items() if k != "scores"}
    else:
        out |= precision_gap(setup, args)
    out["peak_mib"] = peak_mib()
    return out


def precision_gap(setup: Setup, args: argparse.Namespace) -> dict[str, Any]:
    """Aggregate scores of fp32 and bf16-autocast replays of the same run; how far apart."""
    scores = {}
    for name in ("fp32", "bf16"):
        setup.policy = PrecisionPolicy.resolve(name)
        scores[name] = reverse_once(setup, args, 1)["scores"][0]
    a, b = scores["fp32"], scores["bf16"]
    ranks = lambda x: np.argsort(np.argsort(x))  # noqa: E731
    return {
        "spearman": float(np.corrcoef(ranks(a), ranks(b))[0, 1]),
        "rel_l2": float(np.linalg.norm(a - b) / np.linalg.norm(a)),
        "top10_overlap": len(set(np.argsort(-a)[:10]) & set(np.argsort(-b)[:10])),
    }


def child(args: argparse.Namespace, name: str) -> dict[str, Any]:
    argv = [sys.executable, __file__, "--phase", name] + [
        f"--{k}={v}" for k, v in vars(args).items() if k not in ("phase", "phases")
    ]
    done = subprocess.run(argv, check=True, capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def report(args: argparse.Namespace) -> None:
    print(header(), flush=True)
    print("figures are provisional: a shared machine's timings vary from run to run")
    res = {name: child(args, name) for name in args.phases.split(",")}
    train = res.get("train")
    if train:
        working = train["peak_mib"] - train["base_mib"]
        print(f"training: {train['steps']} steps, {train['tokens']:,} tokens, {train['seconds']:.2f} s, "
              f"peak {train['peak_mib']:.0f} MiB (working {working:.0f} MiB)")  # fmt: skip
    for name in ("reverse1", "reverseQ"):
        r = res.get(name)
        if not r or not train:
            continue
        q = 1 if name == "reverse1" else args.queries
        work, train_work = r["peak_mib"] - r["base_mib"], train["peak_mib"] - train["base_mib"]
        parts = ", ".join(f"{k} {v:.2f} s" for k, v in sorted(r["parts"].items()))
        label = f"Q={q}{' (aggregate)' if q == 1 else ''}, k={r['checkpoint_every']}"
        print(f"{label}: forward replay {r['forward_s']:.2f} s "
              f"({r['forward_s'] / train['seconds']:.2f}x training); reverse {r['reverse_s']:.2f} s "
              f"({r['reverse_s'] / train['seconds']:.2f}x training, "
              f"{r['reverse_s'] / r['forward_s']:.2f}x the forward replay in this process; {parts}); "
              f"peak {r['peak_mib']:.0f} MiB = "
              f"{r['peak_mib'] / train['peak_mib']:.2f}x training's (working {work:.0f} MiB = "
              f"{work / max(train_work, 1):.2f}x)")  # fmt: skip
    if "precision" in res:
        p = res["precision"]
        print(f"bf16 vs fp32 aggregate scores (eps {args.adam_eps:g}): Spearman {p['spearman']:.3f}, "
              f"relative L2 {p['rel_l2']:.3f}, top-10 overlap {p['top10_overlap']}/10")  # fmt: skip
    print(json.dumps({"cpu": machine()["cpu"], "machine": machine(), "args": vars(args), "results": res}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--examples", type=int, default=64, help="training tunes")
    ap.add_argument("--batch", type=int, default=16, help="effective batch (examples per step)")
    ap.add_argument("--micro", type=int, default=8, help="micro-batch of the training run")
    ap.add_argument(
        "--hvp_micro", type=int, default=2, help="micro-batch of the double backward (0: --micro)"
    )
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--queries", type=int, default=8, help="held-out query tunes (Q of the per-query pass)")
    ap.add_argument("--max_length", type=int, default=256)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--adam_eps", type=float, default=1e-8)
    ap.add_argument(
        "--checkpoint_every", type=int, default=-1, help="k (-1: ⌈√T⌉, assay's default; 0: only the start)"
    )
    ap.add_argument("--offload", type=int, default=0, help="1: checkpoints in files, not memory")
    ap.add_argument("--precision", default="fp32")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--phases", default="train,reverse1,reverseQ,precision")
    ap.add_argument("--phase", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.phase:
        print(json.dumps(phase(args), default=float))
    else:
        report(args)


if __name__ == "__main__":
    main()
