"""One optimizer step of causal-LM fine-tuning, under the precision policy, in 1 or N processes.

Loss normalisation: an optimizer step's loss is the SUM of its token losses divided by the
number of loss-carrying tokens in the whole effective batch, so splitting a batch of 8 into
micro-batches (1x8, 4x2, ...) gives the same gradient (exactly, up to fp32 summation order),
and so does splitting it over data-parallel processes.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from assay.core import fsdp
from assay.core.distributed import Distributed
from assay.core.precision import PrecisionPolicy, full_precision
from assay.lm.data import Examples, collate
from assay.lm.losses import evaluate_losses, example_losses


def make_scaler(policy: PrecisionPolicy) -> Any:
    """Dynamic loss scaling for fp16 (None otherwise: bf16 has fp32's exponent range)."""
    if not policy.uses_loss_scaling:
        return None
    return torch.amp.GradScaler(policy.device.type)


def train_step(
    model: torch.nn.Module,
    examples: Examples,
    positions: np.ndarray,
    micro_batch_size: int,
    policy: PrecisionPolicy,
    pad_id: int,
    scaler: Any,
    weights: np.ndarray | None = None,
    weight_tokens: bool = True,
) -> tuple[float, float, int]:
    """Accumulate the effective batch's gradient; returns (summed loss, loss tokens, real tokens).

    Each micro-batch's summed token loss is divided by the whole batch's loss-token count,
    so the accumulated gradient is the token-mean gradient of the effective batch. With
    `weights` [len(examples)] (e.g. CRAIG's), example i's loss and tokens count w_i times: a
    weight of 2 trains exactly as the example twice in the batch. With `weight_tokens` False the
    token count stays the unweighted batch's and a weight scales only its example's loss term
    (the step loss the metagradients differentiate): a weight of 0 leaves the example out of an
    otherwise unchanged batch, and it is skipped.
    """
    positions = positions[np.argsort(-examples.lengths[positions], kind="stable")]  # less padding
    stand_in = positions[-1:]  # what a micro-batch of no examples runs, at weight 0
    counts = examples.num_loss_tokens()[positions].astype(np.float64)
    loss_tokens = float(counts.sum())  # the whole batch's
    if weights is not None and weight_tokens:
        loss_tokens = float((counts * weights[positions]).sum())
    elif weights is not None:
        positions = positions[weights[positions] != 0]  # nothing to add; a step of none runs one at 0
    # Data-parallel: each rank takes every world-th example (balanced lengths), so accumulation
    # steps per rank = effective / (micro x world); summing the ranks' gradients gives exactly
    # the one-process gradient (each micro-batch already divides by the global token count).
    dist = Distributed.current()
    mine = dist.interleave_array(positions)
    total, real = 0.0, 0
    for chunk in _micro_batches(mine, max(len(positions), 1), micro_batch_size, dist.world_size):
        weight = 1.0 if len(chunk) else 0.0  # a rank short of examples runs one with weight 0
        batch = collate(examples, chunk if len(chunk) else stand_in, pad_id, policy.device)
        with policy.autocast():
            losses = example_losses(model, batch)  # [b] fp32 summed token losses
        with full_precision(policy.device):
            if weights is not None and len(chunk):  # per-example weights, fp32
                losses = losses * torch.as_tensor(weights[chunk], dtype=losses.dtype, device=losses.device)
            loss = losses.sum() * weight / max(loss_tokens, 1)
        (scaler.scale(loss) if scaler is not None else loss).backward()
        total += float(losses.detach().sum()) * weight
        real += int(batch["attention_mask"].sum()) * int(weight)
    if not fsdp.is_sharded(model):  # FSDP reduce-scattered (summed, fp32) them in the backward
        dist.all_reduce_grads_(p for p in model.parameters() if p.requires_grad)  # fp32 sum, as DDP
    total, real_sum = dist.sum_scalars(total, real)
    return total, loss_tokens, int(real_sum)


def _micro_batches(mine: np.ndarray, n: int, micro: int, world: int) -> list[np.ndarray]:
    """This rank's micro-batches, padded with empty ones so that every rank runs as many as the
    rank with the largest share (ceil(n / world) examples): with --fsdp every forward and
    backward is a collective, and under DDP the extra pass costs only time a rank would wait."""
    largest = math.ceil(n / world)
    rounds = math.ceil(largest / micro)
    return [mine[i * micro : (i + 1) * micro] for i in range(rounds)]


def optimizer_update(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, scaler: Any, max_grad_norm: float, lr: float
) -> float:
    """Clip, step and zero the gradients; returns the (unscaled) global gradient norm."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if scaler is not None:
        scaler.unscale_(optimizer)
    limit = max_grad_norm if max_grad_norm > 0 else math.inf
    norm = float(fsdp.full_tensor(torch.nn.utils.clip_grad_norm_(params, limit, foreach=False)))
    if scaler is not None:
        scaler.step(optimizer)  # skips the step when the scaled gradients overflowed
        scaler.update()
    else:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return norm


def mean_loss(
    model: torch.nn.Module,
    examples: Examples,
    policy: PrecisionPolicy,
    pad_id: int,
    tbs: int,
    desc: str = "eval loss",
) -> float:
    """Token-weighted mean loss (nats/token), with the model in eval mode (`desc` labels the bar)."""
    model.eval()
    dist = Distributed.current()
    # Each rank evaluates its share and the loss sums are added up (fp64); with --fsdp every
    # forward is a collective, so every rank evaluates every example (in the same batches).
    if dist.active and not fsdp.is_sharded(model):
        mine = examples.subset(dist.interleave_array(np.arange(len(examples))))
        part = float(evaluate_losses(model, mine, policy, pad_id, tbs, desc=desc).sum()) if len(mine) else 0
        model.train()
        return dist.sum_scalars(part)[0] / max(int(examples.num_loss_tokens().sum()), 1)
    losses = evaluate_losses(model, examples, policy, pad_id, tbs, desc=desc)
    model.train()
    return float(losses.sum() / max(int(examples.num_loss_tokens().sum()), 1))
