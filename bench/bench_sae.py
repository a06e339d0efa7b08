"""SAE training throughput and quality, fp32 vs bf16 autocast, at realistic widths.

  .venv/bin/python bench/bench_sae.py prepare --model assay-tiny --hookpoint model.layers.2
  .venv/bin/python bench/bench_sae.py run --acts CACHE --expansion 16 32 --precision fp32 bf16
  .venv-peers/bin/python bench/bench_sae_peers.py --acts CACHE ...   (SAELens, sparsify)

`prepare` caches activations of the bundled general text (shakespeare train: training
tokens; eval: 16,384 held-out tokens) with assay's own cache writer. `run` trains TopK SAEs
on them (same batches, same order as the peers; see bench_sae_common.py) and prints one
JSON line per configuration: tokens/s of the SAE step (LM excluded), FVU, L0, dead fraction (and
`dead_all_negative`: the dead latents with no pre-activation above 0 on the last batch).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
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
    scale_of,
)

from assay.core.config import DataConfig, ModelConfig  # noqa: E402
from assay.core.memory import reuse_freed_memory  # noqa: E402
from assay.core.paths import cache_dir  # noqa: E402
from assay.core.precision import PrecisionPolicy  # noqa: E402
from assay.lm.data import load_examples  # noqa: E402
from assay.lm.models import load_model, load_tokenizer  # noqa: E402
from assay.sae import optim as optim_mod  # noqa: E402
from assay.sae.activations import LMActivations, pack_contexts, write_cache  # noqa: E402
from assay.sae.config import SaeArchConfig, default_aux_window  # noqa: E402
from assay.sae.metrics import DeadLatents  # noqa: E402
from assay.sae.model import SparseAutoencoder  # noqa: E402
from assay.sae.optim import averaged  # noqa: E402
from assay.sae.train import (  # noqa: E402
    calibrate_threshold,
    default_learning_rate,
    lr_at,
    make_optimizer,
    train_step,
)


def prepare(args: argparse.Namespace) -> Path:
    folder = cache_dir() / "bench" / f"sae-{Path(args.model).name}-{args.hookpoint}-{args.tokens}"
    policy = PrecisionPolicy.resolve("fp32")
    tokenizer = load_tokenizer(ModelConfig(model=args.model))
    model = load_model(ModelConfig(model=args.model), policy)
    for split, n_tokens in (("train", args.tokens), ("eval", 16384)):
        if (folder / split / "meta.json").exists():
            continue
        _, ex = load_examples(DataConfig("shakespeare", split=split), tokenizer)
        contexts = pack_contexts(ex.tokens, 128)[: -(-n_tokens // 128)]
        source = LMActivations(model, args.hookpoint, contexts, policy, batch_contexts=32)
        (folder).mkdir(parents=True, exist_ok=True)
        write_cache(
            source, folder / split, {"model": args.model, "hookpoint": args.hookpoint, "split": split}
        )
    print(folder)
    return folder


def random_model(args: argparse.Namespace) -> Path:
    """A random Llama of assay-tiny's shape (hidden 256, 4 layers) with SmolLM2's tokenizer.

    Stands in for assay-tiny where that checkpoint is not available; speed depends on the
    width only, and every library sees the same activations.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = cache_dir() / "bench" / "random-llama-256"
    if not (folder / "config.json").exists():
        tokenizer = load_tokenizer(ModelConfig(model="smollm2-135m"))
        torch.manual_seed(0)
        cfg = LlamaConfig(
            vocab_size=len(tokenizer),
            hidden_size=256,
            intermediate_size=1024,
            num_hidden_layers=4,
            num_attention_heads=8,
            num_key_value_heads=4,
            max_position_embeddings=512,
        )
        LlamaForCausalLM(cfg).save_pretrained(folder)
        tokenizer.save_pretrained(folder)
    print(folder)
    return folder


