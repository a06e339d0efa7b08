"""K-FAC / EK-FAC against independent references: einsums over autograd's own activations and
output gradients, explicit Kronecker products solved densely in fp64, brute-force eigenvalue
corrections from per-example gradients, and invariance to batching, padding and precision."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest
import torch
from torch import nn

from assay.attribution.api import collect_gradients
from assay.attribution.collector import linear_modules
from assay.attribution.kfac import (
    KronFactors,
    ModuleFactors,
    decompose,
    load_factors,
    precondition_queries,
    projected_curvature,
    save_factors,
    side_blocks,
)
from assay.attribution.kfac_fit import (
    FactorCollector,
    SampledCrossEntropy,
    SampledLmLosses,
    fit_kfac,
)
from assay.attribution.precondition import build_whitening, single_thread
from assay.attribution.projection import Projector
from assay.core.distributed import Distributed, finish_process_group
from assay.core.errors import AssayError
from assay.core.precision import PrecisionPolicy
from assay.lm.data import Examples, collate
from assay.lm.losses import example_losses
from tests import helpers
from tests.helpers import ce_loss, classifier_data, kron_solve, mlp

F64 = torch.float64
FP32 = PrecisionPolicy.resolve("fp32", "cpu")


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models gain nothing from threads; on a busy machine OpenMP barriers cost 100x."""
    with single_thread():
        yield


# --- models and data ----------------------------------------------------------------------------
def tiny_llama(seed: int = 0) -> nn.Module:
    """Smaller than the shared default, so dense Kronecker solves stay cheap."""
    return helpers.tiny_llama(
        seed, vocab_size=96, hidden_size=24, intermediate_size=32, max_position_embeddings=64,
        attn_implementation="eager",
    )  # fmt: skip


def tiny_gpt2(seed: int = 0) -> nn.Module:
    model = helpers.tiny_gpt2(seed, vocab_size=96, n_embd=16, n_layer=1, n_head=2, n_positions=64)
    model.config._attn_implementation = "eager"
    return model


def examples(lengths: list[int], seed: int = 0) -> Examples:
    rng = np.random.default_rng(seed)
    return Examples(
        ids=np.arange(len(lengths), dtype=np.int64),
        offsets=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
        tokens=rng.integers(1, 96, size=sum(lengths)).astype(np.int32),
        loss_start=np.ones(len(lengths), dtype=np.int64),
    )


def lm_batches(ex: Examples, size: int) -> list[dict[str, torch.Tensor]]:
    """Batches of `size` examples; size 1 is unpadded, larger sizes pad to a common width."""
    out = []
    for s in range(0, len(ex), size):
        pos = np.arange(s, min(s + size, len(ex)))
        pad_to = int(ex.lengths[pos[0]]) if size == 1 else None
        out.append(collate(ex, pos, pad_id=0, pad_to=pad_to))
    return out


def trace(model: nn.Module, batch: dict[str, torch.Tensor], names: list[str], loss_fn) -> tuple[dict, dict]:
    """Reference: plain autograd (parameters requiring grad); each module's input and output grad."""
    acts, outs, handles = {}, {}, []
    mods = dict(model.named_modules())
    for n in names:

        def hook(m, inp, out, n=n):
            acts[n] = inp[0].detach().clone()
            out.retain_grad()
            outs[n] = out

        handles.append(mods[n].register_forward_hook(hook))
    loss_fn(model, batch).sum().backward()
    for h in handles:
        h.remove()
    model.zero_grad(set_to_none=True)
    return acts, {n: o.grad.detach().clone() for n, o in outs.items()}


