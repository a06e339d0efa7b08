"""Model loading: folders, fresh LoRA, saved PEFT adapters, fingerprints, offline failures."""

import os
import subprocess
import sys

import pytest
import torch

from assay.core.config import ModelConfig
from assay.core.errors import AssayError
from assay.core.precision import PrecisionPolicy
from assay.lm.hooks import get_module
from assay.lm.models import (
    architecture_of,
    load_model,
    load_tokenizer,
    model_fingerprint,
    read_architecture,
    resolve_device,
)
from tests.helpers import tiny_gpt2, tiny_llama

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


def test_adapter_folder_with_its_tokenizer_loads_the_adapter_once(tiny_model_dir, tmp_path, recwarn):
    """`assay finetune` saves the tokenizer beside the adapter; the base model still comes from
    adapter_config.json (loading the folder itself made transformers attach the adapter, then
    peft again: "multiple adapters"), and the outputs are base + one adapter's."""
    model = load_model(ModelConfig(model=str(tiny_model_dir), lora_rank=4), FP32)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.add_(0.5)
    model.save_pretrained(tmp_path / "adapter")
    load_tokenizer(ModelConfig(model=str(tiny_model_dir))).save_pretrained(tmp_path / "adapter")
    reloaded = load_model(ModelConfig(model=str(tmp_path / "adapter")), FP32)
    assert not [w for w in recwarn if "multiple adapters" in str(w.message)]
    ids = torch.arange(3, 19)[None]
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=ids).logits, model(input_ids=ids).logits)


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


def test_fingerprint_pieces_are_threaded_and_ordered(tiny_model_dir):
    """Version 3 hashes 64-byte pieces on any number of threads to the same value; a flipped bit in
    any piece, or two pieces swapped, changes it; indexes recorded with version 2 (one stream)
    are still checked with version 2."""
    from assay.lm.models import fingerprint_as, sequential_fingerprint

    model = load_model(ModelConfig(model=str(tiny_model_dir)), FP32)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = model_fingerprint(model, piece=64)
        torch.set_num_threads(2)
        assert model_fingerprint(model, piece=64) == one
    finally:
        torch.set_num_threads(threads)
    assert model_fingerprint(model, piece=128) != one  # the pieces are part of what is hashed
    assert fingerprint_as(model, 2) == sequential_fingerprint(model) != model_fingerprint(model)
    weight = model.model.layers[0].mlp.up_proj.weight  # 64 x 32 fp32 = 128 pieces of 64 bytes
    with torch.no_grad():
        flat = weight.view(-1)
        flat[:16], flat[16:32] = flat[16:32].clone(), flat[:16].clone()  # swap pieces 0 and 1
        swapped = model_fingerprint(model, piece=64)
        assert swapped != one
        flat.view(torch.int32)[-1] ^= 1  # the last piece's lowest bit
        assert model_fingerprint(model, piece=64) not in (one, swapped)


def test_tokenizer_fingerprint_follows_the_tokenizer(tiny_model_dir):
    """Remembered per tokenizer, yet never stale: per-call truncation leaves it, a new token
    changes it."""
    from assay.lm.data import tokenizer_fingerprint

    tokenizer = load_tokenizer(ModelConfig(model=str(tiny_model_dir)))
    before = tokenizer_fingerprint(tokenizer)
    assert tokenizer_fingerprint(tokenizer) == before
    tokenizer("some text", truncation=True, max_length=2)
    assert tokenizer_fingerprint(tokenizer) == before
    tokenizer.add_tokens(["<new-token>"])
    after = tokenizer_fingerprint(tokenizer)
    assert after != before
    assert tokenizer_fingerprint(load_tokenizer(ModelConfig(model=str(tiny_model_dir)))) == before


@pytest.mark.parametrize(
    "name,hint",
    [
        ("model.layers.9", "; model.layers holds model.layers.0, model.layers.1"),  # past the last layer
        ("model.layers.0.mlpx", "; model.layers.0 holds model.layers.0.self_attn, model.layers.0.mlp,"),
        ("layers.1.mlp", "; similar: model.layers.0.mlp, model.layers.1.mlp"),  # the prefix left out
    ],
)
def test_a_mistyped_module_name_says_what_exists(name, hint):
    with pytest.raises(AssayError) as err:
        get_module(tiny_llama(), name)
    assert str(err.value).startswith(f"model has no module {name!r}{hint}")


