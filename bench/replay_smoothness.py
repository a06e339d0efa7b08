"""How smooth must a fine-tune be for its exact metagradient to predict dropping data? LDS of
replay scores against removal by weight, per Adam ε and learning rate, on a small run.

Each setting fine-tunes assay-tiny (fp32) on the first --pool tunes of a jsonl (e.g. an
`assay validate --preset abc` experiment's data/pool.jsonl) with AdamW (linear warm-up over 10%
of the steps, cosine decay, clipping at 1.0, effective batch 8, 2 epochs), replayed; scores each
of the first --queries query tunes by its exact metagradient (from --first_step on); then trains
--subsets random α-subsets by weight (the same run with the left-out examples' loss weights at
0: what the metagradient differentiates, `assay validate --removal weight`) and measures the
queries' summed losses under each; prints the LDS of the scores and the spread of the outputs.
With `--precisions fp32 bf16` each setting is also trained and replayed under bf16 autocast (fp32
weights, the retrainings in bf16 too), and the two precisions' scores are compared.

    python bench/replay_smoothness.py lds-w95/data --pool 64 --queries 4 --eps 1e-8 1e-6 1e-4
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch

from assay.core.config import DataConfig, ModelConfig
from assay.core.precision import PrecisionPolicy
from assay.counterfactual.lds import linear_datamodel_score, sample_subsets, spearman
from assay.counterfactual.metagradient import lm_loss_fns, metagradients, objective_gradients
from assay.counterfactual.replay import AdamWSettings, Replay, TrainingRun, balanced_interval, finetune_order
from assay.lm.data import Examples, load_examples
from assay.lm.models import load_model, load_tokenizer
from assay.training.recipe import TrainRecipe
from assay.training.subset import shuffled_plan


def training_run(pool: Examples, recipe: TrainRecipe, pad: int, policy: PrecisionPolicy) -> TrainingRun:
    """The recipe's steps over `pool` in assay finetune's order (seed 0), as a replayable run."""
    steps = recipe.steps(shuffled_plan(pool.ids, recipe.num_epochs, 0))
    position = {int(i): p for p, i in enumerate(pool.ids)}
    ordered = [finetune_order(pool.lengths, np.array([position[int(i)] for i in ids])) for _, ids in steps]
    opt = AdamWSettings(tuple(recipe.learning_rates(len(ordered))), recipe.adam_betas, recipe.adam_eps,
                        recipe.weight_decay, recipe.max_grad_norm)  # fmt: skip
    loss_fn, curvature = lm_loss_fns(pool, pad, "cpu")
    return TrainingRun(ordered, pool.num_loss_tokens(), loss_fn, opt, recipe.micro_batch_size, policy,
                       curvature_loss_fn=curvature, curvature_micro_batch_size=2)  # fmt: skip


def measure(
    args: argparse.Namespace,
    pool: Examples,
    queries: Examples,
    pad: int,
    lr: float,
    eps: float,
    precision: str,
) -> tuple[str, np.ndarray]:
    """One setting's LDS line, and its scores [Q, N]."""
    policy = PrecisionPolicy.resolve(precision, "cpu")
    recipe = TrainRecipe(learning_rate=lr, adam_eps=eps, num_epochs=2, effective_batch_size=8,
                         micro_batch_size=8, warmup_ratio=0.1)  # fmt: skip
    run = training_run(pool, recipe, pad, policy)
    model = load_model(ModelConfig(model="assay-tiny"), policy).train()
    replay = Replay(model, run, checkpoint_every=balanced_interval(len(run.steps)))
    start = time.perf_counter()
    replay.forward()
    query_loss, _ = lm_loss_fns(queries, pad, "cpu")
    everything = np.arange(len(queries))
    grads = objective_gradients(replay.model, query_loss, [np.array([q]) for q in everything], policy)
    scores = -metagradients(replay, grads, first_step=args.first_step).numpy()  # [Q, N]
    masks = sample_subsets(len(pool), args.subsets, args.alpha, 0)
    outputs = np.zeros((args.subsets, len(queries)))
    for m, mask in enumerate(masks):
        replay.forward(torch.as_tensor(mask, dtype=torch.float32))
        with torch.no_grad(), policy.autocast():
            outputs[m] = query_loss(replay.model, everything).double().numpy()
    lds = linear_datamodel_score(scores, masks, outputs)
    return (
        f"{precision} lr {lr:g} eps {eps:g}: LDS {lds.mean:.3f} [{lds.ci_low:.3f}, {lds.ci_high:.3f}] "
        f"per query {np.round(lds.per_query, 2).tolist()}; output spread over subsets "
        f"{outputs.std(0).mean():.3f} nats; {time.perf_counter() - start:.0f} s"
    ), scores


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("data", type=Path, help="a folder with pool.jsonl and query.jsonl (text column)")
    ap.add_argument("--pool", type=int, default=64)
    ap.add_argument("--queries", type=int, default=4)
    ap.add_argument("--max_length", type=int, default=128)
    ap.add_argument("--subsets", type=int, default=16)
    ap.add_argument("--alpha", type=float, default=0.9)
    ap.add_argument("--first_step", type=int, default=0)
    ap.add_argument("--lrs", type=float, nargs="+", default=[1e-3])
    ap.add_argument("--eps", type=float, nargs="+", default=[1e-8, 1e-6, 1e-4])
    ap.add_argument(
        "--precisions",
        nargs="+",
        default=["fp32"],
        choices=["fp32", "bf16"],
        help="the run's precision (bf16: autocast over fp32 weights, replayed as trained)",
    )
    args = ap.parse_args()
    torch.manual_seed(0)
    tokenizer = load_tokenizer(ModelConfig(model="assay-tiny"))
    pad = tokenizer.pad_token_id
    _, pool = load_examples(DataConfig(dataset=str(args.data / "pool.jsonl"), max_length=args.max_length,
                                       max_samples=args.pool), tokenizer)  # fmt: skip
    _, queries = load_examples(DataConfig(dataset=str(args.data / "query.jsonl"), max_length=args.max_length,
                                          max_samples=args.queries), tokenizer)  # fmt: skip
    print(f"{len(pool)} pool tunes, {len(queries)} queries, {args.subsets} subsets of α = {args.alpha}")
    for lr in args.lrs:
        for eps in args.eps:
            scores = {}
            for precision in args.precisions:
                line, scores[precision] = measure(args, pool, queries, pad, lr, eps, precision)
                print(line, flush=True)
            if len(scores) == 2:
                print(agreement(scores["bf16"], scores["fp32"]), flush=True)


def agreement(low: np.ndarray, ref: np.ndarray) -> str:
    """How far one precision's scores [Q, N] are from another's: per-query rank correlation,
    relative error, and the overlap of each query's top 10%."""
    rho = spearman(low.T, ref.T)  # [Q]
    top = max(1, ref.shape[1] // 10)
    overlap = [
        len(set(np.argsort(-a)[:top]) & set(np.argsort(-b)[:top])) / top
        for a, b in zip(low, ref, strict=True)
    ]
    rel = np.linalg.norm(low - ref) / np.linalg.norm(ref)
    return (
        f"bf16 vs fp32 scores: Spearman per query {np.round(rho, 3).tolist()} (mean {np.mean(rho):.3f}), "
        f"relative error {rel:.3f}, top-10% overlap {np.mean(overlap):.0%}"
    )


if __name__ == "__main__":
    main()
