"""SAEs against ground truth: SAELens's synthetic generator (SynthSAEBench), assay and SAELens
trained on the same activations in the same order, scored by feature recovery.

Four steps, two environments (SAELens is never a dependency of assay; its generator and
trainer run in the peers' environment that `make test-interop` builds):

  .venv-peers/bin/python bench/bench_sae_synthetic.py generate --data DIR
  .venv/bin/python       bench/bench_sae_synthetic.py assay    --data DIR
  .venv-peers/bin/python bench/bench_sae_synthetic.py saelens  --data DIR
  .venv/bin/python       bench/bench_sae_synthetic.py score    --data DIR   (markdown table)
  .venv-peers/bin/python bench/bench_sae_synthetic.py crosscheck --data DIR (SAELens's own MCC/F1)
  .venv/bin/python       bench/bench_sae_synthetic.py floor    --data DIR   (the dense step's GEMMs alone)

`generate` builds a SyntheticModel scaled down from SynthSAEBench-16k (same recipe: Zipfian
firing, exponent 0.5 from 0.4 to 5e-4; hierarchy with branching 4, depth 3, mutually exclusive
children; low-rank correlations, rank 25, scale 0.1; orthogonalised dictionary; magnitudes
linear 5 -> 4 with folded-normal spread), and writes DIR/train (assay's activation-cache
layout), DIR/eval and DIR/ground_truth.safetensors (feature_vectors, eval_acts, eval_fires).
Both trainers read batch i = rows perm[i*B:(i+1)*B] of one seeded permutation, normalised by
one scale (bench_sae_common.py). Every trained SAE is saved in the SAELens format under
DIR/saes/, and `score` evaluates them all with one implementation (assay.sae.ground_truth):
MCC, F1 and its chance level, L0, FVU and the dead fraction on the evaluation samples; tokens/s
of the SAE step. `score --at_l0 L` also scores the BatchTopK-type SAEs at equal sparsity: each
inference threshold scaled until the evaluation L0 is L; `score --training_rule` scores them by
batch top-k over evaluation batches, as SynthSAEBench's runner does (sae_synthetic_scoring.py).

The SAEs are initialised from torch's generator seeded with --init_seed, never --seed: SAELens
draws the true dictionary from a generator seeded with --seed, and assay's start (normalised
torch.randn rows) drawn from the same seed would begin at the true directions (MCC 0.99 before
training).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_sae_common import (  # noqa: E402
    DEAD_WINDOW_STEPS,
    Timer,
    batches,
    load_split,
    machine,
    matryoshka_widths,
    saelens_topk_kind,
    scale_of,
)
from sae_synthetic_scoring import ARCHS, score, true_k  # noqa: E402

WARMUP, DECAY = 10, 0.2  # Adam's schedule for both libraries (assay's signum: none)


# ---- generate (peers' environment) -------------------------------------------------------
def synthetic_config(features: int, hidden: int, roots: int, seed: int) -> Any:
    """SAELens's SyntheticModelConfig of the SynthSAEBench-16k recipe at this size."""
    from sae_lens.synthetic import (
        FoldedNormalMagnitudeConfig,
        HierarchyConfig,
        LinearMagnitudeConfig,
        LowRankCorrelationConfig,
        OrthogonalizationConfig,
        SyntheticModelConfig,
        ZipfianFiringProbabilityConfig,
    )

    return SyntheticModelConfig(
        num_features=features,
        hidden_dim=hidden,
        firing_probability=ZipfianFiringProbabilityConfig(exponent=0.5, max_prob=0.4, min_prob=5e-4),
        hierarchy=HierarchyConfig(
            total_root_nodes=roots, branching_factor=4, max_depth=3, mutually_exclusive_portion=1.0
        ),
        correlation=LowRankCorrelationConfig(rank=25, correlation_scale=0.1),
        orthogonalization=OrthogonalizationConfig(num_steps=100, lr=3e-4),
        mean_firing_magnitudes=LinearMagnitudeConfig(start=5.0, end=4.0),
        std_firing_magnitudes=FoldedNormalMagnitudeConfig(mean=0.5, std=0.5),
        seed=seed,
    )