def run_ours(
    acts: Path, d_sae: int, precision: str, args: argparse.Namespace, sparse: bool, init: str
) -> dict:
    train, held = load_split(acts / "train"), load_split(acts / "eval")
    scale = scale_of(train)
    data = batches(train, scale, args.batch, args.steps, args.seed)
    held_out = torch.from_numpy(held * scale)
    torch.manual_seed(args.seed)
    d_in = train.shape[1]
    kw = {"k": args.k, "sparse_kernels": sparse, "decoder_init": init, "aux_coefficient": args.aux}
    kw["aux_k"] = args.aux_k
    kw["aux_straight_through"] = not args.no_aux_straight_through
    arch = SaeArchConfig(architecture=args.architecture, **kw)  # type: ignore[arg-type]
    sae = SparseAutoencoder(d_in, d_sae, arch)
    with torch.no_grad():
        sae.b_dec.copy_(data[0].mean(0))  # as the peers do (sparsify: first batch mean)
    if not args.no_fit:  # --no_fit: the ablation of the unit start's fitted encoder scale
        sae.fit_encoder_scale(data[0])  # as assay's init_from_data does (unit decoder start)
    lr = args.lr or default_learning_rate(d_sae, sae.arch.unit_decoder, args.optimizer)
    opt = make_optimizer(sae, lr, args.optimizer, args.momentum, args.r, args.encoder_step)
    if args.plain_encoder_step:  # signum's ablation: W_enc steps as far as every other weight
        opt.param_groups[0]["step_scale"] = 1.0
    optim_mod.RENORM = args.renorm
    # signum: schedule-free, so no decay; warm-up only with --signum_warmup
    signum = (args.signum_warmup, args.signum_decay)
    warmup, decay = signum if args.optimizer == "signum" else (args.warmup, args.decay)
    policy = PrecisionPolicy.resolve(precision)
    window = DEAD_WINDOW_STEPS * args.batch
    aux_window = args.aux_window or default_aux_window(args.architecture, args.optimizer, args.batch, window)
    dead = DeadLatents(d_sae, window=window, aux_window=aux_window)  # AuxK: assay's default window
    timer = Timer()
    encoder_scale = opt.param_groups[0].get("step_scale", 1.0)
    last_fired = torch.full((d_sae,), -1)  # --trace_firing: the last step each latent fired on
    fired_per_step = []
    for i, x in enumerate(data):
        timer.step(i)
        step_lr = lr_at(i, args.steps, lr, warmup, decay)
        if args.encoder_warmup and args.optimizer == "signum":  # ablation: W_enc's step ramped up
            opt.param_groups[0]["step_scale"] = encoder_scale * min(1.0, (i + 1) / args.encoder_warmup)
        out = train_step(sae, opt, x, dead, policy, step_lr, 0.0, 1.0, first=i == 0)
        if args.trace_firing:
            fired = (out.counts > 0).cpu()
            last_fired[fired] = i
            fired_per_step.append(int(fired.sum()))
    speed = timer.tokens_per_s(args.batch)
    with torch.no_grad():  # dead latents out of AuxK's reach behind the ReLU: no pre-activation > 0
        unreachable = dead.mask() & (sae.pre_acts(data[-1]).amax(0) <= 0).cpu()
    with averaged(opt):  # signum: the averaged point x
        ema = float(sae.threshold_buf[0])  # BatchTopK kinds: training's EMA of the kept minimum
        calibrate_threshold(sae, data[-1])  # the threshold assay saves
        q = quality(sae.forward, sae.encode, held_out)
    if sae.rule.tracks_min_kept:
        q = {**q, "threshold_ema": ema, "threshold": float(sae.threshold_buf[0])}
    name = "assay" if args.architecture == "topk" else f"assay-{args.architecture}"
    rec = record(name, precision, d_in, d_sae, args, speed, q, dead.fraction())
    init_name = ("unit-nofit" if args.no_fit else "unit") if arch.unit_decoder else "small"
    return {
        **rec,
        "kernel": "sparse" if sparse else "dense",
        "init": init_name,
        "lr": lr,
        "arch": args.architecture,
        "optimizer": args.optimizer + (f"-{args.renorm}" if args.optimizer == "signum" else ""),
        "schedule": [warmup, decay] + ([args.momentum, args.r] if args.optimizer == "signum" else []),
        "aux_coefficient": arch.aux_coefficient,
        "aux_window": dead.aux_window,
        "encoder_step_scale": opt.param_groups[0].get("step_scale", 1.0),
        "aux_k": sae.aux_k,
        "aux_straight_through": arch.aux_straight_through,
        "dead_all_negative": float(unreachable.double().mean()),
        "encoder_warmup": args.encoder_warmup,
        "seed": args.seed,
        **(firing_trace(fired_per_step, last_fired, dead.mask()) if args.trace_firing else {}),
    }


