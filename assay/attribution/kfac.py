"""Kronecker-factored influence (K-FAC, EK-FAC): factors, damping, preconditioned queries, files.

For a linear layer y = W a with per-token output gradient g = ∂L/∂y, the curvature block of W is
approximated per module as H ≈ G ⊗ A, with A = E[a aᵀ] and G = E[g gᵀ] over (unpadded) tokens
(Martens & Grosse 2015; Grosse et al. 2023). With the eigendecompositions A = Q_A Λ_A Q_Aᵀ and
G = Q_G Λ_G Q_Gᵀ (fp64), the damped inverse applied to a weight gradient X (out × in) is

    K-FAC:   (G ⊗ A + δI)⁻¹ vec(X) = Q_G [ (Q_Gᵀ X Q_A) ⊘ (λ_G λ_Aᵀ + δ) ] Q_Aᵀ
    EK-FAC:  the same with λ_G λ_Aᵀ replaced by Λ_ij = E_n[(Q_Gᵀ ∇W_n Q_A)_ij²]

where EK-FAC's eigenvalue correction (George et al. 2018) is fitted in a second pass over
per-example gradients ∇W_n (one example = one sequence, as kronfluence does). Fitting lives in
`kfac_fit.py`; this file holds what is fitted and how it is applied.

Conventions, matched to kronfluence 1.0.1 (the reference implementation):
- A and G are divided by the number of unpadded tokens, Λ by the number of examples; g is the
  gradient of the per-example loss *summed* over tokens (the loss is summed over the batch).
- Damping δ per module = `damping` × the mean of that module's eigenvalue matrix (λ_G λ_Aᵀ, or
  Λ): kronfluence's heuristic (its `damping_factor=None`; its default is an absolute 1e-8,
  offered here as `absolute_damping`). The relative rule is assay's (`--damping` elsewhere).
- Biases are excluded, as the gradient collector excludes them: the factors are those of the
  weight alone (no column of ones appended to a). kronfluence appends one for layers with a bias.
- Score = ⟨∇L_q, (H + δ)⁻¹ ∇L_i⟩ summed over modules: positive = proponent (a gradient step on
  example i lowers the query's loss), the sign of `assay score --mode influence`.

Projection. An index stores only P_out ∇W_i P_inᵀ (p × p per module). Two ways to combine it
with the factors, both offered, neither changing the index:

1. Project the curvature (`projected_curvature`, recommended). P = P_out ⊗ P_in maps H to
   M = P H Pᵀ exactly (p² × p² per module, computed from the factors without forming P or H);
   scores are ⟨P g_q Pᵀ, (M + δI)⁻¹ P g_i Pᵀ⟩, i.e. the index's own `influence` mode with M in
   place of the rows' second moment (`build_whitening(M, 1, ...)`). Exact when P is injective
   (p ≥ in, out); otherwise a sketch taken in the whitened space, where queries and training
   rows have balanced norms. For K-FAC, M = (P_out G P_outᵀ) ⊗ (P_in A P_inᵀ): the same as
   fitting the factors on the projected sides (LoGra, Choe et al. 2024).
2. Precondition, then project (`precondition_queries` with the index's projector). Each query
   is preconditioned with the full factors, X_q = (H + δ)⁻¹ ∇L_q (out × in), then projected:
   ⟨P_out X_q P_inᵀ, P_out ∇W_i P_inᵀ⟩ is an unbiased (Johnson–Lindenstrauss) estimate of
   ⟨X_q, ∇W_i⟩ since E[PᵀP] = I per side, scored with the plain inner product. But its error
   grows with ‖X_q‖·‖∇W_i‖ and (H + δ)⁻¹ inflates exactly the directions the training
   gradients lack, so the noise swamps the signal at the automatic damping: on a briefly
   trained MLP classifier (96 examples, tests/attribution/test_kfac.py) the median per-query
   Pearson with the exact, unprojected EK-FAC influence was -0.06 at p = 32 (-0.17 at p = 16),
   against 0.85 (0.69) for option 1 and 0.42 (0.46) for the index's `influence` mode on its
   own second moment.

Both need an index without an optimizer normalizer (its rows must be plain loss gradients).
With `projection_dim` 0 (raw rows), `precondition_queries` is exact and needs no estimate.

Large modules: a side wider than `block_size` (default 4,096) is block-diagonalised, i.e. A (or
G) is replaced by its diagonal blocks of at most `block_size` rows, each eigendecomposed on its
own. Memory and eigh time then grow linearly with the width instead of quadratically/cubically,
and narrower sides stay exact. The output head stays excluded by default (`!*lm_head`), as in
the index; including it (out = vocabulary) works through these blocks.

Storage: eigenvectors, eigenvalues and Λ are kept and saved as fp32 (computed in fp64), like
kronfluence's: Q is orthogonal to ~1e-7, and fp64 would double a file that holds one
in² + out² + out·in numbers per module.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn

from assay.attribution.api import Gradients
from assay.attribution.batches import check_batches, model_device, to_device
from assay.attribution.collector import GradientCollector, Objective, layout
from assay.attribution.precondition import single_thread
from assay.attribution.projection import Projector
from assay.core.errors import AssayError, first_line
from assay.core.paths import as_path
from assay.core.precision import LINALG_DTYPE, STATS_DTYPE, PrecisionPolicy
from assay.lm.hooks import is_conv1d

Kind = Literal["kfac", "ekfac"]
KINDS: tuple[str, ...] = ("kfac", "ekfac")
BLOCK_SIZE = 4096
"""Widest side eigendecomposed whole; wider sides are block-diagonal (blocks of this size)."""
DAMPING = 0.1
"""δ = DAMPING × the module's mean eigenvalue (kronfluence's heuristic scale)."""
SMALL_EIGH = 1024  # below this size eigh runs single-threaded (see precondition.single_thread)


def side_blocks(size: int, block_size: int) -> list[slice]:
    """Slices of a side of `size` features into blocks of at most `block_size`."""
    if block_size < 1:
        raise AssayError(f"block_size must be positive, got {block_size}")
    return [slice(s, min(s + block_size, size)) for s in range(0, size, block_size)]


@dataclass
class SideBasis:
    """Eigenbasis of one side's covariance (A: layer inputs, G: output gradients)."""

    vectors: list[torch.Tensor]
    """Per diagonal block, [b, b] eigenvectors as columns (one block unless the side is wide)."""
    values: torch.Tensor
    """[n] eigenvalues, blocks in order, clamped at 0 (the covariance is PSD up to rounding)."""

    @property
    def size(self) -> int:
        """Features on this side (in or out)."""
        return int(self.values.shape[0])

    def _apply(self, x: torch.Tensor, dim: int, transpose: bool) -> torch.Tensor:
        moved = x.transpose(dim, -1)
        out = torch.empty_like(moved)
        start = 0
        for q in self.vectors:
            sl = slice(start, start + q.shape[0])
            q = q.to(moved.device, moved.dtype)
            out[..., sl] = moved[..., sl] @ (q.T if transpose else q)
            start = sl.stop
        return out.transpose(dim, -1)

    def to_eigen(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Coordinates of x along `dim` in the eigenbasis: Qᵀ applied to that dimension."""
        return self._apply(x, dim, transpose=False)

    def from_eigen(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Back from eigen-coordinates: Q applied to dimension `dim`."""
        return self._apply(x, dim, transpose=True)


def decompose(sums: list[torch.Tensor], count: int, dtype: torch.dtype = STATS_DTYPE) -> SideBasis:
    """SideBasis of the covariance given as per-block sums Σ x xᵀ over `count` rows; eigh in fp64."""
    if count <= 0:
        raise AssayError("no tokens reached a module while fitting K-FAC factors; check the batches")
    vectors, values = [], []
    for s in sums:
        m = s.to(LINALG_DTYPE) / count
        m = (m + m.T) / 2  # exact symmetry for eigh (fp32 sums can differ in the last bit)
        if m.shape[0] <= SMALL_EIGH:
            with single_thread():
                vals, vecs = torch.linalg.eigh(m)
        else:
            vals, vecs = torch.linalg.eigh(m)
        # eigh returns column-major vectors; row-major ones are what load_factors gives back, so
        # fitted and loaded factors take the same matmul kernels and score bit for bit alike
        vectors.append(vecs.to(dtype).contiguous())
        values.append(vals.clamp_min(0).to(dtype))
    return SideBasis(vectors, torch.cat(values))


@dataclass
class ModuleFactors:
    """The fitted factors of one linear module, in the (out, in) orientation of ∇W."""

    a: SideBasis
    """Input side: eigenbasis of A = E[a aᵀ] (in × in)."""
    g: SideBasis
    """Output side: eigenbasis of G = E[g gᵀ] (out × out)."""
    corrected: torch.Tensor | None = None
    """[out, in] EK-FAC eigenvalues Λ = E_n[(Q_Gᵀ ∇W_n Q_A)²]; None before the second pass."""
    conv1d: bool = False
    """GPT-2 Conv1D: its weight (and the index's raw blocks) are stored (in, out)."""

    def eigenvalues(self, kind: Kind) -> torch.Tensor:
        """[out, in] the eigenvalues of the approximate curvature in the Kronecker eigenbasis."""
        if kind == "ekfac":
            if self.corrected is None:
                raise AssayError("these factors have no EK-FAC eigenvalue correction; fit with kind='ekfac'")
            return self.corrected
        return self.g.values[:, None] * self.a.values[None, :]

    def damping(self, kind: Kind, damping: float = DAMPING, absolute: float | None = None) -> float:
        """δ for this module: `absolute` if given, else `damping` × the mean eigenvalue."""
        if absolute is not None:
            if not 0 <= absolute < math.inf:  # NaN too: it would make every score NaN
                raise AssayError(f"absolute damping must be a finite number >= 0, got {absolute}")
            return float(absolute)
        if not 0 <= damping < math.inf:  # NaN scores all NaN, inf all 0
            raise AssayError(f"--damping must be a finite number >= 0, got {damping}")
        return damping * float(self.eigenvalues(kind).to(LINALG_DTYPE).mean())

    def precondition(self, grad: torch.Tensor, kind: Kind, delta: float) -> torch.Tensor:
        """(H + δI)⁻¹ applied to weight gradients [B, out, in] (or [out, in]), in grad's dtype."""
        lam = self.eigenvalues(kind).to(grad.device, grad.dtype)  # [out, in]
        if not bool(lam.any()):  # no gradient in the fit (a fresh LoRA's A): the pseudo-inverse, 0
            return torch.zeros_like(grad)
        if delta <= 0 and bool((lam <= 0).any()):
            raise AssayError("the curvature is singular (zero eigenvalues) and the damping is 0; damp it")
        rotated = self.a.to_eigen(self.g.to_eigen(grad, dim=-2), dim=-1)  # Q_Gᵀ X Q_A
        return self.a.from_eigen(self.g.from_eigen(rotated / (lam + delta), dim=-2), dim=-1)


@dataclass
class KronFactors:
    """K-FAC / EK-FAC factors of a set of modules, in model order."""

    kind: Kind
    """"ekfac" when the eigenvalue correction was fitted (it can still be applied as "kfac")."""
    modules: dict[str, ModuleFactors]
    """Module name -> its factors."""
    fisher: str = "empirical"
    """Labels the factors' gradients used: "empirical" (the data's) or "sampled" (the model's)."""
    block_size: int = BLOCK_SIZE
    """Widest side that was eigendecomposed whole."""
    examples: int = 0
    """Examples the factors were fitted on (the EK-FAC pass's, or the covariance pass's)."""

    def dampings(
        self, kind: Kind | None = None, damping: float = DAMPING, absolute: float | None = None
    ) -> dict[str, float]:
        """{name: δ} per module under the rule (see ModuleFactors.damping)."""
        kind = kind or self.kind
        return {n: mf.damping(kind, damping, absolute) for n, mf in self.modules.items()}


# --- files ------------------------------------------------------------------------------------------
FACTORS_FILE = "kfac.safetensors"
FORMAT = "assay-kfac/1"


def save_factors(factors: KronFactors, path: str | Path, *, overwrite: bool = False) -> Path:
    """Write the factors to one safetensors file (fp32 tensors, metadata in its header).

    `path` must be a new file in an existing folder or, with `overwrite=True`, factors an earlier
    `save_factors` wrote; any other file, or a folder, is refused. The file is written beside
    `path` and renamed into place: never half a file under its name, no temporary left behind.
    """
    if not isinstance(factors, KronFactors):
        raise AssayError(f"save_factors saves the KronFactors of fit_kfac, not a {type(factors).__name__}")
    if factors.kind not in KINDS:
        raise AssayError(f"these factors' kind {factors.kind!r} is not one of {', '.join(KINDS)}")
    path = as_path(path, "save_factors' path")
    _check_destination(path, overwrite)
    tensors: dict[str, torch.Tensor] = {}
    layout_meta = []
    for name, mf in factors.modules.items():
        for side, basis in (("a", mf.a), ("g", mf.g)):
            tensors[f"{name}/{side}/values"] = basis.values
            for k, q in enumerate(basis.vectors):
                tensors[f"{name}/{side}/vectors/{k}"] = q
        if mf.corrected is not None:
            tensors[f"{name}/lambda"] = mf.corrected
        layout_meta.append({"name": name, "a_blocks": len(mf.a.vectors), "g_blocks": len(mf.g.vectors)})
        layout_meta[-1]["conv1d"] = mf.conv1d
    tensors = {k: v.detach().to("cpu", STATS_DTYPE).contiguous() for k, v in tensors.items()}
    meta = {
        "format": FORMAT,
        "kind": factors.kind,
        "fisher": factors.fisher,
        "block_size": str(factors.block_size),
        "examples": str(factors.examples),
        "modules": json.dumps(layout_meta),
    }
    tmp = path.with_name(path.name + ".tmp")  # atomic: a build killed while saving resumes cleanly
    try:
        save_file(tensors, str(tmp), metadata=meta)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def _check_destination(path: Path, overwrite: bool) -> None:
    """Refuse a folder, a missing parent folder, a file that is not factors, or (without
    `overwrite`) earlier factors: save_factors never replaces what it did not write."""
    if path.is_dir():
        raise AssayError(f"{path} is a folder; give save_factors a file path, e.g. {path / FACTORS_FILE}")
    if not path.parent.is_dir():
        raise AssayError(f"no folder {path.parent} to save the factors in; create it first")
    if not path.exists():
        return
    if not _holds_factors(path):
        raise AssayError(
            f"{path} exists and is not K-FAC factors; save_factors replaces only factors it wrote: "
            "choose a new path"
        )
    if not overwrite:
        raise AssayError(f"{path} already holds K-FAC factors; pass overwrite=True to replace them")


def _holds_factors(path: Path) -> bool:
    """Whether `path` is a file save_factors wrote (its header names the format)."""
    try:
        with safe_open(str(path), framework="pt") as f:
            return (f.metadata() or {}).get("format") == FORMAT
    except (SafetensorError, OSError, ValueError):
        return False


def load_factors(path: str | Path) -> KronFactors:
    """Read factors written by `save_factors` (one line for a missing, foreign or damaged file)."""
    path = as_path(path, "load_factors' path")
    if not path.is_file():
        raise AssayError(
            f"no K-FAC factors at {path}: give a file written by save_factors (an index built with "
            "--preconditioner kfac or ekfac holds one)"
        )
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            if meta.get("format") != FORMAT:
                raise AssayError(f"{path} is not an assay K-FAC factor file (format {meta.get('format')!r})")
            return _read_factors(f, meta)
    except AssayError:
        raise
    except (SafetensorError, OSError, KeyError, ValueError, TypeError) as e:  # foreign, torn or garbled
        raise AssayError(
            f"{path} is not a readable assay K-FAC factor file ({first_line(e)}): it is damaged, or "
            "not one that save_factors wrote"
        ) from None


def _read_factors(f: Any, meta: dict[str, str]) -> KronFactors:
    """The factors in an opened factor file whose header is `meta`."""
    modules = {}
    for entry in json.loads(meta["modules"]):
        name = entry["name"]
        sides = {}
        for side in ("a", "g"):
            vecs = [f.get_tensor(f"{name}/{side}/vectors/{k}") for k in range(entry[f"{side}_blocks"])]
            sides[side] = SideBasis(vecs, f.get_tensor(f"{name}/{side}/values"))
        lam = f.get_tensor(f"{name}/lambda") if f"{name}/lambda" in f.keys() else None
        modules[name] = ModuleFactors(sides["a"], sides["g"], lam, bool(entry["conv1d"]))
    kind = meta["kind"]
    _check_read(kind, modules)
    return KronFactors(kind, modules, meta["fisher"], int(meta["block_size"]), int(meta["examples"]))  # type: ignore[arg-type]


def _check_read(kind: str, modules: dict[str, ModuleFactors]) -> None:
    """A header that contradicts its tensors fails here, in one line, not later inside a product."""
    if kind not in ("kfac", "ekfac"):
        raise ValueError(f"its kind is {kind!r}, not kfac or ekfac")
    if not modules:
        raise ValueError("it holds no modules")
    for name, mf in modules.items():
        for side in (mf.a, mf.g):
            if any(v.ndim != 2 for v in side.vectors) or sum(v.shape[0] for v in side.vectors) != side.size:
                raise ValueError(f"module {name!r}'s eigenvector blocks do not span its eigenvalues")
        if kind == "ekfac" and mf.corrected is None:
            raise ValueError(f"module {name!r} has no EK-FAC eigenvalues though its kind is ekfac")
        if mf.corrected is not None and tuple(mf.corrected.shape) != (mf.g.size, mf.a.size):
            raise ValueError(f"module {name!r}'s EK-FAC eigenvalues are not [{mf.g.size}, {mf.a.size}]")


# --- queries ----------------------------------------------------------------------------------------
def resolve_policy(model: nn.Module, precision: str | PrecisionPolicy) -> PrecisionPolicy:
    """A policy as given, or resolved from a `--precision` name on the model's device."""
    if isinstance(precision, PrecisionPolicy):
        return precision
    return PrecisionPolicy.resolve(precision, model_device(model))


def factor_modules(model: nn.Module, factors: KronFactors) -> dict[str, nn.Module]:
    """The model's modules the factors were fitted on, checking their shapes."""
    found = dict(model.named_modules())
    out = {}
    for name, mf in factors.modules.items():
        module = found.get(name)
        if module is None:
            raise AssayError(f"the model has no module {name!r} that the K-FAC factors were fitted on")
        rows, cols = (int(d) for d in module.weight.shape)  # type: ignore[union-attr]
        in_f, out_f = (rows, cols) if is_conv1d(module) else (cols, rows)
        if (in_f, out_f) != (mf.a.size, mf.g.size):
            raise AssayError(
                f"module {name!r} is {in_f}->{out_f} but its K-FAC factors are for another shape"
            )
        out[name] = module
    return out


def precondition_rows(
    raw: torch.Tensor,
    factors: KronFactors,
    projector: Projector,
    kind: Kind | None = None,
    damping: float = DAMPING,
    absolute_damping: float | None = None,
) -> torch.Tensor:
    """[B, D_raw] raw gradients (collector layout, projection 0) -> [B, D] (H + δ)⁻¹ g, then projected.

    The modules' columns follow the factors' order, as `layout` gives them. With `projector.dim`
    0 the result stays raw (weight layout), else each module becomes P_out X P_inᵀ, flattened.
    """
    kind = kind or factors.kind
    deltas = factors.dampings(kind, damping, absolute_damping)
    parts, start = [], 0
    for name, mf in factors.modules.items():
        out_f, in_f = mf.g.size, mf.a.size
        block = raw[:, start : start + out_f * in_f].to(STATS_DTYPE)
        start += out_f * in_f
        grad = block.view(-1, in_f, out_f).transpose(1, 2) if mf.conv1d else block.view(-1, out_f, in_f)
        x = mf.precondition(grad, kind, deltas[name])  # [B, out, in]
        if projector.dim > 0:
            x = projector.project_full(name, x)  # [B, p, p]
        elif mf.conv1d:
            x = x.transpose(1, 2)  # back to the weight's (in, out) layout, as the index stores it
        parts.append(x.reshape(x.shape[0], -1))
    if start != raw.shape[1]:
        raise AssayError(f"raw gradients have {raw.shape[1]} columns; the K-FAC modules need {start}")
    return torch.cat(parts, dim=1)


def projected_curvature(factors: KronFactors, projector: Projector, kind: Kind | None = None):
    """{name: [p², p²] fp64} the exact projection P H Pᵀ of each module's K-FAC/EK-FAC curvature.

    P = P_out ⊗ P_in is the index's projection of a weight gradient, so this is the curvature
    of the projected rows the index holds. In H's eigenbasis H = K diag(Λ) Kᵀ with K = Q_G ⊗ Q_A,
    so with U = P_out Q_G and V = P_in Q_A:  M[(a,b),(c,d)] = Σ_ij Λ_ij U_ai U_ci V_bj V_dj,
    contracted over j first (out·in·p² multiply-adds) and never forming P or K.
    Use it as the index statistics `build_whitening(M, 1, ...)` reads: scores are then
    ⟨P g_q Pᵀ, (M + δI)⁻¹ P g_i Pᵀ⟩ (`mode="influence"`).
    """
    if projector.dim <= 0:
        raise AssayError("projected_curvature needs a projection (dim > 0); use precondition_queries")
    kind = kind or factors.kind
    out = {}
    for name, mf in factors.modules.items():
        u = mf.g.to_eigen(projector.matrix(name, "out", mf.g.size).to(LINALG_DTYPE))  # [p, out] P_out Q_G
        v = mf.a.to_eigen(projector.matrix(name, "in", mf.a.size).to(LINALG_DTYPE))  # [p, in] P_in Q_A
        lam = mf.eigenvalues(kind).to(LINALG_DTYPE)  # [out, in]
        p = projector.dim
        vv = (v[:, None, :] * v[None, :, :]).reshape(p * p, -1)  # [(b,d), in]
        uu = (u[:, None, :] * u[None, :, :]).reshape(p * p, -1)  # [(a,c), out]
        m = uu @ (lam @ vv.T)  # [(a,c), (b,d)]: two GEMMs, nothing larger than out × p²
        out[name] = m.view(p, p, p, p).permute(0, 2, 1, 3).reshape(p * p, p * p)  # [(a,b), (c,d)]
    return out


def precondition_queries(
    model: nn.Module,
    factors: KronFactors,
    batches: Iterable[dict[str, torch.Tensor]],
    loss_fn: Objective,
    projector: Projector,
    precision: str | PrecisionPolicy = "fp32",
    kind: Kind | None = None,
    damping: float = DAMPING,
    absolute_damping: float | None = None,
) -> Gradients:
    """Query rows [Q, D] = P_out (H + δ)⁻¹ ∇L_q P_inᵀ per module, comparable with an index's rows.

    The full (unprojected) gradient of each query is formed, preconditioned with the factors and
    projected with `projector` (the index's: same dim and seed), so `score(queries, train,
    mode="inner")` (or the plain inner product with any index of the same modules) gives the
    influence ⟨∇L_q, (H + δ)⁻¹ ∇L_i⟩: exactly with `projector.dim == 0` (raw rows), else as an
    unbiased but noisy estimate (see the module docstring: `projected_curvature` is the better
    choice for a projected index).
    """
    check_batches(batches, "query batches")
    policy = resolve_policy(model, precision)
    modules = factor_modules(model, factors)
    collector = GradientCollector(model, modules, Projector(0), policy)
    parts = []
    with collector:
        for batch in batches:
            raw, _ = collector.gradients(to_device(batch, policy.device), loss_fn)
            parts.append(precondition_rows(raw, factors, projector, kind, damping, absolute_damping).cpu())
    if not parts:
        raise AssayError("no query batches to precondition")
    slices = {s.name: slice(s.start, s.stop) for s in layout(modules, projector.dim)}
    return Gradients(torch.cat(parts), slices, projector.dim, projector.seed)