# --- factors --------------------------------------------------------------------------------------
@pytest.mark.parametrize("block_size", [4096, 16])
def test_factor_sums_equal_explicit_einsum_over_autograd_tensors(block_size: int) -> None:
    """Σ a aᵀ and Σ g gᵀ over unpadded tokens (block-diagonal when a side is wider than the block)."""
    model = tiny_llama()
    ex = examples([9, 5, 12, 7])
    batch = lm_batches(ex, 4)[0]  # padded: masks matter
    names = list(linear_modules(model))
    acts, grads = trace(model, batch, names, example_losses)
    col = FactorCollector(model, linear_modules(model), FP32, block_size)
    with col:
        col.step(batch, example_losses)
    keep = batch["attention_mask"].bool()
    tokens = int(keep.sum())
    for n in names:
        for side, x in (("a", acts[n][keep]), ("g", grads[n][keep])):
            full = torch.einsum("ni,nj->ij", x.double(), x.double())
            assert col.counts[f"{n}|{side}"] == tokens
            for k, sl in enumerate(side_blocks(x.shape[1], block_size)):
                torch.testing.assert_close(
                    col.sums[f"{n}|{side}|{k}"].double(), full[sl, sl], rtol=1e-5, atol=1e-6
                )
    assert all(p.requires_grad for p in model.parameters())  # restored on exit


def test_eigenbasis_reconstructs_the_covariance() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(50, 7, generator=gen, dtype=F64)
    basis = decompose([x.T @ x], 50, dtype=F64)
    q = basis.vectors[0]
    torch.testing.assert_close(q @ torch.diag(basis.values) @ q.T, x.T @ x / 50)
    torch.testing.assert_close(q.T @ q, torch.eye(7, dtype=F64))


@pytest.mark.parametrize("block_size", [4096, 3])
def test_kfac_preconditioning_equals_a_dense_kronecker_solve(block_size: int) -> None:
    """Q_G[(Q_Gᵀ X Q_A) ⊘ (λ_G λ_Aᵀ + δ)]Q_Aᵀ = (G ⊗ A + δI)⁻¹ vec X, with G, A from the data."""
    gen = torch.Generator().manual_seed(1)
    a = torch.randn(6, 3, 5, generator=gen, dtype=F64)  # [B, T, in]
    g = torch.randn(6, 3, 4, generator=gen, dtype=F64)  # [B, T, out]
    grads = torch.einsum("bto,bti->boi", g, a)  # per-example ∇W [B, out, in]
    sums = {}
    for name, x in (("a", a), ("g", g)):
        flat = x.reshape(-1, x.shape[-1])
        sums[name] = [flat[:, sl].T @ flat[:, sl] for sl in side_blocks(x.shape[-1], block_size)]
    mf = ModuleFactors(decompose(sums["a"], 18, F64), decompose(sums["g"], 18, F64))
    h = torch.kron(torch.block_diag(*sums["g"]), torch.block_diag(*sums["a"])) / 18**2
    delta = mf.damping("kfac")
    assert delta == pytest.approx(
        0.1 * float(torch.trace(h)) / h.shape[0], rel=1e-12
    )  # 0.1 × mean eigenvalue
    expected = torch.linalg.solve(h + delta * torch.eye(20, dtype=F64), grads.reshape(6, 20).T).T
    torch.testing.assert_close(
        mf.precondition(grads, "kfac", delta).reshape(6, 20), expected, rtol=1e-9, atol=1e-12
    )


