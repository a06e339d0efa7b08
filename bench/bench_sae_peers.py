"""SAELens and sparsify on the same cached activations and batches as bench_sae.py.

Runs under the peers' environment (make test-interop builds it):
  .venv-peers/bin/python bench/bench_sae_peers.py --acts CACHE --expansion 16

SAELens 6: its own SAETrainer (Adam, grad clipping, autocast switch) with a TopKTrainingSAE
fed our batches through its DataProvider interface, with its recommended TopK settings
(rescale_acts_by_decoder_norm, AuxK); with --architecture batchtopk or matryoshka, its
BatchTopK or Matryoshka BatchTopK SAE (widths d_sae / 16, / 8, / 4, / 2, d_sae, assay's
default), evaluated as the JumpReLU it saves for inference (as assay's are).
sparsify 1.3: its CLI needs CUDA, so its trainer's step is reproduced around its SparseCoder
(b_dec at the first batch's mean, unit-norm decoder, parallel-gradient removal, fvu +
auxk_alpha * auxk loss) with its default signum optimiser (ScheduleFree SignSGD) or Adam.
Same lr for SAELens and Adam runs as ours.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_sae_common import (  # noqa: E402
    DEAD_WINDOW_STEPS,
    Timer,
    batches,
    firing_trace,
    load_split,
    quality,
    record,
    saelens_topk_kind,
    scale_of,
)


def default_lr(d_sae: int) -> float:
    """assay's TopK default (assay.sae.train.default_learning_rate), so Adam runs share the lr."""
    return 3.2e-3 / math.sqrt(d_sae / 2**14)


def inference_sae(sae: Any) -> Any:
    """The SAE SAELens saves for inference (BatchTopK kinds: a JumpReLU at the learned
    threshold), loaded back."""
    from sae_lens import SAE

    with tempfile.TemporaryDirectory() as folder:
        sae.save_inference_model(folder)
        return SAE.load_from_disk(folder, device="cpu")


def run_saelens(data: list, held: torch.Tensor, d_sae: int, args: argparse.Namespace, autocast: bool) -> dict:
    from sae_lens.config import SAETrainerConfig
    from sae_lens.training.sae_trainer import SAETrainer

    torch.manual_seed(args.seed)
    d_in = data[0].shape[1]
    sae = saelens_topk_kind(args.architecture, d_in, d_sae, args.k)
    with torch.no_grad():
        sae.b_dec.copy_(data[0].mean(0))
    cfg = SAETrainerConfig(
        total_training_samples=len(data) * args.batch,
        train_batch_size_samples=args.batch,
        lr=args.lr or default_lr(d_sae),
        lr_warm_up_steps=args.warmup,
        lr_decay_steps=int(args.decay * len(data)),
        lr_end=0.0,
        device="cpu",
        autocast=autocast,
        dead_feature_window=DEAD_WINDOW_STEPS,
        feature_sampling_window=10**9,
    )
    timer = Timer()
    fired_per_step: list[int] = []  # --trace_firing: latents that fired on each batch

    def provider():  # type: ignore[no-untyped-def]
        for i, x in enumerate(data):
            if args.trace_firing and i > 0:  # the counters as the previous batch left them
                fired_per_step.append(int((trainer.n_forward_passes_since_fired == 0).sum()))
            timer.step(i)
            yield x

    trainer = SAETrainer(cfg, sae, provider())
    trainer.fit()
    speed = timer.tokens_per_s(args.batch)
    since = trainer.n_forward_passes_since_fired
    if args.trace_firing:
        fired_per_step.append(int((since == 0).sum()))
    dead = float((since >= DEAD_WINDOW_STEPS).float().mean())
    batch_q = {}
    if args.architecture != "topk":  # also k per token over the held-out batch, as in training
        batch_q = {f"batch_{m}": v for m, v in quality(sae, sae.encode, held).items()}
        sae = inference_sae(sae)
    q = {**quality(lambda x: sae(x), lambda x: sae.encode(x), held), **batch_q}
    name = (
        "saelens"
        + ("" if args.architecture == "topk" else f"-{args.architecture}")
        + ("-bf16" if autocast else "")
    )
    rec = record(name, "bf16" if autocast else "fp32", d_in, d_sae, args, speed, q, dead)
    if not args.trace_firing:
        return rec
    last_fired = torch.where(since >= len(data), -1, len(data) - 1 - since.long())  # -1: never
    return rec | firing_trace(fired_per_step, last_fired, since >= DEAD_WINDOW_STEPS)


