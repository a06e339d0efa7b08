"""Scoring of `bench_sae_synthetic.py`'s saved SAEs against the true features (its `score` mode).

Every SAE under DIR/saes/ is scored with one implementation (assay.sae.ground_truth): MCC, F1
and its chance level, L0, FVU and the dead fraction on the evaluation samples. `--at_l0 L` also
scores the BatchTopK-type SAEs at equal sparsity: each inference threshold scaled until the
evaluation L0 is L. `--decoder_as_encoder` adds, at each such L0, the same SAEs with their
decoder's directions as their encoder (each row at its encoder row's norm, no encoder bias):
what the dictionary alone detects there, so that an F1 gap can be told apart as the encoder's
or the dictionary's. `--training_rule` also scores them as SynthSAEBench scores them: its
runner evaluates the training SAE, whose encoding keeps the k·B largest activations of each
evaluation batch of B (the training batch size), not the saved threshold.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_sae_common import machine  # noqa: E402

ARCHS = ("topk", "batchtopk", "matryoshka", "jumprelu", "relu")
BATCH_TOPK_KINDS = ("batchtopk", "matryoshka")
"""Trained by batch top-k and saved with a threshold in its place (--at_l0, --training_rule)."""


def true_k(data: Path) -> int:
    """k for the TopK-type SAEs: the generator's mean active features per sample, rounded."""
    return max(1, round(json.loads((data / "train" / "meta.json").read_text())["true_l0"]))


def score_folder(folder: Path, gt: dict[str, torch.Tensor]) -> dict[str, float]:
    """MCC, F1 (precision, recall), L0, FVU and dead fraction of one saved SAE."""
    from assay.sae.ground_truth import ground_truth_metrics
    from assay.sae.saelens_format import load_sae

    sae, _ = load_sae(folder)
    m = ground_truth_metrics(sae, gt)
    return {**m, "dead": m["dead_fraction_eval"]}


@torch.no_grad()
def at_equal_l0(sae: Any, gt: dict[str, torch.Tensor], target: float) -> tuple[float, dict[str, float]]:
    """(factor, metrics) of a threshold SAE with its inference threshold multiplied by the factor
    that brings its evaluation L0 to `target` (bisection in log space over 1/256 .. 256): a
    comparison at equal sparsity, whatever state each library's threshold estimate is in."""
    from assay.sae.ground_truth import detection_metrics

    base = sae.threshold().detach().clone()
    x = gt["eval_acts"].float() * sae.act_scale

    def l0(factor: float) -> float:
        sae.threshold().copy_(base * factor)
        return sum(float((sae.encode(xb) != 0).sum()) for xb in x.split(4096)) / len(x)

    lo, hi = -8.0, 8.0  # log2 of the factor; L0 falls as the factor grows
    for _ in range(30):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if l0(2**mid) > target else (lo, mid)
    factor = 2 ** ((lo + hi) / 2)
    sae.threshold().copy_(base * factor)
    return factor, detection_metrics(sae, gt)


@torch.no_grad()
def decoder_as_encoder(sae: Any) -> Any:
    """`sae` with each encoder row replaced by its decoder row's direction at the encoder row's
    norm, and no encoder bias: a matched filter of the learned dictionary (in place)."""
    directions = sae.W_dec / sae.W_dec.norm(dim=1, keepdim=True).clamp_min(1e-12)  # [d_sae, d_in]
    norms = sae.W_enc.norm(dim=0)  # [d_sae]: W_enc is [d_in, d_sae]
    sae.W_enc.copy_((directions * norms[:, None]).T)
    sae.b_enc.zero_()
    return sae


