"""Activations for SAE training: streamed from the model through a hook, or read from a disk cache.

Documents are packed into contexts of `context_length` tokens. A source returns the
activations of any list of contexts; `ShuffledBatches` turns a source into training
batches through a shuffling buffer. The order is a pure function of (seed, batch index):
buffer fill c holds contexts order[c*n:(c+1)*n] of a seeded per-epoch permutation, and
its rows are shuffled by a generator seeded with (seed, c). So a batch mixes tokens of
many documents, a resumed run sees exactly the batches it would have seen, and a cached
source yields the same batches as the streamed one.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from assay.core.errors import AssayError
from assay.core.precision import PrecisionPolicy
from assay.core.progress import Progress
from assay.core.runs import read_json, write_json
from assay.lm.hooks import StopForward, forward_hooks, get_module, output_tensor

CACHE_META = "meta.json"
CACHE_ARRAY = "activations.npy"


class ActivationSource(Protocol):
    n_contexts: int
    context_length: int
    d_in: int  # the row width: the sum of `widths`
    widths: list[int]  # the hookpoints' widths, side by side in a row

    def rows(self, contexts: np.ndarray) -> torch.Tensor:
        """[len(contexts) * context_length, d_in] fp32 activations, context-major."""
        ...


def pack_contexts(tokens: np.ndarray, context_length: int) -> np.ndarray:
    """[n, context_length] int64 windows of the concatenated token stream (remainder dropped)."""
    n = len(tokens) // context_length
    if n == 0:
        raise AssayError(f"the dataset has {len(tokens)} tokens, fewer than one context of {context_length}")
    return np.asarray(tokens[: n * context_length], dtype=np.int64).reshape(n, context_length)


@torch.no_grad()
def capture(model: Any, hookpoint: str, input_ids: torch.Tensor) -> torch.Tensor:
    """[B, T, d] output of module `hookpoint` on input_ids [B, T]; the forward stops there."""
    return capture_many(model, [hookpoint], input_ids)[0]


@torch.no_grad()
def capture_many(model: Any, hookpoints: Sequence[str], input_ids: torch.Tensor) -> list[torch.Tensor]:
    """[B, T, d_i] outputs of each module in `hookpoints` on input_ids [B, T], from one forward
    that stops once the last of them has run."""
    modules = {name: get_module(model, name) for name in hookpoints}
    got: dict[str, torch.Tensor] = {}

    def hook(name: str, _mod: Any, _inp: Any, out: Any) -> None:
        got[name] = output_tensor(out).detach()
        if len(got) == len(modules):
            raise StopForward

    with forward_hooks(modules, hook), contextlib.suppress(StopForward):
        model(input_ids=input_ids)
    missing = [name for name in modules if name not in got]
    if missing:
        raise AssayError(f"module {missing[0]!r} did not run in the model's forward")
    return [got[name] for name in hookpoints]


class LMActivations:
    """Activations streamed from the model, `batch_contexts` contexts per forward.

    With several hookpoints (a transcoder's input and output, or several SAEs trained from one
    pass) a row is their activations side by side: [d_1 | d_2 | ...], `widths` their sizes.
    """

    def __init__(
        self,
        model: Any,
        hookpoint: str | Sequence[str],
        contexts: np.ndarray,
        policy: PrecisionPolicy,
        autocast_lm: bool = False,
        batch_contexts: int = 32,
    ):
        self.model, self.hookpoint, self.contexts = model, hookpoint, contexts
        self.policy, self.autocast_lm, self.batch_contexts = policy, autocast_lm, batch_contexts
        self.hookpoints = [hookpoint] if isinstance(hookpoint, str) else list(hookpoint)
        self.n_contexts, self.context_length = contexts.shape
        self.widths: list[int] = []
        self.widths = [int(a.shape[-1]) for a in self._capture(contexts[:1])]
        self.d_in = sum(self.widths)

    def _capture(self, ctx_tokens: np.ndarray) -> list[torch.Tensor]:
        ids = torch.from_numpy(ctx_tokens).to(self.policy.device)
        region = self.policy.autocast() if self.autocast_lm else contextlib.nullcontext()
        with region:
            return capture_many(self.model, self.hookpoints, ids)

    def _forward(self, ctx_tokens: np.ndarray) -> torch.Tensor:
        parts = [a.float().reshape(-1, a.shape[-1]) for a in self._capture(ctx_tokens)]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)  # [B*T, sum of widths]

    def rows(self, contexts: np.ndarray) -> torch.Tensor:
        parts = [
            self._forward(self.contexts[contexts[i : i + self.batch_contexts]])
            for i in range(0, len(contexts), self.batch_contexts)
        ]
        return torch.cat(parts).cpu()


class CachedActivations:
    """Activations read back from a cache folder (one fp32 .npy memmap [n_contexts*T, d_in])."""

    def __init__(self, folder: Path | str):
        self.folder = Path(folder)
        self.meta = read_json(self.folder / CACHE_META)
        self.n_contexts = int(self.meta["n_contexts"])
        self.context_length = int(self.meta["context_length"])
        self.d_in = int(self.meta["d_in"])
        self.widths = [int(w) for w in self.meta.get("widths", [self.d_in])]  # hookpoints side by side
        flat = np.load(self.folder / CACHE_ARRAY, mmap_mode="r", allow_pickle=False)
        self.array = flat.reshape(self.n_contexts, self.context_length, self.d_in)

    def rows(self, contexts: np.ndarray) -> torch.Tensor:
        order = np.argsort(contexts, kind="stable")  # read the file forwards, then restore order
        block = np.empty((len(contexts), self.context_length, self.d_in), dtype=np.float32)
        block[order] = self.array[np.asarray(contexts)[order]]
        return torch.from_numpy(block.reshape(-1, self.d_in))


def write_cache(source: ActivationSource, folder: Path | str, key: dict[str, Any], chunk: int = 256) -> None:
    """Write every context of `source` into `folder` (atomically, via `folder.part`)."""
    folder = Path(folder)
    tmp = folder.with_name(folder.name + ".part")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    n, t, d = source.n_contexts, source.context_length, source.d_in
    out = np.lib.format.open_memmap(tmp / CACHE_ARRAY, mode="w+", dtype=np.float32, shape=(n * t, d))
    with Progress(n, "caching activations") as bar:
        for start in range(0, n, chunk):
            idx = np.arange(start, min(start + chunk, n))
            out[start * t : (start + len(idx)) * t] = source.rows(idx).numpy()
            bar.update(len(idx), len(idx) * t)
    out.flush()
    del out
    meta = {**key, "n_contexts": n, "context_length": t, "d_in": d, "dtype": "float32"}
    widths = list(getattr(source, "widths", [d]))
    if len(widths) > 1:  # several hookpoints side by side (older caches hold one)
        meta["widths"] = widths
    write_json(tmp / CACHE_META, meta)
    os.replace(tmp, folder)


def open_cache(folder: Path | str, key: dict[str, Any]) -> CachedActivations | None:
    """The cache in `folder` if it exists, after checking it was made with the same settings."""
    folder = Path(folder)
    if not (folder / CACHE_META).exists():
        if folder.exists() and any(folder.iterdir()):
            raise AssayError(f"{folder} exists but is not an activation cache; choose another folder")
        return None
    cache = CachedActivations(folder)
    stale = {k: (cache.meta.get(k), v) for k, v in key.items() if cache.meta.get(k) != v}
    if stale:
        what = ", ".join(f"{k}: cached {a!r} vs asked {b!r}" for k, (a, b) in stale.items())
        raise AssayError(
            f"activation cache {folder} was made with other settings ({what}); use another folder"
        )
    return cache


class ShuffledBatches:
    """Training batches [batch_tokens, d_in] from a source through a shuffling buffer."""

    def __init__(self, source: ActivationSource, batch_tokens: int, buffer_batches: int, seed: int):
        self.source, self.batch_tokens, self.seed = source, batch_tokens, seed
        t = source.context_length
        wanted = -(-buffer_batches * batch_tokens // t)  # contexts per buffer fill
        self.contexts_per_fill = min(wanted, source.n_contexts)
        self.batches_per_fill = self.contexts_per_fill * t // batch_tokens
        if self.batches_per_fill == 0:
            raise AssayError(
                f"only {source.n_contexts * t} tokens of activations, fewer than one batch of "
                f"{batch_tokens}; use more data or a smaller --batch_tokens"
            )
        self.fills_per_epoch = source.n_contexts // self.contexts_per_fill

    def fill_contexts(self, fill: int) -> np.ndarray:
        """Context indices of buffer fill `fill` (epochs are fresh permutations)."""
        epoch, slot = divmod(fill, self.fills_per_epoch)
        order = np.random.default_rng([self.seed, epoch]).permutation(self.source.n_contexts)
        return order[slot * self.contexts_per_fill : (slot + 1) * self.contexts_per_fill]

    def fill(self, fill: int) -> torch.Tensor:
        """[batches_per_fill * batch_tokens, d_in] shuffled rows of one buffer fill."""
        acts = self.source.rows(self.fill_contexts(fill))
        perm = torch.from_numpy(np.random.default_rng([self.seed, 1_000_003, fill]).permutation(len(acts)))
        return acts[perm[: self.batches_per_fill * self.batch_tokens]]

    def iterate(self, start_batch: int = 0) -> Iterator[torch.Tensor]:
        """Batches from index `start_batch` on, forever (epochs repeat the data)."""
        fill, offset = divmod(start_batch, self.batches_per_fill)
        while True:
            rows = self.fill(fill)
            for b in range(offset, self.batches_per_fill):
                yield rows[b * self.batch_tokens : (b + 1) * self.batch_tokens]
            fill, offset = fill + 1, 0
