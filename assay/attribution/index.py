"""The on-disk gradient index: a memory-mapped [N, D] matrix plus JSON metadata.

Layout of an index folder (see docs/index-format.md):
    index.json                 metadata (modules and their column slices, projection, precision, ...)
    gradients.npy              [N, D] store dtype, row i = example ids[i]
    ids.npy / losses.npy / tokens.npy   [N] int64 / float32 / int64
    norms.npy                  [N] float32 L2 norm of each stored row (indexes built since it exists)
    normalizer.safetensors     optional, fp32
    preconditioner.safetensors optional, fp32 sums of g gᵀ per module + "__count__"
    kfac.safetensors           optional (--preconditioner kfac|ekfac): K-FAC eigenbases (+ EK-FAC Λ)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from assay.attribution.kfac import KronFactors, load_factors
from assay.core.errors import AssayError
from assay.core.runs import DONE_FILE, read_json

META_FILE = "index.json"
GRADIENTS_FILE = "gradients.npy"
IDS_FILE = "ids.npy"
LOSSES_FILE = "losses.npy"
TOKENS_FILE = "tokens.npy"
NORMS_FILE = "norms.npy"
NORMALIZER_FILE = "normalizer.safetensors"
PRECONDITIONER_FILE = "preconditioner.safetensors"
KFAC_FILE = "kfac.safetensors"
FORMAT_VERSION = 1


@dataclass
class GradientIndex:
    """An opened index. `gradients` is a read-only memmap: rows are read on demand."""

    path: Path
    gradients: np.ndarray  # memmap [N, D]
    modules: dict[str, slice]  # module name -> columns
    ids: np.ndarray  # [N] int64
    losses: np.ndarray  # [N] float32 summed loss
    token_counts: np.ndarray  # [N] int64 loss-carrying tokens
    meta: dict[str, Any]
    row_norms: np.ndarray | None = None  # [N] float32 ‖stored row‖ (None: an index from before norms.npy)

    def __len__(self) -> int:
        return int(self.gradients.shape[0])

    @property
    def dim(self) -> int:
        return int(self.gradients.shape[1])

    def module_shapes(self) -> dict[str, tuple[int, int]]:
        """Stored block shape of each module ((p, p), or the weight's layout when raw)."""
        return {m["name"]: tuple(m["shape"]) for m in self.meta["modules"]}

    def preconditioner_stats(self) -> tuple[dict[str, torch.Tensor], int]:
        """Per-module fp32 [d_m, d_m] sums of g gᵀ over the stats sample, and the count summed."""
        path = self.path / PRECONDITIONER_FILE
        if not path.exists():
            raise AssayError(
                f"{self.path} has no preconditioner statistics; rebuild it with --preconditioner trackstar"
            )
        from safetensors.torch import load_file

        tensors = load_file(str(path))
        count = int(tensors.pop("__count__").item())
        return {k: v.to(torch.float32) for k, v in tensors.items()}, count

    def kfac_factors(self) -> KronFactors | None:
        """The K-FAC / EK-FAC factors the index was built with (None when it was built without)."""
        if self.meta.get("preconditioner") not in ("kfac", "ekfac"):
            return None
        path = self.path / KFAC_FILE
        if not path.exists():
            raise AssayError(
                f"{self.path} says it was built with {self.meta['preconditioner']} but has no {KFAC_FILE}"
            )
        return load_factors(path)

    def normalizer_tensors(self) -> dict[str, torch.Tensor]:
        """The fp32 normalizer tensors the index was built with (empty when none)."""
        path = self.path / NORMALIZER_FILE
        if not path.exists():
            return {}
        from safetensors.torch import load_file

        return dict(load_file(str(path)))


def module_slices(meta: dict[str, Any]) -> dict[str, slice]:
    return {m["name"]: slice(int(m["start"]), int(m["stop"])) for m in meta["modules"]}


def open_index(path: Path | str) -> GradientIndex:
    """Open a finished index (memory-mapped). Clear errors for incomplete or foreign folders."""
    path = Path(path)
    if not path.exists():
        part = path.with_name(path.name + ".part")
        if part.exists():
            raise AssayError(
                f"{path} is not finished yet ({part} exists); rerun `assay build` to complete it"
            )
        raise AssayError(f"no index at {path}")
    if not (path / META_FILE).exists():
        raise AssayError(f"{path} is not a gradient index (no {META_FILE}); build one with `assay build`")
    if not (path / DONE_FILE).exists():
        raise AssayError(f"{path} is an incomplete index; rerun `assay build` with the same arguments")
    meta = read_json(path / META_FILE)
    try:
        grads = np.load(path / GRADIENTS_FILE, mmap_mode="r", allow_pickle=False)
        ids = np.load(path / IDS_FILE, allow_pickle=False)
        losses = np.load(path / LOSSES_FILE, allow_pickle=False)
        tokens = np.load(path / TOKENS_FILE, allow_pickle=False)
        norms = np.load(path / NORMS_FILE, allow_pickle=False) if (path / NORMS_FILE).exists() else None
    except (FileNotFoundError, ValueError) as e:
        raise AssayError(f"{path} is a damaged index: {e}") from None
    if grads.shape != (meta["num_examples"], meta["dim"]) or len(ids) != grads.shape[0]:
        raise AssayError(f"{path} is a damaged index: shapes disagree with {META_FILE}")
    if norms is not None and norms.shape != (len(ids),):
        raise AssayError(f"{path} is a damaged index: {NORMS_FILE} has {norms.shape}, not ({len(ids)},)")
    return GradientIndex(path, grads, module_slices(meta), ids, losses, tokens, meta, norms)
