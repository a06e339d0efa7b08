"""TrackStar preconditioning: per-module R^{-1/2} from mixed train and query second moments.

For each module m (block-diagonal; the projected gradient of one module is a vector of d_m
numbers) the second moment R_m = E[g gᵀ] is estimated on the training sample (saved in the
index as a sum and a count) and on the queries. TrackStar (Chang et al. 2024, arXiv 2410.17413)
mixes them, R = λ·R_query + (1−λ)·R_train, so that directions every query shares ("template"
directions: the ABC header, the prompt format) are down-weighted. R is eigendecomposed in fp64,
damped by `damping × mean eigenvalue`, and R^{-1/2} is applied to *both* sides before
unit-normalisation, so the cosine is taken in the whitened space.

Automatic λ (TrackStar §A.1.3): sort the eigenvalues of R_query and R_train (pooled over all
modules) and choose λ so the two curves λ·σ_q and (1−λ)·σ_t cross at component k, i.e. the
top k query directions are where the query statistics dominate and get down-weighted:
λ = σ_t[k] / (σ_q[k] + σ_t[k]), with k ≈ 1.5% of the query statistics' rank (1000 of 65,536
in the paper, where thousands of queries make R_query full rank).
With the training set as its own queries the curves coincide and λ = 1/2 (R = R_train).
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from assay.core.errors import AssayError
from assay.core.precision import LINALG_DTYPE, STATS_DTYPE

LOW_RANK_VERSION = 2
"""Part of `LowRank.key`, so that norms cached by an earlier computation are not reused. 2: a
`silent` module is left out (1 cached NaN norms for every row of an index that had one)."""
MIX_FRACTION = 1000 / 65536
"""Fraction of the dimensions the automatic λ down-weights (TrackStar: 1000 of 65,536)."""


@contextlib.contextmanager
def single_thread() -> Iterator[None]:
    """Run small dense linear algebra on one thread.

    Eigendecompositions of a few hundred rows gain nothing from threads, and on a busy machine
    OpenMP's spinning barriers made a 256×256 `eigh` 40× slower on 2 threads than on 1.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def second_moment_sums(grads: torch.Tensor, slices: dict[str, slice]) -> dict[str, torch.Tensor]:
    """Per-module Σ g gᵀ in fp64 of rows `grads` [N, D]: {name: [d_m, d_m]}."""
    g = grads.to(LINALG_DTYPE)
    return {name: g[:, sl].T @ g[:, sl] for name, sl in slices.items()}


def eigenvalues(moments: dict[str, torch.Tensor]) -> torch.Tensor:
    """All eigenvalues of the block-diagonal matrix, descending, fp64, clamped at 0."""
    with single_thread():
        vals = [torch.linalg.eigvalsh(m.to(LINALG_DTYPE)) for m in moments.values()]
    return torch.cat(vals).clamp_min(0).sort(descending=True).values


def auto_mix(
    r_query: dict[str, torch.Tensor], r_train: dict[str, torch.Tensor], fraction: float = MIX_FRACTION
) -> float:
    """TrackStar's λ: the query and train eigenvalue curves cross at component k.

    k is `fraction` of the query statistics' rank. With thousands of queries R_query has full
    rank and this is the paper's rule (k = 1000 of 65,536 dimensions). A few queries span only
    Q × modules directions; counting k within those keeps the rule's meaning (the top ~1.5% of
    the query directions are the shared "template" ones) instead of down-weighting every
    direction the queries have, which would whiten away the very signal being attributed.
    """
    sq, st = eigenvalues(r_query), eigenvalues(r_train)
    rank_q = int((sq > sq[0] * 1e-10).sum()) if sq.numel() and sq[0] > 0 else 0
    if rank_q == 0 or st.numel() == 0 or st[0] <= 0:
        raise AssayError("cannot choose --mix automatically: the query or train gradients are all zero")
    k = max(int(round(fraction * rank_q)), 1) - 1
    return float(st[k] / (sq[k] + st[k]))