def step_times(args: argparse.Namespace) -> None:
    """Adam and signum steps interleaved in one process on random data (the optimizers' cost
    side by side, robust to a shared machine's drift): median seconds per step."""
    import os
    import time

    torch.manual_seed(0)
    d_in, d_sae = 256, 16 * 256
    x, policy = torch.randn(args.batch, d_in), PrecisionPolicy.resolve(args.precision[0])
    setups = {}
    for kind in ("adam", "signum"):
        sae = SparseAutoencoder(d_in, d_sae, SaeArchConfig(architecture="topk", k=args.k))
        setups[kind] = (sae, make_optimizer(sae, 1e-3, kind), DeadLatents(d_sae, 10**9))
    times: dict[str, list[float]] = {k: [] for k in setups}
    for i in range(args.steps):
        for kind, (sae, opt, dead) in setups.items():
            start = time.perf_counter()
            train_step(sae, opt, x, dead, policy, 1e-3, 0.0, 1.0, first=i == 0)
            times[kind].append(time.perf_counter() - start)
    for kind, t in times.items():
        median = float(np.median(t[2:]))  # the first steps allocate
        print(json.dumps({"optimizer": kind, "step_s": median, "tokens_per_s": args.batch / median}))
    print(json.dumps({"load_avg": os.getloadavg(), "threads": torch.get_num_threads()}))