def test_ekfac_correction_equals_brute_force_over_per_example_gradients() -> None:
    """Λ = mean_n (Q_Gᵀ ∇W_n Q_A)² from the hooks equals the same from autograd's per-example
    gradients; EK-FAC preconditioning equals solving with (Q_G⊗Q_A) diag(Λ) (Q_G⊗Q_A)ᵀ + δI."""
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(5, 4, bias=False))
    x, y = torch.randn(7, 3, 5), torch.randn(7, 3, 4)

    def loss(m: nn.Module, b: dict[str, torch.Tensor]) -> torch.Tensor:
        return ((m(b["x"]) - b["y"]) ** 2).sum(dim=(1, 2))  # [B], summed over 3 tokens

    batches = [{"x": x[:4], "y": y[:4]}, {"x": x[4:], "y": y[4:]}]
    factors = fit_kfac(model, batches, loss, kind="ekfac", modules=("*",))
    mf = factors.modules["0"]
    per_example = []
    for n in range(7):
        model.zero_grad()
        loss(model, {"x": x[n : n + 1], "y": y[n : n + 1]}).sum().backward()
        per_example.append(model[0].weight.grad.double().clone())
    grads = torch.stack(per_example)  # [7, out, in]
    a_cov = torch.einsum("bti,btj->ij", x.double(), x.double()) / 21
    qa, qg = mf.a.vectors[0].double(), mf.g.vectors[0].double()
    torch.testing.assert_close(qa @ torch.diag(mf.a.values.double()) @ qa.T, a_cov, rtol=1e-5, atol=1e-6)
    lam = (qg.T @ grads @ qa).square().mean(dim=0)
    torch.testing.assert_close(mf.corrected.double(), lam, rtol=1e-5, atol=1e-6)  # type: ignore[union-attr]
    delta = mf.damping("ekfac")
    assert delta == pytest.approx(0.1 * float(lam.mean()), rel=1e-5)
    expected = kron_solve(mf, "ekfac", grads, delta)
    # fp32 eigenvectors are orthogonal to ~1e-7, so the dense inverse differs at ~1e-5 relative
    torch.testing.assert_close(mf.precondition(grads, "ekfac", delta), expected, rtol=1e-4, atol=1e-6)
    assert factors.examples == 7


def test_batch_size_and_padding_do_not_change_the_factors() -> None:
    """Batches of 1 (no padding) and of 4 (padded) give the same A, G and Λ sums to fp32 precision."""
    model = tiny_llama()
    ex = examples([6, 11, 4, 9, 13, 5, 8, 10])
    results = []
    for size in (1, 4):
        factors = fit_kfac(model, lm_batches(ex, size), example_losses, kind="ekfac")
        results.append(factors)
    one, four = results
    for name, mf in one.modules.items():
        other = four.modules[name]
        for x, y in ((mf.a, other.a), (mf.g, other.g)):
            torch.testing.assert_close(x.values, y.values, rtol=1e-4, atol=1e-6 * float(x.values.max()))
        scale = float(mf.corrected.abs().max())  # type: ignore[union-attr]
        torch.testing.assert_close(mf.corrected, other.corrected, rtol=1e-3, atol=1e-5 * scale)


def _fit_shard(rank: int, world: int, store: str, out: str) -> None:
    """One torchrun-like process: fit on every world-th batch, reduce, save rank 0's factors."""
    import torch.distributed as tdist

    tdist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    batches = lm_batches(examples([6, 11, 4, 9, 13, 5, 8, 10, 7, 12]), 2)  # 5 batches: uneven shards
    factors = fit_kfac(
        tiny_llama(), batches[rank::world], example_losses, dist=Distributed(rank, world, rank)
    )
    if rank == 0:
        save_factors(factors, out)
    # as the CLI ends a run (assay.cli._finish_distributed): a barrier, the teardown, then an exit
    # that skips interpreter finalization, where gloo's threads can still abort the process
    finish_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@pytest.mark.slow
def test_sharded_fit_over_two_processes_equals_one_process(tmp_path) -> None:
    """Two gloo processes on alternate batches, statistics all-reduced: the same factors as one.
    Slow (~30 s on a busy 2-core machine): each spawned process imports transformers."""
    import torch.multiprocessing as mp

    out = str(tmp_path / "kfac.safetensors")
    mp.spawn(_fit_shard, args=(2, str(tmp_path / "store"), out), nprocs=2, join=True)
    sharded = load_factors(out)
    whole = fit_kfac(
        tiny_llama(), lm_batches(examples([6, 11, 4, 9, 13, 5, 8, 10, 7, 12]), 2), example_losses
    )
    assert sharded.examples == whole.examples == 10
    for name, mf in whole.modules.items():
        other = sharded.modules[name]
        torch.testing.assert_close(
            other.a.values, mf.a.values, rtol=1e-4, atol=1e-6 * float(mf.a.values.max())
        )
        torch.testing.assert_close(
            other.g.values, mf.g.values, rtol=1e-4, atol=1e-6 * float(mf.g.values.max())
        )
        scale = float(mf.corrected.abs().max())  # type: ignore[union-attr]
        torch.testing.assert_close(other.corrected, mf.corrected, rtol=1e-3, atol=1e-5 * scale)


