"""Per-token attribution (`--granularity token`) against independent references: plain autograd for
each position's term, the index row's score for their sum, and the report's heat map."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from assay.attribution.build import GradientSetup, collect
from assay.attribution.collector import linear_modules
from assay.attribution.kernel import plan_queries
from assay.attribution.normalizers import estimate_normalizer
from assay.attribution.projection import Projector
from assay.attribution.tokens import token_scores
from assay.cli import main
from assay.lm.data import collate
from assay.lm.losses import example_losses
from tests.helpers import FP32, random_examples, tiny_llama

LENGTHS = [9, 14, 5]


def _setup(projection_dim: int, normalizer: str = "none") -> GradientSetup:
    model = tiny_llama()
    modules = linear_modules(model)
    norm = None
    if normalizer != "none":
        sample = random_examples([8, 11, 6, 13], seed=3)
        norm = estimate_normalizer(normalizer, model, modules, sample, FP32, 0, 4096, 0.999)  # type: ignore[arg-type]
    return GradientSetup(model, None, FP32, modules, Projector(projection_dim, 0), norm, 0)


def autograd_terms(setup: GradientSetup, examples, vectors: torch.Tensor) -> list[np.ndarray]:
    """Reference: each example alone, plain autograd on every module's output; position t's term is
    Σ_m (P_out g_t)ᵀ V_m (P_in a_t) with a_t the module's input and g_t ∂loss/∂output at t."""
    seen: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def hook(name, _module, inputs, output):
        output.retain_grad()
        seen[name] = (inputs[0].detach(), output)

    handles = [
        m.register_forward_hook(lambda mod, i, o, n=n: hook(n, mod, i, o)) for n, m in setup.modules.items()
    ]
    slots = {s.name: s for s in setup.collector().slots}
    out = []
    try:
        for i in range(len(examples)):
            batch = collate(examples, np.array([i]), pad_id=0, pad_to=int(examples.lengths[i]))
            setup.model.zero_grad(set_to_none=True)
            example_losses(setup.model, batch).sum().backward()
            terms = torch.zeros(vectors.shape[0], int(examples.lengths[i]), dtype=torch.float64)
            for name, (a, y) in seen.items():
                g, a = y.grad[0].double(), a[0].double()  # [T, out], [T, in]
                s = slots[name]
                p = setup.projector
                p_out = p.matrix(name, "out", s.out_features, "cpu").double()
                p_in = p.matrix(name, "in", s.in_features, "cpu").double()
                v = vectors[:, s.start : s.stop].double().reshape(-1, *s.shape)  # [A, p, p]
                terms += torch.einsum("to,aop,tp->at", g @ p_out.T, v, a @ p_in.T)
            out.append(terms.numpy())
    finally:
        for h in handles:
            h.remove()
    return out


def test_each_positions_term_equals_plain_autograd():
    setup = _setup(projection_dim=4)
    examples = random_examples(LENGTHS, loss_start=[1, 4, 2])
    dim = setup.collector().dim
    vectors = torch.randn(2, dim, generator=torch.Generator().manual_seed(1))
    plan = plan_queries(vectors, "inner", "none")
    found = token_scores(setup, examples, list(range(len(LENGTHS))), plan, 4096)
    for pos, ref in enumerate(autograd_terms(setup, examples, vectors)):
        np.testing.assert_allclose(found[pos].terms, ref, rtol=1e-4, atol=1e-6 * np.abs(ref).max())


@pytest.mark.parametrize(
    "projection_dim, normalizer, mode",
    [
        (4, "none", "inner"),
        (4, "none", "cosine"),
        (0, "none", "inner"),
        (4, "adam", "inner"),
        (4, "adafactor", "cosine"),
    ],
)
def test_terms_sum_to_the_rows_score(projection_dim, normalizer, mode):
    """The terms of an example sum to the score of its row as `assay build` computes it."""
    setup = _setup(projection_dim, normalizer)
    examples = random_examples(LENGTHS, loss_start=[1, 4, 2])
    rows = torch.from_numpy(collect(setup, examples, 4096))  # [N, D]: the index's rows
    queries = torch.randn(3, rows.shape[1], generator=torch.Generator().manual_seed(2))
    plan = plan_queries(queries, mode, "none")
    want = (plan.vectors @ rows.T).numpy()  # [A, N]
    if mode == "cosine":
        want = want / np.linalg.norm(rows.numpy(), axis=1)
    found = token_scores(setup, examples, list(range(len(LENGTHS))), plan, 4096)
    for pos in range(len(LENGTHS)):
        split = found[pos]
        assert split.terms.shape == (3, LENGTHS[pos])
        np.testing.assert_allclose(split.scores, want[:, pos], rtol=1e-4, atol=1e-6 * np.abs(want).max())
        np.testing.assert_allclose(
            split.terms.sum(axis=1), split.scores, rtol=1e-4, atol=1e-6 * np.abs(want).max()
        )


def _score(out: Path, *args: str) -> list[dict]:
    query = ["--query_text", "the king and a folk tune", "--query_text", "my love of a jig"]
    assert main(["score", str(out), *args, *query, "--granularity", "token", "--token_proponents", "3"]) == 0
    return [json.loads(line) for line in (out / "tokens.jsonl").read_text().splitlines()]


def test_tokens_jsonl_sums_to_top_jsonl_and_the_report_shows_it(tmp_path, tiny_model_dir, texts_jsonl):
    flags = ["--precision", "fp32", "--projection_dim", "4"]
    build = ["build", str(tmp_path / "idx"), "--model", str(tiny_model_dir), "--dataset", str(texts_jsonl)]
    assert main([*build, *flags, "--preconditioner", "trackstar"]) == 0
    records = _score(tmp_path / "s", "--index", str(tmp_path / "idx"), "--mode", "trackstar")
    top = [json.loads(line) for line in (tmp_path / "s" / "top.jsonl").read_text().splitlines()]
    wanted = [(r["query"], pid, v) for r in top for pid, v in r["proponents"][:3]]
    assert [(r["query"], r["id"]) for r in records] == [(q, pid) for q, pid, _ in wanted]
    for record, (_, _, value) in zip(records, wanted):
        assert record["score"] == pytest.approx(value)
        assert sum(record["scores"]) == pytest.approx(value, rel=1e-4, abs=1e-6)
        assert len(record["tokens"]) == len(record["scores"]) > 0
    streamed = _score(
        tmp_path / "t",
        "--model",
        str(tiny_model_dir),
        "--dataset",
        str(texts_jsonl),
        *flags,
        "--mode",
        "cosine",
    )
    assert all(sum(r["scores"]) == pytest.approx(r["score"], rel=1e-4, abs=1e-6) for r in streamed)
    assert main(["report", str(tmp_path / "s"), "--out", str(tmp_path / "page.html")]) == 0
    page = (tmp_path / "page.html").read_text()
    assert "Which tokens drive the score" in page and 'class="tok"' in page
