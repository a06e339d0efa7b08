"""Attributing an SAE latent: the query gradient against autograd, and a planted driver example."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from assay.attribution.build import GradientSetup, collect
from assay.attribution.collector import linear_modules
from assay.attribution.projection import Projector
from assay.bridge.latent import latent_objective, latent_query_gradients, load_hooked_sae
from assay.core.errors import AssayError
from assay.core.precision import PrecisionPolicy
from assay.lm.data import Examples, collate
from assay.lm.losses import example_losses
from tests.helpers import tiny_llama

FP32 = PrecisionPolicy.resolve("fp32", "cpu")
HOOK = "model.layers.0"  # output of block 0 = hidden_states[1]
VOCAB = 96


def save_sae(folder: Path, tensors: dict[str, torch.Tensor], architecture: str, k: int | None = None) -> Path:
    """An SAE folder in SAELens format, written by hand (independent of any trainer)."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    save_file({n: t.contiguous() for n, t in tensors.items()}, str(folder / "sae_weights.safetensors"))
    d_in, d_sae = tensors["W_enc"].shape
    cfg = {"architecture": architecture, "d_in": d_in, "d_sae": d_sae, "dtype": "float32",
           "apply_b_dec_to_input": True, "normalize_activations": "none",
           "metadata": {"hook_name": HOOK, "model_name": "tiny"}}  # fmt: skip
    if k is not None:
        cfg["k"] = k
    (folder / "cfg.json").write_text(json.dumps(cfg))
    return folder


def random_sae(d_in: int, d_sae: int, seed: int, architecture: str = "topk") -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(d_in, d_sae, generator=g) / d_in**0.5
    out = {"W_enc": w, "b_enc": 0.1 * torch.randn(d_sae, generator=g), "W_dec": w.T.clone(),
           "b_dec": 0.1 * torch.randn(d_in, generator=g)}  # fmt: skip
    if architecture == "jumprelu":
        out["threshold"] = torch.full((d_sae,), 0.05)
    return out


def examples_of(lengths: list[int], seed: int) -> Examples:
    rng = np.random.default_rng(seed)
    return Examples(
        ids=np.arange(len(lengths), dtype=np.int64),
        offsets=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
        tokens=rng.integers(1, VOCAB, size=sum(lengths)).astype(np.int32),
        loss_start=np.ones(len(lengths), dtype=np.int64),
    )


def setup_for(model: nn.Module, projection_dim: int = 0, policy: PrecisionPolicy = FP32) -> GradientSetup:
    modules = linear_modules(model.eval(), ("!*lm_head",))
    return GradientSetup(model, None, policy, modules, Projector(projection_dim, 0), None, pad_id=0)


def reference_latent_sum(
    model: nn.Module, t: dict[str, torch.Tensor], arch: str, k: int, tokens, latent: int
):
    """f(x) = Σ_t a_latent(h_t), written out from the formulas (dense encode, explicit top-k)."""
    h = model(input_ids=tokens[None], output_hidden_states=True).hidden_states[1][0]  # [T, d_in]
    pre = (h - t["b_dec"]) @ t["W_enc"] + t["b_enc"]  # [T, d_sae]
    if arch == "topk":
        kth = pre.detach().sort(dim=-1, descending=True).values[:, k - 1 : k]
        z = torch.relu(pre) * (pre >= kth)
    elif arch == "jumprelu":
        z = pre * (pre > t["threshold"])
    else:
        z = torch.relu(pre)
    return z[:, latent].sum()


@pytest.mark.parametrize("arch", ["topk", "standard", "jumprelu"])
def test_query_gradient_equals_autograd_of_the_latent(tmp_path, arch):
    """Batched, padded collection == per-example autograd of -Σ_t a_L(h_t), module by module."""
    model = tiny_llama(1, vocab_size=VOCAB).eval()
    tensors = random_sae(32, 64, seed=2, architecture=arch)
    sae = load_hooked_sae(save_sae(tmp_path / "sae", tensors, arch, k=8 if arch == "topk" else None))
    examples = examples_of([5, 11, 8, 3], seed=3)
    with torch.no_grad():  # the latent that fires most on these texts
        h = model(
            input_ids=torch.from_numpy(examples.tokens[None].astype(np.int64)), output_hidden_states=True
        )
        latent = int(sae.sae.encode(h.hidden_states[1][0]).sum(0).argmax())
    setup = setup_for(model)
    got = collect(setup, examples, token_batch_size=64, objective=latent_objective(sae, latent))  # [4, D]
    slots = setup.collector().slots
    for i in range(len(examples)):
        tokens = torch.from_numpy(examples.tokens_of(i).astype(np.int64))
        weights = [setup.modules[s.name].weight for s in slots]
        f = reference_latent_sum(model, tensors, arch, 8, tokens, latent)
        grads = torch.autograd.grad(-f, weights, allow_unused=True)
        ref = torch.cat(
            [(g if g is not None else torch.zeros_like(w)).reshape(-1) for g, w in zip(grads, weights)]
        )
        np.testing.assert_allclose(got[i], ref.numpy(), rtol=1e-4, atol=1e-6)
    later = [s for s in slots if s.name.startswith("model.layers.1.")]
    assert later and not np.any(got[:, later[0].start : later[-1].stop])  # after the hookpoint: no gradient
    assert np.abs(got).sum() > 0