@pytest.mark.parametrize(("precision", "tolerance"), [("bf16", (0.03, 0.1)), ("fp16", (0.005, 0.02))])
def test_mixed_precision_factors_are_close_to_fp32(precision: str, tolerance: tuple[float, float]) -> None:
    """Autocast forward/backward, fp32 accumulation (fp16: with loss scaling). Worst relative
    Frobenius error over modules of A and G (rebuilt from their eigenbases) and of Λ; measured
    bf16 ≈ 0.01 / 0.05, fp16 ≈ 0.001 / 0.002 on this model."""
    model = tiny_llama()
    batches = lm_batches(examples([12, 9, 14, 11, 7, 10, 13, 8], seed=3), 4)
    ref, low = (fit_kfac(model, batches, example_losses, precision=p) for p in ("fp32", precision))
    worst_side, worst_lambda = 0.0, 0.0
    for name, mf in ref.modules.items():
        for side in ("a", "g"):
            x, y = getattr(mf, side), getattr(low.modules[name], side)
            full, approx = (
                (b.vectors[0].double() * b.values.double()) @ b.vectors[0].double().T for b in (x, y)
            )
            worst_side = max(worst_side, float((approx - full).norm() / full.norm()))
        lam, lam_low = mf.corrected, low.modules[name].corrected
        worst_lambda = max(worst_lambda, float((lam_low - lam).norm() / lam.norm()))  # type: ignore[operator,union-attr]
        assert not lam_low.requires_grad  # type: ignore[union-attr]
    assert 0 < worst_side < tolerance[0] and 0 < worst_lambda < tolerance[1], (worst_side, worst_lambda)


# --- scores ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("make", [tiny_llama, tiny_gpt2], ids=["llama", "gpt2-conv1d"])
def test_lm_end_to_end_against_dense_solves_on_raw_gradients(make) -> None:
    """Tiny LM: EK-FAC factors, preconditioned queries, scores = Σ_m q_mᵀ (H_m + δ_m)⁻¹ t_m with
    H_m formed densely and t the collector's raw per-example gradients; Λ from those gradients."""
    model = make()
    train = examples([7, 10, 5, 12, 9, 6], seed=4)
    queries = examples([8, 11], seed=5)
    batches = lm_batches(train, 3)
    factors = fit_kfac(model, batches, example_losses, kind="ekfac")
    raw_train = collect_gradients(model, batches, example_losses, modules=("!*lm_head",), projection_dim=0)
    raw_query = collect_gradients(model, lm_batches(queries, 2), example_losses, projection_dim=0)
    pre = precondition_queries(model, factors, lm_batches(queries, 2), example_losses, Projector(0))
    assert pre.modules == raw_train.modules
    expected = torch.zeros(2, 6, dtype=F64)
    for name, sl in raw_train.modules.items():
        mf = factors.modules[name]
        shape = (mf.a.size, mf.g.size) if mf.conv1d else (mf.g.size, mf.a.size)
        t = raw_train.rows[:, sl].reshape(-1, *shape).double()
        q = raw_query.rows[:, sl].reshape(-1, *shape).double()
        t, q = (t.transpose(1, 2), q.transpose(1, 2)) if mf.conv1d else (t, q)  # -> [N, out, in]
        qa, qg = mf.a.vectors[0].double(), mf.g.vectors[0].double()
        lam = (qg.T @ t @ qa).square().mean(dim=0)
        torch.testing.assert_close(mf.corrected.double(), lam, rtol=2e-4, atol=1e-6 * float(lam.max()))  # type: ignore[union-attr]
        solved = kron_solve(mf, "ekfac", q, mf.damping("ekfac"))
        expected += torch.einsum("qoi,noi->qn", solved, t)
    got = pre.rows.double() @ raw_train.rows.double().T
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5 * float(expected.abs().max()))


