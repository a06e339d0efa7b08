"""A thin torch.distributed helper that is a no-op in a single process.

Code calls `dist = Distributed.from_env()` once and then uses `dist.rank`, `dist.shard`,
`dist.all_reduce_` and friends unconditionally: one code path for 1 or N processes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as tdist


@dataclass(frozen=True)
class Distributed:
    """Rank and world size; collectives become no-ops when world_size is 1."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @classmethod
    def from_env(cls, device: torch.device | None = None) -> Distributed:
        """Join the process group torchrun set up (gloo on CPU, NCCL on CUDA), if any."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world == 1:
            return cls()
        if not tdist.is_initialized():
            backend = "nccl" if device is not None and device.type == "cuda" else "gloo"
            tdist.init_process_group(backend)
        return cls(tdist.get_rank(), tdist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0")))

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def all_reduce_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` over ranks in place (and return it)."""
        if self.world_size > 1:
            tdist.all_reduce(tensor)
        return tensor

    def barrier(self) -> None:
        if self.world_size > 1:
            tdist.barrier()

    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's value of `obj` on every rank."""
        if self.world_size == 1:
            return obj
        box = [obj]
        tdist.broadcast_object_list(box, src=0)
        return box[0]

    def shard(self, items: list[Any]) -> list[Any]:
        """This rank's share of `items`, padded by repeating the last item so every rank
        takes the same number of steps (collectives never wait on a rank that finished).
        Callers drop repeated items by position."""
        if self.world_size == 1:
            return list(items)
        per_rank = -(-len(items) // self.world_size)
        mine = items[self.rank * per_rank : (self.rank + 1) * per_rank]
        return mine + [items[-1]] * (per_rank - len(mine)) if items else mine