def generate(args: argparse.Namespace) -> None:
    from numpy.lib.format import open_memmap
    from sae_lens.synthetic import SyntheticModel
    from safetensors.torch import save_file

    cfg = synthetic_config(args.features, args.hidden, args.roots, args.seed)
    model = SyntheticModel(cfg)
    torch.manual_seed(args.seed + 100)
    out = args.data
    for split, n in (("train", args.samples), ("eval", args.eval_samples)):
        (out / split).mkdir(parents=True, exist_ok=True)
        arr = open_memmap(
            out / split / "activations.npy", mode="w+", dtype=np.float32, shape=(n, args.hidden)
        )
        fires = np.zeros((n, args.features), dtype=bool) if split == "eval" else None
        l0 = 0.0
        for start in range(0, n, 65536):
            m = min(65536, n - start)
            with torch.no_grad():
                hidden, feats = model.sample_with_features(m)
            arr[start : start + m] = hidden.numpy()
            l0 += float((feats > 0).sum())
            if fires is not None:
                fires[start : start + m] = (feats > 0).numpy()
        arr.flush()
        meta = {"n_contexts": n, "context_length": 1, "d_in": args.hidden, "true_l0": l0 / n}
        (out / split / "meta.json").write_text(json.dumps(meta))
        print(json.dumps({"split": split, **meta}), flush=True)
    gt = {
        "feature_vectors": model.feature_dict.feature_vectors.detach().float().contiguous(),
        "eval_acts": torch.from_numpy(np.load(out / "eval" / "activations.npy")),
        "eval_fires": torch.from_numpy(fires),
    }
    save_file(gt, str(out / "ground_truth.safetensors"))
    (out / "synthetic_config.json").write_text(json.dumps(cfg.to_dict(), indent=1))


# ---- the shared protocol ----------------------------------------------------------------
def protocol(args: argparse.Namespace) -> tuple[list[torch.Tensor], float, int]:
    train = load_split(args.data / "train")
    scale = scale_of(train)
    steps = args.samples // args.batch
    return batches(train, scale, args.batch, steps, args.seed), scale, steps


def save_line(args: argparse.Namespace, rec: dict[str, Any]) -> None:
    rec = {**rec, **machine(), "samples": args.samples, "batch": args.batch}
    print(json.dumps(rec), flush=True)
    with open(args.data / "runs.jsonl", "a") as f:
        f.write(json.dumps(rec) + "\n")