def test_projected_and_bf16_query_gradients(tmp_path):
    """The projected rows are the projection of the raw ones; bf16 autocast agrees with fp32."""
    model = tiny_llama(1, vocab_size=VOCAB).eval()
    sae = load_hooked_sae(
        save_sae(tmp_path / "sae", random_sae(32, 64, seed=2, architecture="standard"), "standard")
    )
    examples = examples_of([6, 9, 12], seed=4)
    objective = latent_objective(sae, latent=5, activation="pre")
    raw = collect(setup_for(model, 0), examples, 64, objective)
    proj_setup = setup_for(model, 8)
    projected = collect(proj_setup, examples, 64, objective)
    for s_raw, s_proj in zip(setup_for(model, 0).collector().slots, proj_setup.collector().slots):
        full = torch.from_numpy(raw[:, s_raw.start : s_raw.stop]).reshape(
            -1, s_raw.out_features, s_raw.in_features
        )
        ref = proj_setup.projector.project_full(s_raw.name, full).reshape(len(examples), -1)
        np.testing.assert_allclose(
            projected[:, s_proj.start : s_proj.stop], ref.numpy(), rtol=1e-4, atol=1e-5
        )
    bf16 = collect(setup_for(model, 8, PrecisionPolicy.resolve("bf16", "cpu")), examples, 64, objective)
    cos = (bf16 * projected).sum(1) / (np.linalg.norm(bf16, axis=1) * np.linalg.norm(projected, axis=1))
    assert np.all(cos > 0.98), cos


def _step(model: nn.Module, setup: GradientSetup, examples: Examples, i: int, lr: float) -> dict:
    """One SGD step on example i's loss over the collected modules; returns the old weights."""
    batch = collate(examples, np.array([i]), pad_id=0)
    weights = [m.weight for m in setup.modules.values()]
    grads = torch.autograd.grad(example_losses(model, batch).sum(), weights)
    old = {id(w): w.detach().clone() for w in weights}
    with torch.no_grad():
        for w, g in zip(weights, grads):
            w -= lr * g
    return old


def _restore(setup: GradientSetup, old: dict) -> None:
    with torch.no_grad():
        for m in setup.modules.values():
            m.weight.copy_(old[id(m.weight)])


def _hook_sum(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=tokens[None], output_hidden_states=True).hidden_states[1][0].sum(0)  # [d_in]


