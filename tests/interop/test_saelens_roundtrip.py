"""Interop with the real SAELens (run in .venv-peers: `make test-interop`), plus W&B offline."""

from __future__ import annotations

import json
import os

import pytest
import torch

from assay.sae.config import SaeArchConfig
from assay.sae.model import SparseAutoencoder
from assay.sae.saelens_format import load_sae, save_sae

sae_lens = pytest.importorskip("sae_lens")


def _sae(arch: str) -> SparseAutoencoder:
    torch.manual_seed(0)
    sae = SparseAutoencoder(16, 96, SaeArchConfig(architecture=arch, k=6))  # type: ignore[arg-type]
    with torch.no_grad():
        sae.b_dec.normal_(0, 0.3)
        sae.b_enc.normal_(0, 0.1)
        sae.W_enc.mul_(10)
        sae.threshold_buf.fill_(0.2)
    sae.act_scale.fill_(1.9)  # folded into the weights at save
    return sae


@pytest.mark.parametrize("arch", ["relu", "topk", "batchtopk", "jumprelu"])
def test_saelens_loads_our_folder_and_computes_the_same_function(arch: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    ours = _sae(arch)
    save_sae(tmp_path, ours, {"model_name": "m", "hook_name": "model.layers.2", "context_size": 32})
    theirs = sae_lens.SAE.load_from_disk(str(tmp_path))
    x = torch.randn(40, 16) * 3
    with torch.no_grad():
        torch.testing.assert_close(theirs.encode(x), ours.encode(x * ours.act_scale), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(theirs(x), ours.reconstruct(x), rtol=1e-5, atol=1e-5)
    assert theirs.cfg.metadata.hook_name == "model.layers.2"


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
    from tests.conftest import SAMPLE_TEXTS

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"text": t * 3}) + "\n" for t in SAMPLE_TEXTS * 20))
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
