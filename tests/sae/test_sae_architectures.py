"""The SAE architecture registry, Matryoshka BatchTopK and transcoders, checked against
explicit dense computations written out here."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from assay.core.errors import AssayError
from assay.sae.architectures import REGISTRY, names, register
from assay.sae.architectures.matryoshka import level_widths
from assay.sae.architectures.relu import ReLU
from assay.sae.config import ARCHITECTURES, SaeArchConfig
from assay.sae.model import SparseAutoencoder
from assay.sae.saelens_format import load_sae, save_sae
from assay.training.schedule import warmup_stable_decay


def _sae(
    arch: str, d_in: int = 12, d_sae: int = 64, k: int = 3, d_out: int | None = None, **kw
) -> SparseAutoencoder:
    torch.manual_seed(0)
    sae = SparseAutoencoder(d_in, d_sae, SaeArchConfig(architecture=arch, k=k, **kw), d_out=d_out)
    with torch.no_grad():  # non-trivial biases so every term is exercised
        sae.b_dec.normal_(0, 0.3)
        sae.b_enc.normal_(0, 0.1)
        sae.W_enc.mul_(5)
    return sae


def _batch_topk_mask(pre: Tensor, k: int) -> Tensor:
    """[N, d_sae] bool: the k*N largest positive entries over the batch (written independently)."""
    flat = F.relu(pre).flatten()
    keep = torch.zeros_like(flat, dtype=torch.bool)
    order = torch.argsort(flat, descending=True)[: k * pre.shape[0]]
    keep[order] = True
    return (keep & (flat > 0)).reshape(pre.shape)


def test_every_registered_architecture_is_a_choice_and_the_registry_accepts_a_new_file() -> None:
    assert set(ARCHITECTURES) == set(REGISTRY) >= {"relu", "topk", "batchtopk", "jumprelu", "matryoshka"}
    with pytest.raises(AssayError, match="--architecture must be one of"):
        SaeArchConfig(architecture="nope")

    @register
    class Doubled(ReLU):  # what a new file would hold: a rule, and what it is saved as
        name = "doubled_relu"

        def encode(self, sae: SparseAutoencoder, pre: Tensor) -> Tensor:
            return 2 * F.relu(pre)

    try:
        assert "doubled_relu" in names()
        sae = _sae("doubled_relu")
        x = torch.randn(5, 12)
        torch.testing.assert_close(sae.encode(x), 2 * F.relu((x - sae.b_dec) @ sae.W_enc + sae.b_enc))
    finally:
        del REGISTRY["doubled_relu"]


def test_matryoshka_level_widths() -> None:
    assert level_widths(None, 64) == [4, 8, 16, 32, 64]
    assert level_widths([8, 32], 64) == [8, 32, 64]  # d_sae added as the last level
    assert level_widths([8, 64], 64) == [8, 64]
    with pytest.raises(AssayError, match="increasing"):
        SaeArchConfig(architecture="matryoshka", matryoshka_widths=[16, 8])


@pytest.mark.parametrize("sparse", [True, False])
def test_matryoshka_loss_is_the_sum_of_nested_prefix_errors_and_its_gradients_match(sparse: bool) -> None:
    widths = [8, 24, 64]
    sae = _sae("matryoshka", k=4, matryoshka_widths=widths[:2], sparse_kernels=sparse, aux_coefficient=0.0)
    x = torch.randn(40, 12) * 2 + 0.5
    out = sae.train_forward(x, None, 0.0)
    out.loss.backward()
    got = {n: p.grad.clone() for n, p in sae.named_parameters()}
    # reference: dense autograd over the explicit definition
    ref = _sae("matryoshka", k=4, matryoshka_widths=widths[:2], aux_coefficient=0.0)
    pre = (x - ref.b_dec) @ ref.W_enc + ref.b_enc
    z = F.relu(pre) * _batch_topk_mask(pre.detach(), 4)
    errors = [(z[:, :w] @ ref.W_dec[:w] + ref.b_dec - x).pow(2).sum(-1).mean() for w in widths]
    total_var = (x - x.mean(0)).pow(2).sum(-1).mean()
    loss = sum(errors) / total_var
    loss.backward()
    assert float(out.loss.detach()) == pytest.approx(float(loss.detach()), rel=1e-5)
    assert float(out.mse.detach()) == pytest.approx(float(errors[-1].detach()), rel=1e-5)  # the full SAE
    assert len({round(float(e.detach()), 3) for e in errors}) == 3  # each level reconstructs differently
    for name, p in ref.named_parameters():
        torch.testing.assert_close(got[name], p.grad, rtol=1e-4, atol=1e-6)


def test_matryoshka_encodes_and_saves_as_a_jumprelu_with_its_threshold(tmp_path) -> None:  # type: ignore[no-untyped-def]
    sae = _sae("matryoshka", k=4)
    sae.threshold_buf.fill_(0.4)
    save_sae(tmp_path, sae, {"hook_name": "h"})
    cfg = json.loads((tmp_path / "cfg.json").read_text())
    assert cfg["architecture"] == "jumprelu" and cfg["metadata"]["assay_architecture"] == "matryoshka"
    loaded, _ = load_sae(tmp_path)
    x = torch.randn(9, 12)
    pre = (x - sae.b_dec) @ sae.W_enc + sae.b_enc
    torch.testing.assert_close(loaded.encode(x), F.relu(pre) * (pre > 0.4), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("arch", ["topk", "batchtopk", "matryoshka", "relu", "jumprelu"])
def test_transcoder_encodes_its_input_and_predicts_the_target(arch: str) -> None:
    sae = _sae(arch, d_in=12, d_out=7, k=4)
    assert sae.W_dec.shape == (64, 7) and sae.b_dec.shape == (7,) and sae.input_bias() is None
    x, y = torch.randn(30, 12), torch.randn(30, 7)
    out = sae.train_forward(x, None, 0.0, target=y)
    pre = x @ sae.W_enc + sae.b_enc  # no b_dec subtracted: it lives in the output space
    z = sae.encode(x)
    if arch == "topk":
        torch.testing.assert_close(z, F.relu(pre) * (pre >= pre.topk(4, -1).values[:, -1:]))
    if arch in ("topk", "batchtopk"):  # the training forward's reconstruction, from its own selection
        mask = _batch_topk_mask(pre.detach(), 4) if arch == "batchtopk" else z > 0
        y_hat = (F.relu(pre) * mask) @ sae.W_dec + sae.b_dec
        torch.testing.assert_close(out.x_hat, y_hat.detach(), rtol=1e-5, atol=1e-5)
        assert float(out.mse.detach()) == pytest.approx(
            float((y_hat - y).pow(2).sum(-1).mean().detach()), rel=1e-5
        )


@pytest.mark.parametrize("arch", ["topk", "batchtopk"])
def test_transcoder_sparse_kernels_match_dense_autograd(arch: str) -> None:
    x, y = torch.randn(32, 12), torch.randn(32, 7)
    dead = torch.zeros(64, dtype=torch.bool)
    dead[::4] = True
    grads = []
    for sparse in (True, False):
        sae = _sae(arch, d_out=7, k=4, sparse_kernels=sparse, aux_k=5)
        sae.train_forward(x, dead, 0.0, target=y).loss.backward()
        grads.append({n: p.grad.clone() for n, p in sae.named_parameters()})
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize(("arch", "saved"), [("relu", "transcoder"), ("batchtopk", "jumprelu_transcoder")])
def test_transcoder_round_trip_with_folded_scales(arch: str, saved: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    sae = _sae(arch, d_out=7, k=4)
    sae.act_scale.fill_(2.5)
    sae.target_scale.fill_(0.3)
    sae.threshold_buf.fill_(0.2)
    x_raw = torch.randn(11, 12) * 4
    # explicit: normalise the input, encode, decode, undo the target's scale
    expected = sae.decode(sae.encode(x_raw * 2.5)) / 0.3
    torch.testing.assert_close(sae.reconstruct(x_raw), expected.detach())
    save_sae(tmp_path, sae, {"hook_name": "a", "hook_name_out": "b"})
    cfg = json.loads((tmp_path / "cfg.json").read_text())
    assert (cfg["architecture"], cfg["d_out"], cfg["apply_b_dec_to_input"]) == (saved, 7, False)
    loaded, meta = load_sae(tmp_path)
    assert loaded.transcoder and meta["hook_name_out"] == "b"
    torch.testing.assert_close(loaded.reconstruct(x_raw), expected.detach(), rtol=1e-5, atol=1e-5)


def test_topk_transcoder_is_refused_at_save(tmp_path) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(AssayError, match="no topk transcoder"):
        save_sae(tmp_path, _sae("topk", d_out=7), {})


def test_warmup_stable_decay_schedule() -> None:
    got = [warmup_stable_decay(s, 10, 4, 0.3) for s in range(10)]
    assert got == pytest.approx([0.25, 0.5, 0.75, 1, 1, 1, 1, 1, 2 / 3, 1 / 3])
    assert [warmup_stable_decay(s, 5, 0, 0.0) for s in range(5)] == [1.0] * 5


def test_auxk_window_default_is_short_only_for_topk_kinds_with_signum_and_large_batches() -> None:
    from assay.sae.config import SaeTrainConfig

    def window(arch: str, **kw) -> int:  # type: ignore[no-untyped-def]
        return SaeTrainConfig(out="o", sae=SaeArchConfig(architecture=arch), **kw).aux_window

    assert window("topk") == 16_384  # signum (auto) with 4,096-token batches
    assert window("topk", optimizer="adam") == 1_000_000  # the dead-latent window
    assert window("topk", batch_tokens=1024) == 1_000_000
    assert window("batchtopk") == window("matryoshka") == 16_384
    assert window("batchtopk", optimizer="adam") == window("relu") == window("jumprelu") == 1_000_000
    assert window("topk", dead_window_tokens=8192) == 8192  # never longer than the dead window
    assert window("batchtopk", aux_window_tokens=4096) == 4096  # asked for
