"""FSDP2 (`fully_shard`) for models that do not fit on one device: the one place that shards.

`shard_model` shards every decoder block, then the root (embeddings, final norm, head), over
all torchrun processes: each process keeps 1/W of every parameter and gathers one block's
full weights only while that block runs (forward and backward). Training stays data parallel
(each rank its own examples); FSDP reduce-scatters the gradients itself, so callers must not
all-reduce them again.

Precision: no FSDP MixedPrecisionPolicy for compute; the project's autocast over fp32 master
weights runs inside the sharded blocks as it does without FSDP. Only the gradient reduction
dtype is pinned to fp32 (as every other reduction in assay), which matters for bf16-pure.

Sharded parameters are DTensors; `full_tensor` (an all-gather: every rank calls it) and `like`
convert between them and plain whole tensors for saving and loading.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as tdist
from torch import nn

from assay.core.distributed import Distributed
from assay.core.errors import AssayError

if TYPE_CHECKING:
    from torch.distributed.fsdp import FSDPModule  # lazy: FSDP loads only when sharding


def require_processes(dist: Distributed) -> None:
    """--fsdp shards over torchrun's processes: one process has nothing to shard over."""
    if not dist.active:
        raise AssayError(
            "--fsdp shards the model over torchrun's processes; launch with "
            "`torchrun --nproc_per_node N -m assay ...` (N >= 2), or drop --fsdp in one process"
        )


def decoder_blocks(model: nn.Module) -> nn.ModuleList:
    """The model's list of repeated decoder blocks: the nn.ModuleList holding most parameters
    (`model.layers` in Llama, `transformer.h` in GPT-2; found the same way under a PEFT wrapper)."""
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) > 0]
    if not lists:
        raise AssayError("--fsdp found no list of decoder blocks in this model; run it without --fsdp")
    return max(lists, key=lambda m: sum(p.numel() for p in m.parameters()))


def shard_model(model: nn.Module, dist: Distributed) -> nn.Module:
    """Shard `model` in place: each decoder block is one FSDP unit, the rest is the root unit.

    Gradients are summed over ranks (divide factor 1), not averaged: assay's losses are already
    divided by the whole batch's token count, exactly as for the hand-written DDP reduction.
    """
    from torch.distributed.device_mesh import init_device_mesh  # lazy: FSDP loads only when sharding
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # lazy: as above

    require_processes(dist)
    # FSDP warns that a model returning a view (HF logits) loses its backward hook if the view
    # is then modified in place; assay's losses never modify model outputs in place.
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")

    device = "cuda" if tdist.get_backend() == "nccl" else "cpu"  # where Distributed put this rank
    mesh = init_device_mesh(device, (dist.world_size,))
    policy = MixedPrecisionPolicy(reduce_dtype=torch.float32)  # compute: the project's autocast
    for block in decoder_blocks(model):
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    for unit in _units(model):
        unit.set_gradient_divide_factor(1.0)
        unit.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
    return model


def _units(model: nn.Module) -> list[FSDPModule]:
    from torch.distributed.fsdp import FSDPModule  # lazy: FSDP loads only when sharding

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


@contextmanager
def same_batch_on_every_rank(model: nn.Module) -> Iterator[None]:
    """Inside the block every rank runs the SAME batches (sharded weights, no data split):
    gradients are averaged over ranks, so they equal one process's. A no-op when not sharded."""
    units = _units(model)
    for unit in units:
        unit.set_gradient_divide_factor(float(Distributed.current().world_size))
    try:
        yield
    finally:
        for unit in units:
            unit.set_gradient_divide_factor(1.0)


def is_sharded(model: nn.Module) -> bool:
    """Whether `shard_model` sharded this model."""
    from torch.distributed.fsdp import FSDPModule  # lazy: FSDP loads only when sharding

    return isinstance(model, FSDPModule)


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a sharded DTensor (an all-gather: every rank calls); else `t`."""
    from torch.distributed.tensor import DTensor  # lazy: FSDP loads only when sharding

    return t.full_tensor() if isinstance(t, DTensor) else t


def like(param: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """`full` (a whole tensor every rank holds) laid out as `param`: this rank's shard of it
    when `param` is sharded, else `full` itself, in `param`'s dtype and device."""
    from torch.distributed.tensor import DTensor, distribute_tensor  # lazy: as above

    if isinstance(param, DTensor):
        whole = full.to(param.to_local().device, param.dtype)
        # src_data_rank=None: every rank holds `full` already, so each slices its own shard
        return distribute_tensor(whole, param.device_mesh, param.placements, src_data_rank=None)
    return full.to(param.device, param.dtype)


def full_state_dict(model: nn.Module) -> dict[str, Any]:
    """Every weight of a sharded model, whole, on CPU, on rank 0 (empty on the others): what
    `save_pretrained` writes. A collective: every rank calls it."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
    )  # lazy: as above

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=options)
