"""Feature recovery at SynthSAEBench's published width, streamed: the GPU check of issue #21.

The published table trains SAEs of 16,384 latents on 200M samples of a world of 16,384 true
features in d = 768: 600 GB of activations, too much to write down. Here SAELens's generator
(the recipe `bench_sae_synthetic.py` generates with, `synthetic_config`) draws every training
batch on the device as the step needs it, assay's SAEs train on that stream exactly as
`bench_sae_synthetic.py assay` trains them (`train_assay`), and held-out samples drawn once
score each SAE with assay.sae.ground_truth (MCC through scipy's assignment solver where installed,
in a CPU process beside the next architecture's training).

Each architecture trains on the same stream (the generator reseeded) for as many batches as fit
--seconds at the speed a short probe of assay's SAE measured (so the learning-rate schedule knows
its length), at most --samples (the published 200M). With --libraries assay saelens, SAELens's
SAE and trainer (`bench_sae_synthetic.py saelens`'s recipe) train on the same batches, as many,
and are scored through the SAELens-format folder they save. Results go to
OUT/synthetic_stream.json after every SAE, keyed library-architecture.
Not the released 16k world itself (a Hub download): the same recipe at its size, seed --seed.

  python3 bench/sae_synthetic_stream.py --device cuda --out OUT --saelens_path .gpu/synth
  python  bench/sae_synthetic_stream.py --device cpu --smoke --out /tmp/s  (the CPU path)

SAELens is never a dependency of assay: on this machine it comes from the peers' environment
(run with .venv-peers/bin/python and PYTHONPATH=.), on the GPU machine from the copy of its
modules that bench/gpu_prepare.sh makes (.gpu/synth, bench/saelens_copy.py).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_sae_common import scale_of  # noqa: E402
from bench_sae_synthetic import ARCHS, save_saelens, synthetic_config, train_assay, train_saelens  # noqa: E402
from machine import header, machine  # noqa: E402
from profiling import profile_table  # noqa: E402
from sae_synthetic_scoring import BATCH_TOPK_KINDS  # noqa: E402

PROBE_STEPS = 12  # a throwaway SAE's steps to measure the step rate (Timer skips the first 5)


def world(args: argparse.Namespace) -> tuple[Any, dict[str, torch.Tensor], float, float]:
    """(the generator, the held-out ground truth, its true L0, the activations' scale)."""
    from sae_lens.synthetic import SyntheticModel

    start = time.perf_counter()
    model = SyntheticModel(
        synthetic_config(args.features, args.hidden, args.roots, args.seed), device=args.device
    )
    torch.manual_seed(args.seed + 100)
    acts, fires = [], []
    for start_row in range(0, args.eval_samples, args.batch):
        hidden, feats = model.sample_with_features(min(args.batch, args.eval_samples - start_row))
        acts.append(hidden.float())
        fires.append(feats > 0)
    gt = {
        "feature_vectors": model.feature_dict.feature_vectors.detach().float(),
        "eval_acts": torch.cat(acts),
        "eval_fires": torch.cat(fires),
    }
    true_l0 = float(gt["eval_fires"].sum(1).float().mean())
    torch.manual_seed(args.seed + 300)  # a training-side draw, never the held-out samples
    scale = scale_of(model.sample(args.batch).float().cpu().numpy())
    print(f"world: {args.features} features, d = {args.hidden}, true L0 {true_l0:.1f}, "
          f"{time.perf_counter() - start:.1f} s to build", flush=True)  # fmt: skip
    return model, gt, true_l0, scale


def stream(model: Any, args: argparse.Namespace, scale: float) -> Iterator[torch.Tensor]:
    """The training batches, scaled; the same sequence for every architecture."""
    torch.manual_seed(args.seed + 200)
    while True:
        yield model.sample(args.batch).float() * scale


def generator_rate(model: Any, args: argparse.Namespace) -> float:
    """Samples/s of the generator alone (what every training step also pays)."""
    batches = stream(model, args, 1.0)
    next(batches)
    sync(args.device)
    start = time.perf_counter()
    for _ in range(8):
        next(batches)
    sync(args.device)
    return 8 * args.batch / (time.perf_counter() - start)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def mcc_job(decoder: torch.Tensor, features: torch.Tensor) -> float:
    """Runs in a CPU process: the MCC's one-to-one assignment."""
    from assay.sae.ground_truth import mean_correlation_coefficient

    return mean_correlation_coefficient(decoder, features)


def score(
    sae: Any, gt: dict[str, torch.Tensor], pool: ProcessPoolExecutor, arch: str, k: int, batch: int
) -> tuple[dict[str, Any], Future]:
    """Detection metrics now (on the device); the MCC as a future from the CPU pool. BatchTopK
    kinds also by their training rule over evaluation batches of `batch`, as SynthSAEBench's
    runner scores them (`metrics["training_rule"]`; the published table's figures)."""
    from assay.sae.ground_truth import BatchTopKEncoding, detection_metrics

    metrics: dict[str, Any] = dict(detection_metrics(sae, gt))
    if arch in BATCH_TOPK_KINDS:
        metrics["training_rule"] = detection_metrics(BatchTopKEncoding(sae, k), gt, batch)
    mcc = pool.submit(mcc_job, sae.W_dec.detach().float().cpu(), gt["feature_vectors"].cpu())
    return metrics, mcc


def run(args: argparse.Namespace) -> None:
    info = machine()
    print(header(info), flush=True)
    out = args.out / "synthetic_stream.json"
    result: dict[str, Any] = {"machine": info, "args": {k: str(v) for k, v in vars(args).items()}, "runs": {}}
    if args.device.startswith("cuda"):
        result["gpu"] = torch.cuda.get_device_name()
    model, gt, true_l0, scale = world(args)
    k = args.k or max(1, round(true_l0))
    result.update(true_l0=true_l0, k=k, scale=scale, generator_samples_per_s=generator_rate(model, args))
    workers = len(args.archs) * len(args.libraries)
    pool = ProcessPoolExecutor(max_workers=workers, mp_context=mp.get_context("spawn"))
    pending: dict[str, Future] = {}
    for arch in args.archs:
        first = next(stream(model, args, scale))  # every run's batch 0 (b_dec, the encoder's scale)
        steps = length(args, arch, model, scale, first, k)
        for library in args.libraries:
            name = f"{library}-{arch}"
            start = time.perf_counter()
            trainer = TRAINERS[library]
            rec, metrics, pending[name] = trainer(args, arch, model, scale, first, gt, steps, k, pool)
            rec = {**rec, "samples": steps * args.batch, "steps": steps}
            rec["wall_s"] = round(time.perf_counter() - start, 1)  # training and detection metrics
            result["runs"][name] = {**rec, "metrics": metrics}  # metrics["precision"]: the detection's
            print(json.dumps({"run": name, "samples": rec["samples"], **metrics}), flush=True)
            out.write_text(json.dumps(result, indent=1, default=str) + "\n")
    if args.profile_steps:  # while the MCCs are computed on the CPU
        profile(args, args.archs[0], model, scale, k)
    for name, future in pending.items():
        result["runs"][name]["metrics"]["mcc"] = future.result()
        print(f"{name}: MCC {result['runs'][name]['metrics']['mcc']:.3f}", flush=True)
        out.write_text(json.dumps(result, indent=1, default=str) + "\n")
    pool.shutdown()


def profile(args: argparse.Namespace, arch: str, model: Any, scale: float, k: int) -> None:
    """Where an assay SAE's steps spend their time (generator draws included): torch.profiler's
    table of the ops with the most device time (host time on a CPU), printed to the log."""
    first = next(stream(model, args, scale))

    def steps() -> None:
        train_assay(args, arch, args.precision, stream(model, args, scale), first, args.profile_steps, k)

    print(f"profile: {args.profile_steps} steps of {arch}", flush=True)
    print(profile_table(steps, torch.device(args.device), 20), flush=True)


def length(args: argparse.Namespace, arch: str, model: Any, scale: float, first: torch.Tensor, k: int) -> int:
    """Batches per SAE of `arch`: as many as assay trains in --seconds at the rate a short probe
    measured (at most --samples); every library trains this many."""
    batches = stream(model, args, scale)
    _, _, _, probe = train_assay(args, arch, args.precision, batches, first, PROBE_STEPS, k)
    fit = int(args.seconds * probe["tokens_per_s"] / args.batch)
    return max(PROBE_STEPS, min(args.samples // args.batch, fit))


def run_assay(args, arch, model, scale, first, gt, steps, k, pool) -> tuple[dict, dict, Future]:
    """(record, detection metrics, MCC future) of assay's SAE trained on the stream."""
    from assay.sae.optim import averaged
    from assay.sae.train import calibrate_threshold

    sae, opt, last, rec = train_assay(args, arch, args.precision, stream(model, args, scale), first, steps, k)
    with averaged(opt):  # signum: the averaged point, as assay saves it
        calibrate_threshold(sae, last)
        sae.act_scale.fill_(scale)  # the stream was scaled: score on raw activations
        metrics, mcc = score(sae, gt, pool, arch, k, args.batch)
    return rec, metrics, mcc


def run_saelens(args, arch, model, scale, first, gt, steps, k, pool) -> tuple[dict, dict, Future]:
    """The same for SAELens's SAE and trainer, saved in its format and scored as assay loads it."""
    from assay.sae.saelens_format import load_sae

    sae, rec = train_saelens(args, arch, args.precision, stream(model, args, scale), first, steps, k)
    with tempfile.TemporaryDirectory() as folder:
        save_saelens(sae, scale, Path(folder))
        loaded, _ = load_sae(folder)
    metrics, mcc = score(loaded.to(args.device), gt, pool, arch, k, args.batch)
    return rec, metrics, mcc


TRAINERS = {"assay": run_assay, "saelens": run_saelens}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", type=Path, required=True, help="folder for synthetic_stream.json")
    p.add_argument(
        "--smoke", action="store_true", help="a tiny world and a few seconds per SAE (the CPU path)"
    )
    p.add_argument("--features", type=int, default=16384, help="true features (published: 16,384)")
    p.add_argument("--hidden", type=int, default=768, help="activation width d (published: 768)")
    p.add_argument(
        "--roots", type=int, default=128, help="hierarchy roots (the 4k bench's 32, scaled by width)"
    )
    p.add_argument("--d_sae", type=int, default=16384, help="SAE latents (published: 16,384)")
    p.add_argument(
        "--k", type=int, default=None, help="TopK kinds' k (default: the world's true L0, rounded)"
    )
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--samples", type=int, default=200_000_000, help="most samples per SAE (published: 200M)")
    p.add_argument("--seconds", type=float, default=80.0, help="training time per SAE (sets its length)")
    p.add_argument("--eval_samples", type=int, default=65536)
    p.add_argument("--archs", nargs="+", default=["batchtopk", "matryoshka", "jumprelu"], choices=ARCHS)
    p.add_argument("--precision", default="bf16", choices=["bf16", "fp32"])
    p.add_argument(
        "--libraries", nargs="+", default=["assay"], choices=list(TRAINERS),
        help="whose SAEs to train on the stream (saelens: its trainer, from the copy or an install)",
    )  # fmt: skip
    p.add_argument("--seed", type=int, default=0, help="the world's seed (generator and held-out samples)")
    p.add_argument("--init_seed", type=int, default=1)
    p.add_argument("--l0_coefficient", type=float, default=1.0)
    p.add_argument("--l1_coefficient", type=float, default=5.0)
    p.add_argument("--jumprelu_init_threshold", type=float, default=0.01)
    p.add_argument("--jumprelu_threshold_lr", type=float, default=None)
    p.add_argument("--signum_encoder_step", type=float, default=None)
    p.add_argument("--no_aux_straight_through", action="store_true")
    p.add_argument("--aux_k", type=int, default=None)
    p.add_argument(
        "--profile_steps", type=int, default=0, help="profile this many steps (over 5) of the first arch"
    )
    p.add_argument(
        "--saelens_path",
        type=Path,
        default=None,
        help="searched first: a folder bench/saelens_copy.py filled",
    )
    return p


def main() -> None:
    args = parser().parse_args()
    if args.saelens_path is not None:
        sys.path.insert(0, str(args.saelens_path))
    if args.smoke:  # sizes only: an explicit --seconds still counts
        args.features, args.hidden, args.roots, args.d_sae = 512, 64, 8, 512
        args.batch, args.eval_samples = 1024, 4096
        args.seconds = min(args.seconds, 3.0)
    args.out.mkdir(parents=True, exist_ok=True)
    run(args)


if __name__ == "__main__":
    main()