def score_at_l0(args: argparse.Namespace, gt: dict[str, torch.Tensor], latest: dict[str, dict]) -> None:
    """The threshold SAEs (BatchTopK, Matryoshka) of both libraries re-scored at each --at_l0."""
    from assay.sae.saelens_format import load_sae

    print("\nat equal sparsity: each inference threshold x the factor giving the target evaluation L0")
    cols = ["target L0", "architecture", "library", "precision", "factor", "F1", "F1 chance", "L0", "FVU"]
    print("| " + " | ".join([*cols, "dead (eval)"]) + " |")
    print("|---:|---|---|---|---:|---|---|---|---|---|")
    encoders = ("own", "decoder") if args.decoder_as_encoder else ("own",)
    for target in args.at_l0:
        for name in sorted(n for n in latest if latest[n]["arch"] in BATCH_TOPK_KINDS):
            r = latest[name]
            for encoder in encoders:
                sae = load_sae(args.data / "saes" / name)[0]
                library = r["library"] if encoder == "own" else f"{r['library']}, decoder as encoder"
                factor, m = at_equal_l0(decoder_as_encoder(sae) if encoder == "decoder" else sae, gt, target)
                print(
                    f"| {target:g} | {r['arch']} | {library} | {r['precision']} | {factor:.2f} | "
                    f"{m['f1']:.3f} | {m['f1_chance']:.3f} | {m['l0']:.1f} | {m['fvu']:.3f} | "
                    f"{m['dead_fraction_eval']:.1%} |"
                )


def score_by_training_rule(
    args: argparse.Namespace, gt: dict[str, torch.Tensor], latest: dict[str, dict]
) -> None:
    """The threshold SAEs (BatchTopK, Matryoshka) of both libraries scored by their training rule
    over evaluation batches of --batch, as SynthSAEBench scores them (MCC reads only the decoder:
    the main table's)."""
    from assay.sae.ground_truth import BatchTopKEncoding, detection_metrics
    from assay.sae.saelens_format import load_sae

    k = true_k(args.data)
    print(
        f"\nby the training rule: the {k}·B largest activations of each evaluation batch of B = {args.batch}",
        flush=True,
    )
    print("| architecture | library | precision | F1 | F1 chance | L0 | FVU | dead (eval) |")
    print("|---|---|---|---|---|---|---|---|")
    for name in sorted(n for n in latest if latest[n]["arch"] in BATCH_TOPK_KINDS):
        r = latest[name]
        m = detection_metrics(BatchTopKEncoding(load_sae(args.data / "saes" / name)[0], k), gt, args.batch)
        print(
            f"| {r['arch']} | {r['library']} | {r['precision']} | {m['f1']:.3f} | {m['f1_chance']:.3f} | "
            f"{m['l0']:.1f} | {m['fvu']:.3f} | {m['dead_fraction_eval']:.1%} |"
        )


def score(args: argparse.Namespace) -> None:
    from assay.sae.ground_truth import load_ground_truth

    gt = load_ground_truth(args.data / "ground_truth.safetensors")
    runs = [json.loads(line) for line in (args.data / "runs.jsonl").read_text().splitlines()]
    latest = {r["name"]: r for r in runs}  # the last run of each name
    cache = args.data / "scores.json"
    scores = json.loads(cache.read_text()) if cache.exists() else {}
    for name in sorted(latest):
        stamp = (args.data / "saes" / name / "sae_weights.safetensors").stat().st_mtime
        cached = scores.get(name, {})
        if cached.get("stamp") != stamp or "f1_chance" not in cached:  # new, retrained or older scoring
            scores[name] = {**score_folder(args.data / "saes" / name, gt), "stamp": stamp}
            cache.write_text(json.dumps(scores, indent=1))
    true_l0 = json.loads((args.data / "eval" / "meta.json").read_text())["true_l0"]
    print(f"true L0 {true_l0:.1f}; k = {true_k(args.data)}; CPU {machine()['cpu']}")
    cols = ["architecture", "library", "precision", "MCC", "F1", "F1 chance", "L0", "FVU"]
    cols += ["dead (eval)", "dead (train)"]
    print("| " + " | ".join([*cols, "tokens/s"]) + " |")
    print("|---" * (len(cols) + 1) + "|")
    order = {a: i for i, a in enumerate(ARCHS)}
    for name in sorted(latest, key=lambda n: (order.get(latest[n]["arch"], 9), latest[n]["library"], n)):
        r, s = latest[name], scores[name]
        print(
            f"| {r['arch']} | {r['library']} | {r['precision']} | {s['mcc']:.3f} | {s['f1']:.3f} | "
            f"{s['f1_chance']:.3f} | {s['l0']:.1f} | {s['fvu']:.3f} | {s['dead']:.1%} | "
            f"{r['train_dead']:.1%} | {r['tokens_per_s']:,.0f} |"
        )
    if args.at_l0:
        score_at_l0(args, gt, latest)
    if args.training_rule:
        score_by_training_rule(args, gt, latest)
