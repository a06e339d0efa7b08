"""kfac_influence against a reference built from autograd's per-example gradients and dense
Kronecker solves (fp64), with a query objective other than the training loss."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from assay.attribution.kfac_fit import fit_kfac
from assay.attribution.kfac_influence import kfac_influence
from assay.attribution.precondition import single_thread
from assay.core.errors import AssayError
from tests.helpers import ce_loss, classifier_data, kron_solve, mlp


def class_zero(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """A measurement unlike the training loss: -log p(class 0) per example."""
    return -F.log_softmax(model(batch["x"]), dim=1)[:, 0]


def weight_grads(model: nn.Module, batches, fn) -> dict[str, torch.Tensor]:
    """{module: [N, out, in]} per-example weight gradients by plain autograd, one example at a time."""
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    mods = dict(model.named_modules())
    out: dict[str, list[torch.Tensor]] = {n: [] for n in names}
    for batch in batches:
        for i in range(len(batch["y"])):
            model.zero_grad(set_to_none=True)
            fn(model, {k: v[i : i + 1] for k, v in batch.items()}).sum().backward()
            for n in names:
                out[n].append(mods[n].weight.grad.detach().double().clone())
    model.zero_grad(set_to_none=True)
    return {n: torch.stack(g) for n, g in out.items()}


@pytest.mark.parametrize("kind", ["kfac", "ekfac"])
def test_scores_equal_dense_solves_over_autograd_gradients(kind: str) -> None:
    model = mlp()  # the last layer has a bias: it is not attributed, on either side
    data = classifier_data(112)
    train, queries = data[:6], data[6:]
    with single_thread():
        ours = kfac_influence(model, train, queries, ce_loss, kind, query_fn=class_zero)
        factors = fit_kfac(model, train, ce_loss, kind, modules=("*",))
    gi, gq = weight_grads(model, train, ce_loss), weight_grads(model, queries, class_zero)
    expected = torch.zeros(16, 96, dtype=torch.float64)
    for name, mf in factors.modules.items():
        solved = kron_solve(mf, kind, gq[name], mf.damping(kind))  # [Q, out, in]
        expected += solved.flatten(1) @ gi[name].flatten(1).T
    assert ours.shape == (16, 96) and ours.dtype == torch.float64
    torch.testing.assert_close(ours, expected, rtol=1e-4, atol=1e-4 * float(expected.abs().max()))


def test_given_factors_are_used_and_no_batches_is_one_line() -> None:
    model, data = mlp(), classifier_data(112)
    factors = fit_kfac(model, data[:6], ce_loss, "ekfac")
    fitted = kfac_influence(model, data[:6], data[6:], ce_loss, "kfac")
    given = kfac_influence(model, data[:6], data[6:], ce_loss, "kfac", factors=factors)
    torch.testing.assert_close(given, fitted, rtol=1e-5, atol=1e-7)  # the same A and G either way
    with pytest.raises(AssayError, match="no training batches"):
        kfac_influence(model, [], data[6:], ce_loss, "kfac", factors=factors)