def table(files: list[Path]) -> None:
    """Markdown rows (median tokens/s over repeats) from the JSON lines of both scripts."""
    groups: dict[tuple, list[dict]] = {}
    for path in files:
        for line in path.read_text().splitlines():
            r = json.loads(line)
            lr = f"{r['lr']:.2g}" if "lr" in r else "-"  # assay rows; the peers' Adam runs share it
            lib = r["library"] + (f" {r['optimizer']}" if "optimizer" in r else "")
            key = (r["d_in"], r["d_sae"], lib, r.get("init", "-"), lr, r.get("kernel", "-"), r["precision"])
            groups.setdefault(key, []).append(r)
    print("| d_in x d_sae | library | init | lr | kernel | precision | tokens/s | FVU | L0 | dead | runs |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for (d_in, d_sae, lib, init, lr, kernel, prec), rs in sorted(groups.items()):
        speed = float(np.median([r["tokens_per_s"] for r in rs]))
        fvu, l0 = float(np.median([r["fvu"] for r in rs])), float(np.median([r["l0"] for r in rs]))
        dead = float(np.median([r["dead_fraction"] for r in rs]))
        cells = [
            f"{d_in} x {d_sae}",
            lib,
            init,
            lr,
            kernel,
            prec,
            f"{speed:,.0f}",
            f"{fvu:.3f}",
            f"{l0:.1f}",
            f"{dead:.1%}",
        ]
        print("| " + " | ".join([*cells, str(len(rs))]) + " |")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["random-model", "prepare", "run", "table", "steps"])
    p.add_argument("files", nargs="*", type=Path, help="table: JSON-lines files written with --out")
    p.add_argument("--model", default="assay-tiny")
    p.add_argument("--hookpoint", default="model.layers.2")
    p.add_argument("--tokens", type=int, default=409_600)
    p.add_argument("--acts", type=Path)
    p.add_argument("--expansion", type=int, nargs="+", default=[16, 32])
    p.add_argument("--precision", nargs="+", default=["fp32", "bf16"])
    p.add_argument("--kernels", nargs="+", default=["sparse"], choices=["sparse", "dense"])
    p.add_argument("--inits", nargs="+", default=["auto"], choices=["auto", "unit", "small"])
    p.add_argument("--no_fit", action="store_true", help="unit start: encoder = plain transpose")
    p.add_argument("--architecture", default="topk", choices=["topk", "batchtopk", "matryoshka"])
    p.add_argument("--k", type=int, default=32)
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--lr", type=float, default=None)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--decay", type=float, default=0.2)
    p.add_argument("--optimizer", default="adam", choices=["adam", "signum"])
    p.add_argument(
        "--renorm", default="zx", choices=["y", "z", "zx"], help="signum: decoder rows renormalised"
    )
    p.add_argument("--signum_warmup", type=int, default=0)
    p.add_argument("--signum_decay", type=float, default=0.0)
    p.add_argument("--r", type=float, default=1.0, help="signum: polynomial averaging weight k^r")
    p.add_argument("--momentum", type=float, default=0.98, help="signum: schedule-free beta")
    p.add_argument("--aux", type=float, default=1 / 32, help="AuxK coefficient")
    p.add_argument("--lr_c", type=float, default=None, help="signum: lr = C / sqrt(d_sae / 2^14)")
    p.add_argument("--encoder_step", type=float, default=None, help="signum: W_enc's step (default: arch's)")
    p.add_argument("--plain_encoder_step", action="store_true", help="signum: W_enc steps like the rest")
    p.add_argument("--aux_k", type=int, default=None, help="AuxK latents per token (default k)")
    p.add_argument("--no_aux_straight_through", action="store_true", help="AuxK behind the ReLU's gradient")
    p.add_argument(
        "--encoder_warmup", type=int, default=0, help="signum: W_enc's step ramped up over N steps (ablation)"
    )
    p.add_argument(
        "--trace_firing", action="store_true", help="record latents firing per step and when the dead stopped"
    )
    p.add_argument(
        "--aux_window", type=int, default=None, help="AuxK: tokens silent (default: assay's default)"
    )
    p.add_argument("--seed", type=int, default=0, help="batch order and initialisation")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument(
        "--allocator",
        default="reuse",
        choices=["reuse", "glibc"],
        help="reuse: freed temporaries kept for reuse, as assay's training loop sets it; glibc: its default",
    )
    args = p.parse_args()
    if args.mode == "table":
        table(args.files)
        return
    if args.mode == "steps":
        step_times(args)
        return
    if args.mode == "random-model":
        random_model(args)
        return
    if args.mode == "prepare":
        prepare(args)
        return
    if args.allocator == "reuse":
        reuse_freed_memory()
    optim_mod.SIGNUM_LR_C = args.lr_c or optim_mod.SIGNUM_LR_C
    d_in = int(json.loads((args.acts / "train" / "meta.json").read_text())["d_in"])
    for _ in range(args.repeats):  # alternate configurations within each repeat
        for e in args.expansion:
            for init in args.inits:
                for kernel in args.kernels:
                    for precision in args.precision:
                        rec = run_ours(args.acts, e * d_in, precision, args, kernel == "sparse", init)
                        print(json.dumps(rec), flush=True)
                        if args.out:
                            with open(args.out, "a") as f:
                                f.write(json.dumps(rec) + "\n")


if __name__ == "__main__":
    np.seterr(all="ignore")
    main()