@pytest.fixture(scope="module")
def classifier():
    model = mlp()
    batches = classifier_data()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(40):  # briefly trained: gradients differ between examples
        for b in batches:
            opt.zero_grad()
            ce_loss(model, b).mean().backward()
            opt.step()
    return model, batches, classifier_data(24, seed=1)


def test_precondition_then_project_is_an_unbiased_estimate() -> None:
    """Query rows are P_out X_q P_inᵀ of the exact preconditioned query X_q, and the mean over
    projection seeds of ⟨P_out X P_inᵀ, P_out t P_inᵀ⟩ converges to ⟨X, t⟩ (E[PᵀP] = I per side)."""
    model, batches = mlp(), classifier_data(32)
    factors = fit_kfac(model, batches, ce_loss, modules=("*",))
    exact = precondition_queries(model, factors, batches[:1], ce_loss, Projector(0))
    proj = precondition_queries(model, factors, batches[:1], ce_loss, Projector(8, seed=2))
    for name, sl in proj.modules.items():
        x = exact.rows[:, exact.modules[name]].reshape(16, factors.modules[name].g.size, -1)
        torch.testing.assert_close(proj.rows[:, sl], Projector(8, 2).project_full(name, x).reshape(16, -1))
    gen = torch.Generator().manual_seed(0)
    x, t = torch.randn(3, 4, generator=gen, dtype=F64), torch.randn(3, 4, generator=gen, dtype=F64)
    draws = torch.tensor(
        [
            float((Projector(4, s).project_full("m", x) * Projector(4, s).project_full("m", t)).sum())
            for s in range(3000)
        ]
    )
    assert abs(float(draws.mean()) - float((x * t).sum())) < 4 * float(draws.std()) / 3000**0.5


def test_projected_curvature_equals_the_explicit_projection_of_h() -> None:
    """M = (P_out ⊗ P_in) H (P_out ⊗ P_in)ᵀ with H = (Q_G⊗Q_A) diag(Λ) (Q_G⊗Q_A)ᵀ formed densely."""
    model, batches = mlp(), classifier_data(32)
    factors = fit_kfac(model, batches, ce_loss, modules=("*",))
    proj = Projector(5, seed=1)
    for kind in ("ekfac", "kfac"):
        curv = projected_curvature(factors, proj, kind)  # type: ignore[arg-type]
        for name, mf in factors.modules.items():
            p = torch.kron(proj.matrix(name, "out", mf.g.size), proj.matrix(name, "in", mf.a.size)).to(F64)
            basis = torch.kron(mf.g.vectors[0].to(F64), mf.a.vectors[0].to(F64))
            h = (basis * mf.eigenvalues(kind).to(F64).reshape(-1)) @ basis.T  # type: ignore[arg-type]
            torch.testing.assert_close(curv[name], p @ h @ p.T, rtol=1e-6, atol=1e-9)


def test_projected_curvature_is_exact_when_the_projection_is_injective() -> None:
    """With p ≥ in, out, ⟨P q, (P H Pᵀ)⁻¹ P t⟩ = ⟨q, H⁻¹ t⟩ (Pᵀ(P H Pᵀ)⁺P = H⁻¹ for full column rank P)."""
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(3, 2, bias=False))
    x, y = torch.randn(40, 5, 3), torch.randn(40, 5, 2)

    def loss(m: nn.Module, b: dict[str, torch.Tensor]) -> torch.Tensor:
        return ((m(b["x"]) - b["y"]) ** 2).sum(dim=(1, 2))

    batches = [{"x": x[i : i + 10], "y": y[i : i + 10]} for i in range(0, 40, 10)]
    factors = fit_kfac(model, batches, loss, modules=("*",))
    proj = Projector(8, seed=4)
    raw = collect_gradients(model, batches, loss, modules=("*",), projection_dim=0)
    rows = collect_gradients(model, batches, loss, modules=("*",), projection_dim=8, seed=4)
    exact = precondition_queries(model, factors, batches[:1], loss, Projector(0), absolute_damping=0.0)
    m_pinv = torch.linalg.pinv(projected_curvature(factors, proj)["0"], hermitian=True, rtol=1e-10)  # rank 6
    got = rows.rows[:10].double() @ m_pinv @ rows.rows.double().T
    expected = exact.rows.double() @ raw.rows.double().T
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5 * float(expected.abs().max()))


