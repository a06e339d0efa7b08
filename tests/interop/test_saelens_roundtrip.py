"""Interop with the real SAELens (run in .venv-peers: `make test-interop`), plus W&B offline."""

from __future__ import annotations

import os

import pytest
import torch

from assay.sae.config import SaeArchConfig
from assay.sae.model import SparseAutoencoder
from assay.sae.saelens_format import load_sae, save_sae

sae_lens = pytest.importorskip("sae_lens")


def _sae(arch: str, d_out: int | None = None) -> SparseAutoencoder:
    torch.manual_seed(0)
    sae = SparseAutoencoder(16, 96, SaeArchConfig(architecture=arch, k=6), d_out=d_out)
    with torch.no_grad():
        sae.b_dec.normal_(0, 0.3)
        sae.b_enc.normal_(0, 0.1)
        sae.W_enc.mul_(10)
        sae.threshold_buf.fill_(0.2)
    sae.act_scale.fill_(1.9)  # folded into the weights at save
    return sae


@pytest.mark.parametrize("arch", ["relu", "topk", "batchtopk", "jumprelu", "matryoshka"])
def test_saelens_loads_our_folder_and_computes_the_same_function(arch: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    ours = _sae(arch)
    save_sae(tmp_path, ours, {"model_name": "m", "hook_name": "model.layers.2", "context_size": 32})
    theirs = sae_lens.SAE.load_from_disk(str(tmp_path))
    x = torch.randn(40, 16) * 3
    with torch.no_grad():
        torch.testing.assert_close(theirs.encode(x), ours.encode(x * ours.act_scale), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(theirs(x), ours.reconstruct(x), rtol=1e-5, atol=1e-5)
    assert theirs.cfg.metadata.hook_name == "model.layers.2"


@pytest.mark.parametrize(
    ("arch", "saved_as"),
    [
        ("relu", "transcoder"),
        ("batchtopk", "jumprelu_transcoder"),
        ("jumprelu", "jumprelu_transcoder"),
        ("matryoshka", "jumprelu_transcoder"),
    ],
)
def test_saelens_loads_our_transcoder_and_predicts_the_same_output(
    arch: str, saved_as: str, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    ours = _sae(arch, d_out=11)
    ours.target_scale.fill_(0.6)  # the target's own normalisation, folded into W_dec and b_dec
    meta = {
        "model_name": "m",
        "hook_name": "model.layers.2.post_attention_layernorm",
        "hook_name_out": "model.layers.2.mlp",
        "context_size": 32,
    }
    save_sae(tmp_path, ours, meta)
    theirs = sae_lens.SAE.load_from_disk(str(tmp_path))
    assert (
        type(theirs).__name__
        == {"transcoder": "Transcoder", "jumprelu_transcoder": "JumpReLUTranscoder"}[saved_as]
    )
    assert theirs.cfg.d_out == 11
    x = torch.randn(40, 16) * 3
    with torch.no_grad():
        torch.testing.assert_close(theirs.encode(x), ours.encode(x * ours.act_scale), rtol=1e-5, atol=1e-5)
        # outputs ~1/0.6 larger than the SAE's, computed in another order (folded vs scaled)
        torch.testing.assert_close(theirs(x), ours.reconstruct(x), rtol=1e-4, atol=1e-4)
    assert theirs.cfg.metadata.hook_name_out == "model.layers.2.mlp"


@pytest.mark.parametrize("saved_as", ["transcoder", "jumprelu_transcoder"])
def test_we_load_a_transcoder_saved_by_saelens(saved_as: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    sae_cls, cfg_cls = {
        "transcoder": (sae_lens.Transcoder, sae_lens.TranscoderConfig),
        "jumprelu_transcoder": (sae_lens.JumpReLUTranscoder, sae_lens.JumpReLUTranscoderConfig),
    }[saved_as]
    theirs = sae_cls(cfg_cls(d_in=16, d_sae=64, d_out=9, apply_b_dec_to_input=False))
    with torch.no_grad():
        for p in theirs.parameters():
            p.normal_(0, 0.2)
    theirs.save_model(tmp_path)
    ours, _ = load_sae(tmp_path)
    assert ours.transcoder and ours.d_out == 9
    x = torch.randn(30, 16)
    with torch.no_grad():
        torch.testing.assert_close(ours.reconstruct(x), theirs(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("sparse", [True, False])
def test_matryoshka_training_loss_equals_saelens_on_the_same_weights(sparse: bool) -> None:
    """Ours: (outer + inner squared errors) / batch variance; SAELens: the same errors, summed
    unnormalised. With the same weights and BatchTopK selection they differ by that factor."""
    from sae_lens import MatryoshkaBatchTopKTrainingSAE, MatryoshkaBatchTopKTrainingSAEConfig
    from sae_lens.saes.sae import TrainStepInput

    ours = _sae("matryoshka")
    ours.arch.matryoshka_widths, ours.arch.aux_coefficient, ours.arch.sparse_kernels = [12, 40], 0.0, sparse
    cfg = MatryoshkaBatchTopKTrainingSAEConfig(d_in=16, d_sae=96, k=6, matryoshka_widths=[12, 40, 96])
    theirs = MatryoshkaBatchTopKTrainingSAE(cfg)
    with torch.no_grad():
        for name in ("W_enc", "b_enc", "W_dec", "b_dec"):
            getattr(theirs, name).copy_(getattr(ours, name))
    x = torch.randn(50, 16) * 2
    step = TrainStepInput(
        sae_in=x, coefficients={}, dead_neuron_mask=None, n_training_steps=0, is_logging_step=False
    )
    their_loss = float(theirs.training_forward_pass(step).loss.detach())
    our_loss = float(ours.train_forward(x, None, 0.0).loss.detach())
    total_var = float((x - x.mean(0)).pow(2).sum(-1).mean())
    assert our_loss * total_var == pytest.approx(their_loss, rel=1e-5)


@pytest.mark.parametrize("arch", ["standard", "topk", "jumprelu"])
def test_we_load_a_folder_saved_by_saelens(arch: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    classes = {
        "standard": (sae_lens.StandardSAE, sae_lens.StandardSAEConfig, {}),
        "topk": (sae_lens.TopKSAE, sae_lens.TopKSAEConfig, {"k": 5}),
        "jumprelu": (sae_lens.JumpReLUSAE, sae_lens.JumpReLUSAEConfig, {}),
    }
    sae_cls, cfg_cls, extra = classes[arch]
    cfg = cfg_cls(d_in=16, d_sae=64, **extra)
    cfg.metadata.hook_name = "model.layers.1"
    theirs = sae_cls(cfg)
    with torch.no_grad():
        for p in theirs.parameters():
            p.normal_(0, 0.2)
        if arch == "jumprelu":
            theirs.threshold.uniform_(0.0, 0.3)
    theirs.save_model(tmp_path)
    ours, meta = load_sae(tmp_path)
    x = torch.randn(30, 16)
    with torch.no_grad():
        torch.testing.assert_close(ours.reconstruct(x), theirs(x), rtol=1e-5, atol=1e-5)
    assert meta["hook_name"] == "model.layers.1"


def test_wandb_offline_logging(tiny_model_dir, tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    pytest.importorskip("wandb")
    from assay.core.config import DataConfig, ModelConfig, RuntimeConfig
    from assay.sae.config import SaeTrainConfig
    from assay.sae.train import train_sae
    from tests.helpers import SAMPLE_TEXTS

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    from datasets import Dataset, DatasetDict

    rows = [{"text": t * 3} for t in SAMPLE_TEXTS * 20]
    data = tmp_path / "d"  # a saved dataset with a held-out split for the splice metrics
    DatasetDict({"train": Dataset.from_list(rows), "eval": Dataset.from_list(rows[:12])}).save_to_disk(
        str(data)
    )
    cfg = SaeTrainConfig(
        out=str(tmp_path / "run"),
        model=ModelConfig(model=str(tiny_model_dir)),
        data=DataConfig(str(data)),
        runtime=RuntimeConfig(precision="bf16"),
        sae=SaeArchConfig(d_sae=64, k=4),
        hookpoint="model.layers.0",
        training_tokens=1024,
        batch_tokens=256,
        context_length=16,
        metrics_every=1,
        eval_contexts=4,
        wandb=True,
    )
    summary = train_sae(cfg)
    assert summary["precision"] == "bf16"
    runs = list((tmp_path / "run" / "wandb").glob("offline-run-*"))
    assert runs and any(f.suffix == ".wandb" for f in runs[0].iterdir())
    assert os.path.getsize(tmp_path / "run" / "metrics.jsonl") > 0


def test_we_load_a_topk_sae_that_rescales_by_decoder_norm(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """SAELens's TopK default trains with rescale_acts_by_decoder_norm; rows of any norm."""
    cfg = sae_lens.TopKSAEConfig(d_in=16, d_sae=64, k=5, rescale_acts_by_decoder_norm=True)
    theirs = sae_lens.TopKSAE(cfg)
    with torch.no_grad():
        for p in theirs.parameters():
            p.normal_(0, 0.2)
        theirs.W_dec.mul_(torch.rand(64, 1) * 3 + 0.2)  # rows far from unit norm
    theirs.save_model(tmp_path)
    ours, _ = load_sae(tmp_path)
    x = torch.randn(30, 16)
    with torch.no_grad():
        torch.testing.assert_close(ours.reconstruct(x), theirs(x), rtol=1e-4, atol=1e-5)