# ---- assay ----------------------------------------------------------------------------------
def train_assay(
    args: argparse.Namespace,
    arch: str,
    precision: str,
    stream: Iterable[torch.Tensor],
    first: torch.Tensor,
    steps: int,
    k: int,
) -> tuple[Any, Any, torch.Tensor, dict[str, Any]]:
    """One assay SAE trained on `steps` batches of `stream` as `assay sae train` trains it
    (`first`: the first batch, for b_dec and the encoder's scale). (sae, optimizer, the last
    batch, the run's record); the caller saves or scores it inside `averaged(optimizer)`."""
    from assay.core.precision import PrecisionPolicy
    from assay.sae.config import SaeArchConfig, default_aux_window
    from assay.sae.metrics import DeadLatents
    from assay.sae.model import SparseAutoencoder
    from assay.sae.optim import default_learning_rate, make_optimizer
    from assay.sae.train import lr_at, train_step

    torch.manual_seed(args.init_seed)
    rate = args.jumprelu_threshold_lr
    own = {} if rate is None else {"jumprelu_threshold_lr": rate}  # None: assay's default
    cfg = SaeArchConfig(
        architecture=arch, k=k, matryoshka_widths=matryoshka_widths(args.d_sae),
        l1_coefficient=args.l1_coefficient, l0_coefficient=args.l0_coefficient,
        jumprelu_init_threshold=args.jumprelu_init_threshold,
        aux_straight_through=not args.no_aux_straight_through, aux_k=args.aux_k, **own,
    )  # fmt: skip
    base = coefficients(args).get(arch, 0.0)  # the sparsity penalty's weight (0: TopK-type)
    sae = SparseAutoencoder(first.shape[1], args.d_sae, cfg).to(first.device)
    with torch.no_grad():
        sae.b_dec.copy_(first.mean(0))
    sae.fit_encoder_scale(first)
    kind = "signum" if cfg.unit_decoder else "adam"
    lr = default_learning_rate(args.d_sae, cfg.unit_decoder, kind)
    warmup, decay = (0, 0.0) if kind == "signum" else (WARMUP, DECAY)
    opt = make_optimizer(sae, lr, kind, encoder_step=args.signum_encoder_step)
    policy = PrecisionPolicy.resolve(precision, first.device)
    window = DEAD_WINDOW_STEPS * args.batch
    aux_window = default_aux_window(arch, kind, args.batch, window)  # assay's AuxK default
    dead = DeadLatents(args.d_sae, window=window, aux_window=aux_window)
    timer, warm, x = Timer(), max(1, int(0.05 * steps)), first
    for i, x in zip(range(steps), stream):
        timer.step(i)
        coef = base * min(1.0, (i + 1) / warm)  # warmed up as assay sae train does
        train_step(sae, opt, x, dead, policy, lr_at(i, steps, lr, warmup, decay), coef, 1.0, i == 0)
    if x.is_cuda:
        torch.cuda.synchronize()
    rec = {"library": "assay", "arch": arch, "precision": precision, "lr": lr, "optimizer": kind}
    extra = {"aux_window": aux_window, "tokens_per_s": timer.tokens_per_s(args.batch)}
    return sae, opt, x, {**rec, **extra, "train_dead": dead.fraction()}


def run_assay(args: argparse.Namespace) -> None:
    from assay.core.memory import reuse_freed_memory
    from assay.sae.optim import averaged
    from assay.sae.saelens_format import save_sae
    from assay.sae.train import calibrate_threshold

    data, scale, steps = protocol(args)
    k = true_k(args.data)
    reuse_freed_memory()  # as assay's training loop (assay.sae.loop.fit_all) sets it
    for arch in args.archs:
        for precision in args.precision:
            sae, opt, last, rec = train_assay(args, arch, precision, data, data[0], steps, k)
            name = f"assay-{arch}-{precision}"
            with averaged(opt):  # signum: the averaged point, as assay saves it
                calibrate_threshold(sae, last)  # BatchTopK kinds: the threshold assay saves
                sae.act_scale.fill_(scale)  # the batches were scaled: save for raw activations
                save_sae(args.data / "saes" / name, sae, {"hook_name": "synthetic"}, overwrite=True)
            save_line(args, {"name": name, **rec})


