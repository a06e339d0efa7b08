"""Model loading: folders, fresh LoRA, saved PEFT adapters, fingerprints, offline failures."""

import os
import subprocess
import sys

import pytest
import torch

from assay.core.config import ModelConfig
from assay.core.errors import AssayError
from assay.core.precision import PrecisionPolicy
from assay.lm.models import load_model, load_tokenizer, model_fingerprint, resolve_device

FP32 = PrecisionPolicy.resolve("fp32", "cpu")


def test_plain_model_loads_in_the_policy_dtype(tiny_model_dir):
    model = load_model(ModelConfig(model=str(tiny_model_dir)), FP32)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    pure = load_model(ModelConfig(model=str(tiny_model_dir)), PrecisionPolicy.resolve("bf16-pure", "cpu"))
    assert all(p.dtype == torch.bfloat16 for p in pure.parameters())
    assert not model.training


def test_fresh_lora_trains_only_adapter_weights(tiny_model_dir, tmp_path):
    cfg = ModelConfig(model=str(tiny_model_dir), lora_rank=4)
    model = load_model(cfg, FP32)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    # a saved adapter folder loads back with the same weights and the same trainable set
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.add_(0.5)
    model.save_pretrained(tmp_path / "adapter")
    reloaded = load_model(ModelConfig(model=str(tmp_path / "adapter")), FP32)
    assert model_fingerprint(reloaded) == model_fingerprint(model)
    assert load_tokenizer(ModelConfig(model=str(tmp_path / "adapter"))).pad_token_id is not None


def test_fingerprint_changes_with_the_weights(tiny_model_dir):
    a = load_model(ModelConfig(model=str(tiny_model_dir)), FP32)
    b = load_model(ModelConfig(model=str(tiny_model_dir)), FP32)
    assert model_fingerprint(a) == model_fingerprint(b)
    with torch.no_grad():
        next(b.parameters()).add_(1e-3)
    assert model_fingerprint(a) != model_fingerprint(b)


def test_bad_lora_target_and_missing_cuda(tiny_model_dir):
    with pytest.raises(AssayError, match="LoRA"):
        load_model(ModelConfig(model=str(tiny_model_dir), lora_rank=2, lora_modules=("nope",)), FP32)
    if not torch.cuda.is_available():
        with pytest.raises(AssayError, match="CUDA is not available"):
            resolve_device("cuda:1")


def test_offline_failure_to_prepare_bundled_data_is_one_line(tmp_path, tiny_model_dir):
    env = {**os.environ, "ASSAY_CACHE": str(tmp_path), "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(tmp_path)}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "assay",
            "eval",
            str(tmp_path / "o"),
            "--dataset",
            "shakespeare",
            "--model",
            str(tiny_model_dir),
        ],
        capture_output=True,
        text=True,
        env=env,
    )
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert "shakespeare" in proc.stderr.strip().splitlines()[-1]