def inverse_sqrt(moment: torch.Tensor) -> torch.Tensor:
    """M^{-1/2} of a (damped) symmetric PSD matrix, in fp64 through `eigh`; 0 for M = 0.

    Eigenvalues are clamped at a tiny positive floor first (rounding can make a PSD matrix
    slightly indefinite; with --damping 0 a singular R stays finite).
    """
    if silent(moment):
        return torch.zeros_like(moment, dtype=LINALG_DTYPE)
    with single_thread():
        vals, vecs = torch.linalg.eigh(moment.to(LINALG_DTYPE))
    floor = max(float(vals.max()) * 1e-12, torch.finfo(LINALG_DTYPE).tiny)
    return (vecs * vals.clamp_min(floor).rsqrt()) @ vecs.T


def silent(moment: torch.Tensor) -> bool:
    """Whether a module's second moment is exactly 0: every gradient of the sample is 0 there
    (a fresh LoRA adapter's A layers, whose B starts at 0). Its R^{-1/2} is taken as 0, the
    pseudo-inverse: the module is left out of the whitened space (train rows are 0 there
    anyway, so it could only change the query's norm), where the inverse would be infinite and
    every score NaN."""
    return not bool(moment.any())


def mean_eigenvalue(moment: torch.Tensor) -> float:
    """trace / d: the mean eigenvalue, without an eigendecomposition."""
    return float(torch.diagonal(moment).sum()) / moment.shape[0]


@dataclass
class LowRank:
    """‖W t‖² without W t: R = A + U Uᵀ with A = (1−λ)·(R_train + δI), U = sqrt(λ/Q)·queriesᵀ.

    Woodbury: tᵀR⁻¹t = tᵀA⁻¹t − sᵀ K⁻¹ s per module, s = (A⁻¹U)ᵀ t and K = I + UᵀA⁻¹U.
    tᵀA⁻¹t = base(t) / (1−λ) where base(t) = ‖(R_train + δI)^{-1/2} t‖² does not depend on the
    queries, so it can be computed once per index and damping and cached.
    """

    base: dict[str, torch.Tensor]  # name -> (R_train + δI)^{-1/2} [d, d] fp32
    factors: dict[str, torch.Tensor]  # name -> A⁻¹U [d, Q] fp32 (absent when λ = 0)
    kinv: dict[str, torch.Tensor]  # name -> K⁻¹ [Q, Q] fp64
    base_scale: float  # 1 / (1−λ)
    key: str  # identifies R_train and δ: the cache key of base(t)