# ---- the dense floor --------------------------------------------------------------------------
def run_floor(args: argparse.Namespace) -> None:
    """Tokens/s of the five matrix products every dense (ReLU, JumpReLU) SAE step needs, and
    nothing else: encode and decode forward; the codes', decoder's and encoder's gradients. No
    dense step at that precision can run faster, in either library."""
    d_in, n = load_split(args.data / "train").shape[1], args.batch
    for precision in args.precision:
        dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        x, w_enc, w_dec = (
            torch.randn(*s).to(dtype) for s in ((n, d_in), (d_in, args.d_sae), (args.d_sae, d_in))
        )
        timer = Timer()
        for i in range(args.samples // n):
            timer.step(i)
            z = x @ w_enc  # [N, d_sae]
            err = z @ w_dec  # [N, d_in]
            grad_z = err @ w_dec.t()
            _ = z.t() @ err  # decoder gradient
            _ = x.t() @ grad_z  # encoder gradient
        rec = {"name": f"floor-{precision}", "library": "floor", "precision": precision}
        print(json.dumps({**rec, "tokens_per_s": timer.tokens_per_s(n), **machine()}), flush=True)


# ---- SAELens (peers' environment) ----------------------------------------------------------
def coefficients(args: argparse.Namespace) -> dict[str, float]:
    """The sparsity penalty's weight per penalised architecture, the same in both libraries."""
    return {"relu": args.l1_coefficient, "jumprelu": args.l0_coefficient}


def saelens_sae(
    arch: str, d_in: int, d_sae: int, k: int, steps: int, coefs: dict[str, float], threshold: float
) -> Any:
    import sae_lens as sl

    warm = max(1, int(0.05 * steps))
    if arch in ("topk", "batchtopk", "matryoshka"):
        return saelens_topk_kind(arch, d_in, d_sae, k)
    if arch == "jumprelu":
        cfg_j = sl.JumpReLUTrainingSAEConfig(
            d_in=d_in, d_sae=d_sae, l0_coefficient=coefs["jumprelu"], l0_warm_up_steps=warm,
            jumprelu_init_threshold=threshold,
        )  # fmt: skip
        return sl.JumpReLUTrainingSAE(cfg_j)
    cfg_s = sl.StandardTrainingSAEConfig(
        d_in=d_in, d_sae=d_sae, l1_coefficient=coefs["relu"], l1_warm_up_steps=warm
    )
    return sl.StandardTrainingSAE(cfg_s)


def train_saelens(
    args: argparse.Namespace,
    arch: str,
    precision: str,
    stream: Iterable[torch.Tensor],
    first: torch.Tensor,
    steps: int,
    k: int,
) -> tuple[Any, dict[str, Any]]:
    """One SAELens SAE trained by its own SAETrainer on `steps` batches of `stream` at its
    recommended settings and assay's Adam learning rates (`first`: the first batch, for b_dec).
    (sae, the run's record)."""
    from sae_lens.config import SAETrainerConfig
    from sae_lens.training.sae_trainer import SAETrainer

    torch.manual_seed(args.init_seed)
    threshold = args.jumprelu_init_threshold
    sae = saelens_sae(arch, first.shape[1], args.d_sae, k, steps, coefficients(args), threshold)
    sae.to(first.device)
    with torch.no_grad():
        sae.b_dec.copy_(first.mean(0))
    unit = arch in ("topk", "batchtopk", "matryoshka")
    lr = (3.2e-3 if unit else 8e-4) / (args.d_sae / 2**14) ** 0.5  # assay's Adam defaults
    cfg = SAETrainerConfig(
        total_training_samples=steps * args.batch, train_batch_size_samples=args.batch, lr=lr,
        lr_warm_up_steps=WARMUP, lr_decay_steps=int(DECAY * steps), lr_end=0.0,
        device=str(first.device), autocast=precision == "bf16", dead_feature_window=DEAD_WINDOW_STEPS,
        feature_sampling_window=10**9,
    )  # fmt: skip
    timer = Timer()

    def provider() -> Any:
        for i, x in zip(range(steps), stream):
            timer.step(i)
            yield x

    trainer = SAETrainer(cfg, sae, provider())
    trainer.fit()
    if first.is_cuda:
        torch.cuda.synchronize()
    train_dead = float((trainer.n_forward_passes_since_fired >= DEAD_WINDOW_STEPS).float().mean())
    rec = {"library": "saelens", "arch": arch, "precision": precision, "lr": lr, "optimizer": "adam"}
    return sae, {**rec, "tokens_per_s": timer.tokens_per_s(args.batch), "train_dead": train_dead}


def save_saelens(sae: Any, scale: float, folder: Path) -> None:
    """Save in SAELens's format for raw activations (the batches were scaled by `scale`)."""
    with torch.no_grad():
        sae.W_enc.mul_(scale)
        sae.W_dec.div_(scale)
        sae.b_dec.div_(scale)
    sae.cfg.metadata.hook_name = "synthetic"
    sae.save_inference_model(folder)


def run_saelens(args: argparse.Namespace) -> None:
    data, scale, steps = protocol(args)
    k = true_k(args.data)
    for arch in args.archs:
        for precision in args.precision:
            sae, rec = train_saelens(args, arch, precision, data, data[0], steps, k)
            name = f"saelens-{arch}-{precision}"
            save_saelens(sae, scale, args.data / "saes" / name)
            save_line(args, {"name": name, **rec})


def crosscheck(args: argparse.Namespace) -> None:
    """SAELens's own metric functions on every saved folder (peers' environment)."""
    from sae_lens import SAE
    from sae_lens.synthetic.evals import compute_classification_metrics, mean_correlation_coefficient
    from safetensors.torch import load_file

    gt = load_file(str(args.data / "ground_truth.safetensors"))
    for folder in sorted((args.data / "saes").iterdir()):
        sae = SAE.load_from_disk(str(folder))
        with torch.no_grad():
            z = sae.encode(gt["eval_acts"])
            cls = compute_classification_metrics(
                z, gt["eval_fires"].float(), sae.W_dec, gt["feature_vectors"]
            )
            mcc = mean_correlation_coefficient(sae.W_dec, gt["feature_vectors"])
        print(json.dumps({"name": folder.name, "mcc": mcc, "f1": cls.f1_score}), flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["generate", "assay", "saelens", "score", "crosscheck", "floor"])
    p.add_argument("--data", type=Path, required=True, help="the dataset folder")
    p.add_argument("--features", type=int, default=4096, help="generate: ground-truth features")
    p.add_argument("--hidden", type=int, default=256, help="generate: activation width d")
    p.add_argument("--roots", type=int, default=32, help="generate: hierarchy root nodes")
    p.add_argument("--samples", type=int, default=1 << 20, help="training samples (generate: written)")
    p.add_argument("--eval_samples", type=int, default=16384)
    p.add_argument("--d_sae", type=int, default=4096)
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--archs", nargs="+", default=list(ARCHS), choices=ARCHS)
    p.add_argument("--precision", nargs="+", default=["fp32", "bf16"])
    p.add_argument("--seed", type=int, default=0, help="the generator's seed, and the batch order")
    p.add_argument("--l0_coefficient", type=float, default=1.0, help="JumpReLU's L0 penalty, both libraries")
    p.add_argument("--l1_coefficient", type=float, default=5.0, help="ReLU's L1 penalty, both libraries")
    p.add_argument(
        "--jumprelu_init_threshold", type=float, default=0.01,
        help="JumpReLU's initial threshold (on the normalised batches), both libraries",
    )  # fmt: skip
    p.add_argument(
        "--jumprelu_threshold_lr", type=float, default=None,
        help="assay's JumpReLU threshold learning-rate multiple (default: assay's; SAELens has none: 1)",
    )  # fmt: skip
    p.add_argument(
        "--signum_encoder_step", type=float, default=None,
        help="assay's --signum_encoder_step (default: the architecture's)",
    )  # fmt: skip
    p.add_argument("--aux_k", type=int, default=None, help="assay's --aux_k (default: k)")
    p.add_argument(
        "--no_aux_straight_through", action="store_true",
        help="assay's --no_aux_straight_through (AuxK behind the ReLU's gradient, as before it)",
    )  # fmt: skip
    p.add_argument(
        "--at_l0", type=float, nargs="*", default=[],
        help="score: also score the threshold SAEs (batchtopk, matryoshka) with the threshold "
        "scaled to make the evaluation L0 each of these (e.g. k)",
    )  # fmt: skip
    p.add_argument(
        "--decoder_as_encoder", action="store_true",
        help="score --at_l0: also score each threshold SAE with its decoder's directions as its encoder",
    )  # fmt: skip
    p.add_argument(
        "--training_rule", action="store_true",
        help="score: also score the threshold SAEs by their training rule (batch top-k over evaluation "
        "batches of --batch), as SynthSAEBench's runner scores them",
    )  # fmt: skip
    p.add_argument(
        "--init_seed", type=int, default=1, help="the SAEs' initialisation (never --seed: see the docstring)"
    )
    args = p.parse_args()
    started = time.perf_counter()
    {
        "generate": generate,
        "assay": run_assay,
        "saelens": run_saelens,
        "score": score,
        "crosscheck": crosscheck,
        "floor": run_floor,
    }[args.mode](args)
    print(f"# {args.mode}: {time.perf_counter() - started:.0f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