def test_planted_driver_ranks_first_and_scores_predict_retraining(tmp_path):
    """Latent 0 reads the direction in which a step on training example 3 moves the query's
    activations, made orthogonal to the directions the other examples' steps move them: to first
    order only example 3 drives it. Ground truth by real SGD steps; the attribution (inner
    product of the latent's query gradient with each loss gradient) must put example 3 first
    and predict every example's measured change (first order: Δf ≈ lr · score)."""
    model = tiny_llama(5, vocab_size=VOCAB).eval()
    for p in model.parameters():
        p.requires_grad_(True)
    setup = setup_for(model)
    train = examples_of([12, 9, 14, 10, 11, 13, 8, 12], seed=6)
    query = examples_of([10], seed=7)
    q_tokens = torch.from_numpy(query.tokens_of(0).astype(np.int64))
    driver, lr = 3, 1e-3
    base = _hook_sum(model, q_tokens)
    moves = []  # [d_in] per example: how a step on it moves the query's summed activations
    for i in range(len(train)):
        old = _step(model, setup, train, i, lr)
        moves.append((_hook_sum(model, q_tokens) - base).double())
        _restore(setup, old)
    others = torch.stack([m for i, m in enumerate(moves) if i != driver], 1)  # [d_in, 7]
    q, _ = torch.linalg.qr(others)
    direction = moves[driver] - q @ (q.T @ moves[driver])  # orthogonal to the others' moves
    tensors = random_sae(32, 16, seed=8, architecture="standard")
    tensors["W_enc"][:, 0] = (direction / direction.norm()).float()
    with torch.no_grad():
        h = model(input_ids=q_tokens[None], output_hidden_states=True).hidden_states[1][0]
        tensors["b_enc"][0] = 1.0 - ((h - tensors["b_dec"]) @ tensors["W_enc"][:, 0]).min()  # always active
    sae = load_hooked_sae(save_sae(tmp_path / "sae", tensors, "standard"))

    def feature() -> float:
        with torch.no_grad():
            h = model(input_ids=q_tokens[None], output_hidden_states=True).hidden_states[1][0]
            return float(sae.sae.encode(h)[:, 0].sum())

    before, measured = feature(), []
    for i in range(len(train)):
        old = _step(model, setup, train, i, lr)
        measured.append(feature() - before)
        _restore(setup, old)
    assert int(np.argmax(measured)) == driver  # the construction works (ground truth)

    q_grad = collect(setup, query, 64, latent_objective(sae, 0))  # [1, D]: ∇(-f)
    t_grad = collect(setup, train, 64)  # [8, D]: loss gradients
    scores = (t_grad @ q_grad[0]).astype(np.float64)  # "inner" mode
    assert int(np.argmax(scores)) == driver
    np.testing.assert_allclose(lr * scores, measured, rtol=0.05, atol=0.05 * max(abs(m) for m in measured))
    cosine = scores / np.linalg.norm(t_grad, axis=1)
    assert int(np.argmax(cosine)) == driver


def test_load_sae_errors_and_silent_latent(tmp_path):
    with pytest.raises(AssayError, match="holds no SAE"):
        load_hooked_sae(tmp_path)
    sae_dir = save_sae(tmp_path / "sae", random_sae(32, 16, seed=0), "topk", k=4)
    sae = load_hooked_sae(sae_dir)
    assert sae.sae.arch.architecture == "topk" and sae.sae.arch.k == 4 and sae.hookpoint == HOOK
    with pytest.raises(AssayError, match="--latent"):
        latent_objective(sae, 16)
    tensors = random_sae(32, 16, seed=0, architecture="standard")
    tensors["b_enc"][2] = -1e3  # latent 2 can never fire
    dead_dir = save_sae(tmp_path / "dead", tensors, "standard")
    model = tiny_llama(1, vocab_size=VOCAB).eval()
    with pytest.raises(AssayError, match="never fires"):
        latent_query_gradients(setup_for(model), load_hooked_sae(dead_dir), 2, examples_of([6, 7], seed=0))


def test_latent_query_against_a_built_index(tmp_path, tiny_model_dir, texts_jsonl):
    """Through `assay build`'s index: the latent's query rows are computed with the index's settings
    and scoring them ranks training rows exactly as an explicit inner product / cosine does."""
    import assay
    from assay.attribution.build import setup_from_index
    from assay.attribution.score import ScoreOptions, score_index
    from assay.core.config import DataConfig
    from assay.lm.data import load_examples

    out = tmp_path / "idx"
    _build_index(out, tiny_model_dir, texts_jsonl)
    index = assay.open_index(out)
    setup = setup_from_index(index, device="cpu")
    sae_dir = save_sae(tmp_path / "sae", random_sae(32, 64, seed=3, architecture="standard"), "standard")
    _, queries = load_examples(DataConfig(dataset=str(texts_jsonl), max_samples=2), setup.tokenizer)
    sae = load_hooked_sae(sae_dir)
    with torch.no_grad():
        h = setup.model(
            input_ids=torch.from_numpy(queries.tokens_of(0)[None].astype(np.int64)), output_hidden_states=True
        )
        latent = int(sae.sae.encode(h.hidden_states[1][0]).sum(0).argmax())
    grads = latent_query_gradients(setup, sae, latent, queries, 64)  # [2, D]
    assert grads.shape == (2, index.dim) and np.all(np.abs(grads).sum(1) > 0)
    rows = np.asarray(index.gradients, dtype=np.float64)  # [N, D]
    for mode, ref in (("inner", rows @ grads[0]), ("cosine", rows @ grads[0] / np.linalg.norm(rows, axis=1))):
        top, _ = score_index(index, torch.from_numpy(grads[:1]), ScoreOptions(mode=mode, top_k=3))
        assert list(top.top_rows[0]) == list(np.argsort(-ref)[:3])