def test_a_base_model_hookpoint_resolves_under_a_peft_wrapper():
    """An SAE's hookpoint names the base model's module; a LoRA index's model is wrapped by peft."""
    from peft import LoraConfig, get_peft_model  # lazy: as in assay.lm.models

    base = tiny_llama()
    wrapped = get_peft_model(base, LoraConfig(r=2, target_modules=["q_proj"]))
    assert get_module(wrapped, "model.layers.1") is base.model.layers[1]
    assert get_module(wrapped, "base_model.model.model.layers.1") is base.model.layers[1]
    with pytest.raises(AssayError, match="no module 'model.layers.7'"):
        get_module(wrapped, "model.layers.7")


def _lora_targets(model) -> set[str]:
    return {
        n.removesuffix(".lora_A.default").rsplit(".", 1)[-1]
        for n, _ in model.named_modules()
        if n.endswith(".lora_A.default")
    }


def test_default_lora_is_every_projection_in_any_family(tmp_path):
    """Phi-3's fused qkv_proj / gate_up_proj and GPT-NeoX's names get adapters too (named Llama
    projections left Phi-3 with o_proj and down_proj alone, and GPT-NeoX with none)."""
    from transformers import AutoModelForCausalLM, GPTNeoXConfig, Phi3Config  # lazy: as in assay.lm.models

    sizes = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1}
    configs = {
        "phi3": (
            Phi3Config(**sizes, num_attention_heads=4, pad_token_id=0),
            {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"},
        ),
        "neox": (
            GPTNeoXConfig(**sizes, num_attention_heads=4),
            {"query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"},
        ),
    }
    for name, (config, expected) in configs.items():
        AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / name)
        assert (
            _lora_targets(load_model(ModelConfig(model=str(tmp_path / name), lora_rank=2), FP32)) == expected
        )


def test_default_lora_on_llama_is_the_adapter_of_its_named_projections(tiny_model_dir):
    """The default (peft's all-linear) makes, to the bit, the adapter that naming Llama's seven
    projections made, so indexes built before it still match their model."""
    names = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    torch.manual_seed(0)
    default = load_model(ModelConfig(model=str(tiny_model_dir), lora_rank=2), FP32)
    torch.manual_seed(0)
    named = load_model(ModelConfig(model=str(tiny_model_dir), lora_rank=2, lora_modules=names), FP32)
    assert _lora_targets(default) == set(names)
    assert model_fingerprint(default) == model_fingerprint(named)


def test_fingerprint_leaves_out_what_a_trainer_rewrites_in_the_config(tiny_model_dir):
    """use_cache and the special token ids (a Trainer sets them while it trains) do not change
    version 4; version 3, what older indexes recorded, still reads them; any weight still does."""
    from assay.lm.models import fingerprint_as

    model = load_model(ModelConfig(model=str(tiny_model_dir)), FP32)
    v4, v3 = model_fingerprint(model), fingerprint_as(model, 3)
    model.config.use_cache, model.config.pad_token_id = not model.config.use_cache, 7
    assert model_fingerprint(model) == v4 and fingerprint_as(model, 3) != v3
    with torch.no_grad():
        model.model.norm.weight[0] += 1
    assert model_fingerprint(model) != v4


def test_architecture_is_read_from_the_config_alone_and_matches_the_loaded_model(tiny_model_dir, tmp_path):
    loaded = architecture_of(load_model(ModelConfig(model=str(tiny_model_dir)), FP32).config)
    assert read_architecture(ModelConfig(model=str(tiny_model_dir))) == loaded
    assert loaded["model_type"] == "llama" and loaded["num_hidden_layers"] == 2 and "n_embd" not in loaded
    adapter = tmp_path / "adapter"
    load_model(ModelConfig(model=str(tiny_model_dir), lora_rank=2), FP32).save_pretrained(adapter)
    assert read_architecture(ModelConfig(model=str(adapter))) == loaded  # an adapter's base
    gpt2 = architecture_of(tiny_gpt2().config)
    assert gpt2["model_type"] == "gpt2" and {"n_embd", "n_layer", "n_head", "vocab_size"} <= set(gpt2)
    assert read_architecture(ModelConfig(model=str(tmp_path / "nothing"))) is None
