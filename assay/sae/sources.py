"""Where `assay sae train` reads activations from: the model streamed through hooks, or the
activation cache, split over data-parallel ranks.

A transcoder's source captures two hookpoints in one forward; a row holds the input's and
the target's activations side by side ([d_in | d_out], `source.widths`).
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import replace
from typing import Any

import numpy as np
import torch

from assay.core.config import DataConfig, is_single_file
from assay.core.console import note
from assay.core.distributed import Distributed
from assay.core.errors import AssayError
from assay.core.precision import PrecisionPolicy
from assay.lm.data import load_examples
from assay.lm.models import load_model, load_tokenizer, model_fingerprint
from assay.sae.activations import LMActivations, open_cache, pack_contexts, write_cache
from assay.sae.config import SaeTrainConfig


def hookpoints(cfg: SaeTrainConfig) -> list[str]:
    """The modules captured, in row order: the hookpoint (a transcoder's input) then its target,
    or every one of --hookpoints."""
    if cfg.hookpoint_out:
        return [cfg.hookpoint, cfg.hookpoint_out]
    return list(dict.fromkeys(cfg.hookpoints or [cfg.hookpoint]))


def build_data(cfg: SaeTrainConfig, policy: PrecisionPolicy) -> tuple[Any, Any, np.ndarray, dict[str, str]]:
    """(model, training activation source, held-out contexts [n, T], fingerprints of the inputs:
    what a resumed run must find unchanged) for a config."""
    tokenizer = load_tokenizer(cfg.model)
    model = load_model(cfg.model, PrecisionPolicy.resolve("fp32", policy.device), cfg.runtime.attention)
    if cfg.compile_lm:
        model = torch.compile(model)
    contexts, eval_contexts = split_contexts(cfg, tokenizer)
    contexts = contexts[: -(-cfg.training_tokens // cfg.context_length)]
    digest = hashlib.sha256(np.ascontiguousarray(contexts, dtype=np.int64).tobytes())
    digest.update(np.ascontiguousarray(eval_contexts, dtype=np.int64).tobytes())
    inputs = {"dataset": digest.hexdigest()[:16], "model": model_fingerprint(model)}
    hooks = hookpoints(cfg)
    source: Any = LMActivations(
        model, hooks if len(hooks) > 1 else hooks[0], contexts, policy, cfg.autocast_lm, cfg.lm_batch_contexts
    )
    if cfg.cache_activations:
        source = cached(cfg, model, source, cfg.cache_activations)
    return model, rank_share(source, Distributed.current()), eval_contexts, inputs


def held_out_data(cfg: SaeTrainConfig) -> DataConfig | None:
    """The held-out data (--eval_dataset, or --eval_split of --dataset); None when --dataset is a
    single file and no --eval_dataset is given: its last contexts are held out instead."""
    if cfg.eval_dataset is not None:
        split = "train" if is_single_file(cfg.eval_dataset) else cfg.eval_split
        return replace(cfg.data, dataset=cfg.eval_dataset, split=split)
    if is_single_file(cfg.data.dataset):
        return None
    return replace(cfg.data, split=cfg.eval_split)


def split_contexts(cfg: SaeTrainConfig, tokenizer: Any) -> tuple[np.ndarray, np.ndarray]:
    """(training contexts [n, T], held-out contexts [m, T]): never the same tokens."""
    _, train_ex = load_examples(cfg.data, tokenizer)
    contexts = pack_contexts(train_ex.tokens, cfg.context_length)
    empty = np.zeros((0, cfg.context_length), dtype=np.int64)
    if cfg.eval_contexts == 0:
        return contexts, empty
    held = held_out_data(cfg)
    if held is not None:
        _, eval_ex = load_examples(held, tokenizer)
        return contexts, pack_contexts(eval_ex.tokens, cfg.context_length)[: cfg.eval_contexts]
    if len(contexts) <= cfg.eval_contexts:
        raise AssayError(
            f"{cfg.data.dataset} holds {len(contexts)} contexts of {cfg.context_length} tokens, too few "
            f"to hold {cfg.eval_contexts} out; give --eval_dataset FILE or fewer --eval_contexts"
        )
    return contexts[: -cfg.eval_contexts], contexts[-cfg.eval_contexts :]


def rank_share(source: Any, dist: Distributed) -> Any:
    """Data-parallel: this rank's own stream, every world-th context (the source in one process)."""
    if not dist.active:
        return source

    @dataclasses.dataclass
    class Share:
        n_contexts: int
        context_length: int
        d_in: int
        widths: list[int]
        mine: np.ndarray

        def rows(self, contexts: np.ndarray) -> Any:
            return source.rows(self.mine[contexts])

    mine = dist.interleave_array(np.arange(source.n_contexts))
    return Share(len(mine), source.context_length, source.d_in, list(source.widths), mine)


def cached(cfg: SaeTrainConfig, model: Any, source: Any, folder: str) -> Any:
    """The activation cache (written by rank 0 under torchrun; the other ranks then read it)."""
    with Distributed.current().main_first():
        hooks = hookpoints(cfg)
        key = {
            "model": model_fingerprint(model),
            "hookpoint": hooks[0] if len(hooks) == 1 else hooks,
            "dataset": [cfg.data.dataset, cfg.data.split, cfg.data.max_samples, cfg.data.max_length],
            "autocast_lm": cfg.autocast_lm,
        }
        cache = open_cache(folder, {**key, "context_length": cfg.context_length})
        if cache is None or cache.n_contexts < source.n_contexts:
            if cache is not None:
                raise_small_cache(folder, cache.n_contexts, source.n_contexts)
            write_cache(source, folder, key)
            cache = open_cache(folder, key)
        assert cache is not None
        note(f"activations from cache {folder} ({cache.n_contexts:,} contexts)")
    return cache


def raise_small_cache(folder: str, have: int, want: int) -> None:
    raise AssayError(
        f"activation cache {folder} holds {have} contexts but this run reads {want}; use another folder"
    )