def test_projected_curvature_tracks_exact_scores_better_than_projecting_the_query(classifier) -> None:
    """On a trained classifier at p = 32 (median per-query Pearson with the exact, unprojected
    EK-FAC influence): whitening with P H Pᵀ in the projected space > 0.75, far above projecting
    the fully preconditioned query (whose JL noise grows with ‖(H + δ)⁻¹ g_q‖; measured -0.06)."""
    model, batches, queries = classifier
    factors = fit_kfac(model, batches, ce_loss, modules=("*",))
    raw_t = collect_gradients(model, batches, ce_loss, projection_dim=0)
    exact = precondition_queries(model, factors, queries, ce_loss, Projector(0)).rows @ raw_t.rows.T
    train = collect_gradients(model, batches, ce_loss, projection_dim=32, seed=7)
    query = collect_gradients(model, queries, ce_loss, projection_dim=32, seed=7)
    white = build_whitening(projected_curvature(factors, Projector(32, 7)), 1, None, train.modules, mix=0.0)
    whitened = white.apply(query.rows, times=2) @ train.rows.T
    projected = (
        precondition_queries(model, factors, queries, ce_loss, Projector(32, seed=7)).rows @ train.rows.T
    )

    def median_corr(approx: torch.Tensor) -> float:
        return float(np.median([np.corrcoef(exact[i].numpy(), approx[i].numpy())[0, 1] for i in range(24)]))

    assert median_corr(whitened) > 0.75
    assert median_corr(whitened) > median_corr(projected) + 0.3


def test_save_load_round_trip(classifier, tmp_path) -> None:
    model, batches, queries = classifier
    factors = fit_kfac(model, batches, ce_loss, modules=("*",))
    loaded = load_factors(save_factors(factors, tmp_path / "kfac.safetensors"))
    assert (loaded.kind, loaded.fisher, loaded.examples, list(loaded.modules)) == (
        "ekfac",
        "empirical",
        96,
        list(factors.modules),
    )
    for kind in ("ekfac", "kfac"):
        a = precondition_queries(model, factors, queries, ce_loss, Projector(8), kind=kind)  # type: ignore[arg-type]
        b = precondition_queries(model, loaded, queries, ce_loss, Projector(8), kind=kind)  # type: ignore[arg-type]
        torch.testing.assert_close(a.rows, b.rows, rtol=0, atol=0)
    with pytest.raises(AssayError, match="not an assay K-FAC factor file"):
        from safetensors.torch import save_file

        save_file({"x": torch.zeros(1)}, str(tmp_path / "other.safetensors"))
        load_factors(tmp_path / "other.safetensors")