@dataclass
class Whitening:
    """Per-module W_m = R_m^{-1/2} (R damped), stored fp32 (computed in fp64); W is symmetric."""

    slices: dict[str, slice]  # module name -> columns of the concatenated gradient
    matrices: dict[str, torch.Tensor]  # name -> [d_m, d_m] fp32
    mix: float = 0.0
    damping: dict[str, float] = field(default_factory=dict)  # name -> δ_m added to R_train
    lowrank: LowRank | None = None

    def to(self, device: torch.device | str) -> Whitening:
        mats = {n: w.to(device) for n, w in self.matrices.items()}
        return Whitening(self.slices, mats, self.mix, self.damping, self.lowrank)

    def apply(
        self, x: torch.Tensor, times: int = 1, matrices: dict[str, torch.Tensor] | None = None
    ) -> torch.Tensor:
        """W^times x for rows x [B, D] (times=2 gives R^{-1} x); fp32 out, input untouched.

        `matrices` replaces W by other per-module matrices (e.g. LowRank.base).
        """
        matrices = matrices or self.matrices
        out = x.to(STATS_DTYPE).clone()
        for name, sl in self.slices.items():
            w = matrices[name]
            for _ in range(times):
                out[:, sl] = out[:, sl] @ w
        return out

    def sq_norms(self, x: torch.Tensor, matrices: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        """[B] ‖W x‖² of rows x [B, D] fp32, one matmul per module, without keeping W x."""
        matrices = matrices or self.matrices
        total = torch.zeros(x.shape[0], dtype=STATS_DTYPE, device=x.device)
        for name, sl in self.slices.items():
            y = x[:, sl] @ matrices[name]
            total += (y * y).sum(dim=1)
        return total


def build_whitening(
    train_sums: dict[str, torch.Tensor],
    train_count: int,
    query_grads: torch.Tensor | None,
    slices: dict[str, slice],
    mix: float | None = None,
    damping: float = 0.1,
    mix_fraction: float = MIX_FRACTION,
) -> Whitening:
    """TrackStar's whitening: R = λ·R_query + (1−λ)·(R_train + δI), W = R^{-1/2} per module.

    R_train comes from the index's saved sums, R_query from the query rows [Q, D]. δ = damping ×
    the mean eigenvalue of R_train (per module): the damping regularises the training estimate,
    and scales with its share of the mix. With λ = 1 the query statistics are damped instead.
    `mix=None` chooses λ automatically (see `auto_mix`); without query rows λ is 0.
    """
    with single_thread():  # small matrices: threads only add synchronisation
        return _build_whitening(train_sums, train_count, query_grads, slices, mix, damping, mix_fraction)


def _build_whitening(train_sums, train_count, query_grads, slices, mix, damping, mix_fraction) -> Whitening:
    if train_count <= 0:
        raise AssayError("the index's preconditioner statistics are empty (count 0); rebuild the index")
    missing = [n for n in slices if n not in train_sums]
    if missing:
        raise AssayError(f"the index's preconditioner has no statistics for module {missing[0]!r}")
    if damping < 0:
        raise AssayError(f"--damping must be >= 0, got {damping}")
    r_train = {n: train_sums[n].to(LINALG_DTYPE) / train_count for n in slices}
    r_query: dict[str, torch.Tensor] = {}
    if query_grads is None or query_grads.shape[0] == 0 or mix == 0.0:
        mix = 0.0
    else:
        r_query = {n: s / query_grads.shape[0] for n, s in second_moment_sums(query_grads, slices).items()}
        mix = auto_mix(r_query, r_train, mix_fraction) if mix is None else mix
    if not 0.0 <= mix <= 1.0:
        raise AssayError(f"--mix must be in [0, 1], got {mix}")
    deltas = {n: damping * mean_eigenvalue(r_train[n] if mix < 1 else r_query[n]) for n in slices}
    matrices = {}
    for name in slices:
        eye = torch.eye(r_train[name].shape[0], dtype=LINALG_DTYPE)
        if mix < 1 and silent(r_train[name]):
            matrices[name] = torch.zeros_like(eye, dtype=STATS_DTYPE)
            continue
        if mix < 1:
            moment = (1 - mix) * (r_train[name] + deltas[name] * eye)
            moment = moment + mix * r_query[name] if mix > 0 else moment
        else:
            moment = r_query[name] + deltas[name] * eye
        matrices[name] = inverse_sqrt(moment).to(STATS_DTYPE)
    lowrank = _low_rank(r_train, deltas, query_grads, slices, mix, damping) if mix < 1 else None
    return Whitening(dict(slices), matrices, float(mix), deltas, lowrank)


def _low_rank(r_train, deltas, query_grads, slices, mix, damping) -> LowRank:
    """The pieces of the Woodbury form of ‖W t‖² (see LowRank)."""
    base, factors, kinv = {}, {}, {}
    digest = hashlib.sha256(f"v{LOW_RANK_VERSION} damping={damping!r}".encode())
    for name, sl in slices.items():
        r = r_train[name]
        digest.update(name.encode() + r.numpy().tobytes())
        if silent(r):  # left out, as in the whitening: ‖W t‖² = 0 for the module
            base[name] = torch.zeros_like(r, dtype=STATS_DTYPE)
            if mix > 0:
                factors[name] = torch.zeros(r.shape[0], query_grads.shape[0], dtype=STATS_DTYPE)
                kinv[name] = torch.eye(query_grads.shape[0], dtype=LINALG_DTYPE)
            continue
        with single_thread():
            vals, vecs = torch.linalg.eigh(r + deltas[name] * torch.eye(r.shape[0], dtype=LINALG_DTYPE))
        vals = vals.clamp_min(max(float(vals.max()) * 1e-12, torch.finfo(LINALG_DTYPE).tiny))
        base[name] = ((vecs * vals.rsqrt()) @ vecs.T).to(STATS_DTYPE)
        if mix > 0:
            u = query_grads[:, sl].to(LINALG_DTYPE).T * (mix / query_grads.shape[0]) ** 0.5  # [d, Q]
            a_inv_u = (vecs / vals) @ (vecs.T @ u) / (1 - mix)  # A⁻¹U, A = (1−λ)(R_train + δI)
            k = torch.eye(u.shape[1], dtype=LINALG_DTYPE) + u.T @ a_inv_u
            factors[name], kinv[name] = a_inv_u.to(STATS_DTYPE), torch.linalg.inv(k)
    return LowRank(base, factors, kinv, 1.0 / (1 - mix), digest.hexdigest()[:24])