def test_most_active_latent_matches_a_dense_count(tmp_path):
    from assay.bridge.latent import most_active_latent

    model = tiny_llama(1, vocab_size=VOCAB).eval()
    sae = load_hooked_sae(save_sae(tmp_path / "sae", random_sae(32, 64, seed=2), "topk", k=8))
    examples = examples_of([5, 11, 8], seed=3)
    sums = torch.zeros(64)
    for i in range(len(examples)):  # each example alone: no padding at all
        tokens = torch.from_numpy(examples.tokens_of(i)[None].astype(np.int64))
        with torch.no_grad():
            sums += sae.sae.encode(
                model(input_ids=tokens, output_hidden_states=True).hidden_states[1][0]
            ).sum(0)
    assert most_active_latent(model, sae, examples, pad_id=0, token_batch_size=32) == int(sums.argmax())


def test_score_cli_attributes_a_latent(tmp_path, tiny_model_dir, texts_jsonl, capsys):
    """`assay score --query_sae SAE --latent L` ranks training rows by ⟨∇(-Σ a_L), row⟩ (inner mode),
    exactly as the Python path; the flags go together; a latent that never fires is refused."""
    import json

    import assay
    from assay.attribution.build import setup_from_index
    from assay.attribution.score import ScoreOptions
    from assay.cli import main
    from assay.commands.score import ScoreConfig, pick_latent
    from assay.core.config import QueryConfig
    from assay.lm.queries import load_queries

    idx, sae_dir = tmp_path / "idx", tmp_path / "sae"
    _build_index(idx, tiny_model_dir, texts_jsonl)
    tensors = random_sae(32, 64, seed=3, architecture="standard")
    tensors["b_enc"][7] = 5.0  # latent 7 fires everywhere
    tensors["b_enc"][8] = -1e3  # latent 8 never fires
    save_sae(sae_dir, tensors, "standard")
    texts = ["To be, or not to be", "X:3\nT:Some tune\nK:G\nGABc dedB|"]
    query = ["--query_text", *texts]  # one flag, several values (tyro keeps only the last repeat)
    out = tmp_path / "latent"
    score = ["score", str(out), "--index", str(idx), *query, "--mode", "inner", "--top_k", "3"]
    assert main([*score, "--query_sae", str(sae_dir), "--latent", "7"]) == 0
    records = [json.loads(line) for line in (out / "top.jsonl").read_text().splitlines()]
    saved = json.loads((out / "config.json").read_text())["config"]
    assert saved["query_sae"] == str(sae_dir) and saved["latent"] == 7
    index = assay.open_index(idx)
    setup = setup_from_index(index, device="cpu")
    queries = load_queries(
        QueryConfig(query_text=tuple(texts)), index.meta["data"]["max_length"], setup.tokenizer
    )
    grads = latent_query_gradients(setup, load_hooked_sae(sae_dir), 7, queries.examples, 64)  # [2, D]
    ref = np.asarray(index.gradients, dtype=np.float64) @ grads.T.astype(np.float64)  # [N, 2]
    for q, record in enumerate(records):
        assert [pid for pid, _ in record["proponents"]] == [
            int(index.ids[i]) for i in np.argsort(-ref[:, q])[:3]
        ]
        np.testing.assert_allclose(
            [v for _, v in record["proponents"]], np.sort(ref[:, q])[::-1][:3], rtol=1e-4
        )
    assert main([*score[:-2], "--top_k", "3", "--latent", "7", "--overwrite"]) == 2
    assert "go together" in capsys.readouterr().err
    assert main([*score, "--query_sae", str(sae_dir), "--latent", "8", "--overwrite"]) == 2
    assert "never fires" in capsys.readouterr().err
    picked = ScoreConfig(
        out=str(tmp_path / "picked"), index=str(idx), queries=QueryConfig(query_text=tuple(texts)),
        options=ScoreOptions(mode="inner"),
    )  # fmt: skip
    assert pick_latent(picked, str(sae_dir)) == 7  # the latent most active on the queries


def _build_index(out, model_dir, data) -> None:
    """A small fp32 index (p = 8) of the test texts, through the CLI."""
    from assay.cli import main

    args = ["build", str(out), "--model", str(model_dir), "--dataset", str(data), "--precision", "fp32"]
    assert main([*args, "--projection_dim", "8"]) == 0