def run_sparsify(
    data: list, held: torch.Tensor, d_sae: int, args: argparse.Namespace, optimizer: str
) -> dict:
    from sparsify import SparseCoder, SparseCoderConfig

    torch.manual_seed(args.seed)
    d_in = data[0].shape[1]
    sae = SparseCoder(d_in, SparseCoderConfig(num_latents=d_sae, k=args.k), device="cpu", dtype=torch.float32)
    if optimizer == "signum":
        from schedulefree import ScheduleFreeWrapper
        from sparsify.sign_sgd import SignSGD

        opt = ScheduleFreeWrapper(
            SignSGD([{"params": sae.parameters(), "lr": 5e-3 / math.sqrt(d_sae / 2**14)}]), momentum=0.95
        )
        opt.train()
        sched = None
    else:
        from transformers import get_linear_schedule_with_warmup

        opt = torch.optim.Adam(sae.parameters(), lr=args.lr or default_lr(d_sae))
        sched = get_linear_schedule_with_warmup(opt, args.warmup, len(data))
    since = torch.zeros(d_sae, dtype=torch.long)
    timer = Timer()
    for i, x in enumerate(data):
        timer.step(i)
        if i == 0:
            sae.b_dec.data = x.mean(0)
        sae.set_decoder_norm_to_unit_norm()
        dead = since > 10_000_000  # sparsify's default dead_feature_threshold
        out = sae(x, dead_mask=dead)
        (out.fvu + (1 / 32) * out.auxk_loss).backward()
        fired = torch.zeros(d_sae, dtype=torch.bool)
        fired[out.latent_indices.flatten()] = True
        sae.remove_gradient_parallel_to_decoder_directions()
        opt.step()
        opt.zero_grad()
        if sched is not None:
            sched.step()
        since += len(x)
        since[fired] = 0
    speed = timer.tokens_per_s(args.batch)
    if optimizer == "signum":
        opt.eval()  # ScheduleFree: evaluate at the averaged weights
    dead_frac = float((since >= DEAD_WINDOW_STEPS * args.batch).float().mean())

    def encode(x: torch.Tensor) -> torch.Tensor:
        enc = sae.encode(x)
        return torch.zeros(len(x), d_sae).scatter_(-1, enc.top_indices, enc.top_acts)

    q = quality(lambda x: sae(x).sae_out, encode, held)
    return record(f"sparsify-{optimizer}", "fp32", d_in, d_sae, args, speed, q, dead_frac)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--acts", type=Path, required=True)
    p.add_argument("--expansion", type=int, nargs="+", default=[16])
    p.add_argument(
        "--peers", nargs="+", default=["saelens", "saelens-bf16", "sparsify-signum", "sparsify-adam"]
    )
    p.add_argument(
        "--architecture", default="topk", choices=["topk", "batchtopk", "matryoshka"], help="SAELens only"
    )
    p.add_argument("--k", type=int, default=32)
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--lr", type=float, default=None)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--decay", type=float, default=0.2)
    p.add_argument("--seed", type=int, default=0, help="batch order and initialisation")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument(
        "--trace_firing", action="store_true", help="latents firing per step, and when the dead stopped"
    )
    args = p.parse_args()
    if args.architecture != "topk" and any(not peer.startswith("saelens") for peer in args.peers):
        p.error("sparsify trains TopK only: with --architecture, use --peers saelens [saelens-bf16]")
    train, held = load_split(args.acts / "train"), load_split(args.acts / "eval")
    scale = scale_of(train)
    data = batches(train, scale, args.batch, args.steps, args.seed)
    held_out = torch.from_numpy(held * scale)
    for e in args.expansion:
        d_sae = e * train.shape[1]
        for peer in args.peers:
            if peer.startswith("saelens"):
                rec = run_saelens(data, held_out, d_sae, args, autocast=peer.endswith("bf16"))
            else:
                rec = run_sparsify(data, held_out, d_sae, args, optimizer=peer.split("-")[1])
            rec["seed"], rec["arch"] = args.seed, args.architecture
            print(json.dumps(rec), flush=True)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(json.dumps(rec) + "\n")


if __name__ == "__main__":
    main()
