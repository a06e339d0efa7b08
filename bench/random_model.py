"""A randomly initialised Llama (or Mixtral) saved as a Hugging Face folder, with assay-tiny's tokenizer (ABC
tunes; 4,096 tokens), for speed measurements where the weights do not matter.

    .venv/bin/python bench/random_model.py tiny-2m /tmp/tiny-2m
    python3 bench/random_model.py smollm2-135m /tmp/smol --device cuda     # on the GPU machine

Shapes (`SHAPES`): tiny-2m is a 2.1M-parameter Llama of the class issue #23 measured (hidden 128,
2,048 positions, so bergson accepts 2,048-token batches, which assay-tiny's 512 positions refuse);
smollm2-135m is SmolLM2-135M's shape (vocabulary 49,152); llama-1b is Llama-3.2-1B's shape with a
32,000-token vocabulary; moe-8x is a Mixtral of tiny-2m's width with 8 experts per layer, 2 per
token. Token ids of the tokenizer all lie below every vocabulary here.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch

SHAPES: dict[str, dict] = {
    "tiny-2m": dict(
        hidden_size=128,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=2,
        vocab_size=4096,
        tie_word_embeddings=False,
    ),
    "smollm2-135m": dict(
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        vocab_size=49152,
        tie_word_embeddings=True,
    ),
    "moe-8x": dict(  # a Mixtral: 8 experts per layer, 2 per token (the MoE layout of assay.lm.moe)
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=2,
        vocab_size=4096,
        tie_word_embeddings=False,
        num_local_experts=8,
        num_experts_per_tok=2,
    ),
    "llama-1b": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=32000,
        tie_word_embeddings=True,
    ),
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def make(shape: str, out: Path, device: str = "cpu", seed: int = 0) -> Path:
    """Write the random model `shape` (bf16 weights on disk: half the bytes; assay loads them in
    the precision it runs) and the tokenizer into `out`; returns `out`."""
    from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

    moe = "num_local_experts" in SHAPES[shape]
    config_cls, model_cls = (MixtralConfig, MixtralForCausalLM) if moe else (LlamaConfig, LlamaForCausalLM)
    tiny = Path(__file__).resolve().parent.parent / "assay" / "assets" / "assay-tiny"
    cfg = config_cls(
        **SHAPES[shape],
        max_position_embeddings=2048,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=1,
        rms_norm_eps=1e-6,
    )
    torch.manual_seed(seed)
    with torch.device(device):  # initialised where it is fast (a 1B model on the GPU)
        model = model_cls(cfg)
    model.to(torch.bfloat16).save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (tiny / name).exists():
            shutil.copy(tiny / name, out / name)
    # the tokenizer's own limit would cap bergson's token batches at assay-tiny's 512 positions
    config_path = out / "tokenizer_config.json"
    tok_cfg = json.loads(config_path.read_text())
    tok_cfg["model_max_length"] = cfg.max_position_embeddings
    config_path.write_text(json.dumps(tok_cfg, indent=2) + "\n")
    return out


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("shape", choices=list(SHAPES))
    ap.add_argument("out", type=Path)
    ap.add_argument("--device", default="cpu")
    return ap


def main() -> None:
    args = parser().parse_args()
    make(args.shape, args.out, args.device)
    from safetensors.torch import load_file

    n = sum(v.numel() for v in load_file(args.out / "model.safetensors").values())
    print(f"{args.shape}: {n / 1e6:.1f}M parameters in {args.out}")


if __name__ == "__main__":
    main()
