"""AuxK's revival of dead latents: the straight-through gradient of its picked entries."""

from __future__ import annotations

import pytest
import torch

from assay.sae.kernels import SparseEncode
from tests.helpers import make_sae


@pytest.mark.parametrize("arch", ["topk", "batchtopk", "matryoshka"])
def test_auxk_revives_a_latent_whose_pre_activations_are_all_negative(arch: str) -> None:
    """Behind the ReLU, a dead latent with every pre-activation < 0 gets no gradient from AuxK
    and can never fire again; straight through, its encoder gets the gradient the AuxK loss
    has for its (zero) value, and its decoder row none, while the losses are unchanged. The
    sparse kernels and the dense path agree either way."""
    x = torch.randn(48, 16, generator=torch.Generator().manual_seed(0))
    dead = torch.zeros(128, dtype=torch.bool)
    dead[:8] = True
    runs = {}
    for straight in (True, False):
        for sparse in (True, False):
            sae = make_sae(arch, sparse_kernels=sparse, aux_k=4, aux_straight_through=straight)
            with torch.no_grad():
                sae.b_enc[:8] = -1e3  # every pre-activation of the dead latents far below 0
            out = sae.train_forward(x, dead, 0.0)
            out.loss.backward()
            runs[straight, sparse] = (float(out.loss.detach()), float(out.aux.detach()), sae)
    for straight in (True, False):
        (*losses, a), (*dense_losses, b) = runs[straight, True], runs[straight, False]
        assert losses == pytest.approx(dense_losses, rel=1e-5)
        for (name, p), q in zip(a.named_parameters(), b.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)
    (loss_st, aux_st, st), (loss_gated, aux_gated, gated) = runs[True, True], runs[False, True]
    assert (loss_st, aux_st) == (loss_gated, aux_gated) and aux_st > 0  # the forward is unchanged
    assert torch.all(gated.b_enc.grad[:8] == 0) and torch.all(gated.W_enc.grad[:, :8] == 0)
    assert torch.all(st.W_enc.grad[:, :8].abs().sum(0) > 0)
    assert torch.all(st.W_dec.grad[:8] == 0)  # a value of 0 moves no decoder row
    picked = st.pre_acts(x).detach()[:, :8].topk(4, dim=-1).indices  # the AuxK entries, per token
    chosen = torch.zeros(8, dtype=torch.bool).index_fill_(0, picked.reshape(-1), True)
    assert torch.equal(st.b_enc.grad[:8] != 0, chosen)


def test_sparse_encode_passes_revival_entries_straight_through() -> None:
    """SparseEncode's sparse backward against a dense reference: entries before n_gated take the
    ReLU's gradient (pre > 0), the rest the identity's."""
    torch.manual_seed(0)
    x, b_in = torch.randn(10, 6), torch.randn(6, requires_grad=True)
    W_enc, b_enc = torch.randn(6, 12, requires_grad=True), torch.randn(12, requires_grad=True)
    rows = torch.arange(10).repeat_interleave(3)
    cols = torch.randint(0, 12, (30,))
    vals, *_ = SparseEncode.apply(x, b_in, W_enc, b_enc, lambda pre: (rows, cols, 18))
    g = torch.randn(30)
    (vals * g).sum().backward()
    pre = ((x - b_in) @ W_enc + b_enc).detach()[rows, cols]
    assert torch.equal(vals.detach(), pre.clamp_min(0))
    passed = g * torch.cat([(pre[:18] > 0).float(), torch.ones(12)])
    dense = torch.zeros(10, 12).index_put_((rows, cols), passed, accumulate=True)  # dL/dpre
    torch.testing.assert_close(b_enc.grad, dense.sum(0))
    torch.testing.assert_close(W_enc.grad, (x - b_in).detach().T @ dense)
    torch.testing.assert_close(b_in.grad, -(W_enc.detach() @ dense.sum(0)))