def test_load_refuses_a_header_that_contradicts_its_tensors(classifier, tmp_path) -> None:
    """A file whose kind or tensors were changed after save_factors fails in one line on load."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    model, batches, _ = classifier
    path = save_factors(fit_kfac(model, batches, ce_loss, modules=("*",)), tmp_path / "kfac.safetensors")
    with safe_open(str(path), framework="pt") as f:
        meta, tensors = dict(f.metadata()), {k: f.get_tensor(k) for k in f.keys()}

    def rewritten(meta_change: dict[str, str], drop: str = ""):
        out = tmp_path / "edited.safetensors"
        kept = {k: v for k, v in tensors.items() if not (drop and k.endswith(drop))}
        save_file(kept, str(out), metadata={**meta, **meta_change})
        return out

    with pytest.raises(AssayError, match="its kind is 'EKFAC', not kfac or ekfac"):
        load_factors(rewritten({"kind": "EKFAC"}))
    with pytest.raises(AssayError, match="has no EK-FAC eigenvalues though its kind is ekfac"):
        load_factors(rewritten({}, drop="/lambda"))
    assert load_factors(rewritten({"kind": "kfac"}, drop="/lambda")).kind == "kfac"  # K-FAC needs no Λ


def test_absolute_damping_and_kfac_from_ekfac_factors(classifier) -> None:
    """kind="kfac" on EK-FAC factors ignores Λ; a huge damping turns influence into ⟨q, t⟩/δ."""
    model, batches, queries = classifier
    factors = fit_kfac(model, batches, ce_loss, modules=("*",))
    raw_q = collect_gradients(model, queries, ce_loss, modules=("*",), projection_dim=0)
    big = precondition_queries(model, factors, queries, ce_loss, Projector(0), absolute_damping=1e8)
    torch.testing.assert_close(big.rows * 1e8, raw_q.rows, rtol=1e-4, atol=1e-6)
    k = precondition_queries(model, factors, queries, ce_loss, Projector(0), kind="kfac")
    e = precondition_queries(model, factors, queries, ce_loss, Projector(0), kind="ekfac")
    assert not torch.allclose(k.rows, e.rows, rtol=1e-2)


# --- the Fisher -----------------------------------------------------------------------------------
def test_sampled_labels_give_the_true_fisher_of_a_softmax() -> None:
    """Labels drawn from the model: E[g gᵀ] at the logits is diag(p) − p pᵀ (the GGN of softmax
    cross-entropy), whatever the data's labels; the empirical Fisher is not."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4, bias=False))
    x = torch.tensor([[1.0, -0.5, 0.3]]).repeat(20000, 1)
    batches = [
        {"x": x[i : i + 5000], "y": torch.zeros(5000, dtype=torch.long)} for i in range(0, 20000, 5000)
    ]
    probs = torch.softmax(model(x[:1]), dim=-1)[0].detach().double()
    true_fisher = torch.diag(probs) - torch.outer(probs, probs)
    sampled = SampledCrossEntropy(lambda m, b: m(b["x"]), seed=0)
    for loss_fn, close in ((sampled, True), (ce_loss, False)):
        col = FactorCollector(model, {"0": model[0]}, FP32)
        with col:
            for b in batches:
                col.step(b, loss_fn)
        g = col.sums["0|g|0"].double() / col.counts["0|g"]
        assert torch.allclose(g, true_fisher, atol=0.01) == close
    assert fit_kfac(model, batches, sampled, kind="kfac", modules=("*",)).fisher == "sampled"


def test_sampled_lm_losses_keep_the_label_mask() -> None:
    """Only positions that carry a label are resampled: a prompt-only example has zero loss and
    the same seed draws the same labels again."""
    model = tiny_llama()
    ex = examples([9, 6])
    ex.loss_start[:] = [9, 3]  # the first example has no target tokens
    batch = lm_batches(ex, 2)[0]
    with torch.no_grad():
        first = SampledLmLosses(seed=3)(model, batch)
        again = SampledLmLosses(seed=3)(model, batch)
        other = SampledLmLosses(seed=4)(model, batch)
    assert float(first[0]) == 0.0 and float(first[1]) > 0
    torch.testing.assert_close(first, again)
    assert not torch.equal(first, other)


def test_errors_are_one_line() -> None:
    model = mlp()
    batches = classifier_data(32)
    with pytest.raises(AssayError, match="pass a list of batches"):
        fit_kfac(model, iter(batches), ce_loss, modules=("*",))
    factors = fit_kfac(model, batches, ce_loss, kind="kfac", modules=("*",))
    with pytest.raises(AssayError, match="no EK-FAC eigenvalue correction"):
        precondition_queries(model, factors, batches, ce_loss, Projector(0), kind="ekfac")
    other = nn.Sequential(
        nn.Linear(12, 8, bias=False), nn.Tanh(), nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)
    )
    with pytest.raises(AssayError, match="another shape"):
        precondition_queries(other, factors, batches, ce_loss, Projector(0))
    assert isinstance(factors, KronFactors)
