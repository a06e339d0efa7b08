"""One torch.distributed helper for every command; a no-op in a single process.

Code asks for `dist = Distributed.current()` and uses it unconditionally: one code path for
1 or N processes (`torchrun --nproc_per_node N -m assay ...`). The process group is joined
once, from torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT): gloo on
CPU, NCCL when CUDA is available (each process then uses the GPU `LOCAL_RANK`).

Numerics: floating-point reductions run in fp32 (bf16/fp16 tensors are upcast, reduced and
cast back); scalar statistics (loss sums, token counts) in fp64. Work is split so every rank
takes the same number of steps: `shard` pads a short share with `None`, and a loop that joins
collectives must still join them for a `None` item (see finetune's and sae's loops).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import torch
import torch.distributed as tdist

from assay.core.errors import AssayError

T = TypeVar("T")
_CURRENT: Distributed | None = None


@dataclass(frozen=True)
class Distributed:
    """Rank and world size; every collective is a no-op when world_size is 1."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    # ---- setup -------------------------------------------------------------------------------
    @classmethod
    def current(cls) -> Distributed:
        """The process's helper, joining torchrun's process group on first use."""
        global _CURRENT
        if _CURRENT is None:
            _CURRENT = cls.from_env()
        return _CURRENT

    @classmethod
    def from_env(cls, device: torch.device | None = None) -> Distributed:
        """Join the process group torchrun set up (gloo on CPU, NCCL on CUDA), if any."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world == 1:
            return cls()
        local = int(os.environ.get("LOCAL_RANK", "0"))
        cuda = torch.cuda.is_available() if device is None else device.type == "cuda"
        if not tdist.is_initialized():
            if cuda:
                torch.cuda.set_device(local)  # "cuda" then means this process's GPU
            tdist.init_process_group("nccl" if cuda else "gloo")
        return cls(tdist.get_rank(), tdist.get_world_size(), local)

    @staticmethod
    @contextmanager
    def alone() -> Iterator[None]:
        """Inside the block this process is a world of one: every collective is a no-op. For jobs
        that each rank runs independently (`assay validate` retrains one subset per rank)."""
        global _CURRENT
        saved = Distributed.current()
        _CURRENT = Distributed()
        try:
            yield
        finally:
            _CURRENT = saved

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def active(self) -> bool:
        return self.world_size > 1

    def _device(self) -> torch.device:
        """Where collectives' buffers live (NCCL needs CUDA tensors)."""
        if self.active and tdist.get_backend() == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    # ---- splitting work ----------------------------------------------------------------------
    def shard(self, items: Sequence[T]) -> list[T | None]:
        """This rank's contiguous share of `items`, padded with None to ceil(n / world) items,
        so every rank runs the same number of steps (collectives never wait on a rank that
        finished). Rank r gets items[r*k : (r+1)*k]."""
        if not self.active:
            return list(items)
        per_rank = -(-len(items) // self.world_size)
        mine: list[T | None] = list(items[self.rank * per_rank : (self.rank + 1) * per_rank])
        return mine + [None] * (per_rank - len(mine))

    def interleave(self, items: Sequence[T]) -> list[T]:
        """items[rank::world] (unpadded): for work without collectives inside, or to balance
        a length-sorted list (each rank gets short and long items alike)."""
        return list(items[self.rank :: self.world_size])

    def interleave_padded(self, items: Sequence[T]) -> list[T | None]:
        """items[rank::world] padded with None to ceil(n / world) items: balanced like
        `interleave`, and every rank takes the same number of steps like `shard`."""
        if not self.active:
            return list(items)
        mine: list[T | None] = list(items[self.rank :: self.world_size])
        return mine + [None] * (-(-len(items) // self.world_size) - len(mine))

    def interleave_array(self, array: np.ndarray) -> np.ndarray:
        """array[rank::world] (a view; the whole array in one process)."""
        return array[self.rank :: self.world_size]

    def rank_file(self, name: str) -> str:
        """A per-rank file name ("progress.json" -> "progress.rank1-of-2.json"); unchanged in
        one process. The world size is in the name, so a resume with another world size
        starts that record afresh instead of misreading it."""
        if not self.active:
            return name
        stem, dot, ext = name.rpartition(".")
        return f"{stem}.rank{self.rank}-of-{self.world_size}{dot}{ext}"

    @contextmanager
    def main_first(self) -> Iterator[None]:
        """Rank 0 runs the block first (e.g. creates a file); the others run it after."""
        if not self.is_main:
            self.barrier()
        yield
        if self.is_main:
            self.barrier()

    # ---- collectives -------------------------------------------------------------------------
    def all_reduce_(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Reduce `tensor` over ranks in place ("sum", "max", "min", "mean"), in fp32 at least."""
        if not self.active:
            return tensor
        floating = tensor.dtype.is_floating_point
        dtype = torch.promote_types(tensor.dtype, torch.float32) if floating else tensor.dtype
        work = tensor.detach().to(self._device(), dtype)
        red = {"sum": tdist.ReduceOp.SUM, "mean": tdist.ReduceOp.SUM, "max": tdist.ReduceOp.MAX}
        tdist.all_reduce(work, red.get(op, tdist.ReduceOp.MIN))
        if op == "mean":
            work /= self.world_size
        with torch.no_grad():
            tensor.copy_(work)
        return tensor

    def sum_scalars(self, *values: float) -> list[float]:
        """Sums over ranks of a few Python numbers (fp64), in one collective."""
        if not self.active:
            return [float(v) for v in values]
        t = torch.tensor(values, dtype=torch.float64, device=self._device())
        tdist.all_reduce(t)
        return [float(v) for v in t.cpu()]

    def all_reduce_grads_(self, params: Iterable[torch.nn.Parameter], op: str = "sum") -> None:
        """Reduce the gradients of `params` (a missing gradient counts as zeros), flattened
        into one fp32 buffer per call so N small tensors cost one collective."""
        if not self.active:
            return
        params = [p for p in params if p.requires_grad]
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        if not grads:
            return
        flat = torch.cat([g.detach().reshape(-1).to(self._device(), torch.float32) for g in grads])
        self.all_reduce_(flat, op)
        offset = 0
        for p, g in zip(params, grads, strict=True):
            n = g.numel()
            p.grad = flat[offset : offset + n].view_as(g).to(g.device, g.dtype)
            offset += n

    def broadcast_module_(self, module: torch.nn.Module) -> None:
        """Rank 0's parameters and buffers on every rank (as DDP does at construction)."""
        if not self.active:
            return
        with torch.no_grad():
            for t in [*module.parameters(), *module.buffers()]:
                work = t.detach().to(self._device())
                tdist.broadcast(work, src=0)
                t.copy_(work)

    def barrier(self) -> None:
        if self.active:
            tdist.barrier()

    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's value of `obj` on every rank."""
        if not self.active:
            return obj
        box = [obj]
        tdist.broadcast_object_list(box, src=0)
        return box[0]

    def gather(self, obj: T) -> list[T]:
        """Every rank's `obj`, in rank order, on every rank."""
        if not self.active:
            return [obj]
        out: list[Any] = [None] * self.world_size
        tdist.all_gather_object(out, obj)
        return out

    def main_only(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on rank 0 alone (cheap work that writes shared files); every rank returns
        rank 0's result, or raises the AssayError rank 0 hit (none waits forever)."""
        result = self._together(fn, args, self.is_main)
        return self.broadcast_object(result)

    def on_every_rank(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on every rank (each its own share of some work); if any rank hits an
        AssayError, every rank raises it (none waits forever at the next collective)."""
        return self._together(fn, args, True)  # type: ignore[return-value]

    def _together(self, fn: Callable[..., T], args: tuple[Any, ...], run_here: bool) -> T | None:
        """fn(*args) where run_here, then the first AssayError of any rank raised on all of them."""
        result, error = None, None
        if run_here:
            try:
                result = fn(*args)
            except AssayError as e:
                error = str(e)
        error = self.agree(error)
        if error:
            raise AssayError(error)
        return result

    def agree(self, error: str | None) -> str | None:
        """The first error any rank hit (or None): lets every rank raise the same AssayError
        instead of some ranks waiting forever at the next collective."""
        if not self.active:
            return error
        errors = [e for e in self.gather(error) if e]
        return errors[0] if errors else None


def finish_process_group() -> None:
    """After a successful run: wait for every rank, then tear the process group down."""
    if tdist.is_available() and tdist.is_initialized():
        tdist.barrier()
        tdist.destroy_process_group()
