"""The committed assay-tiny checkpoint loads offline and is a real language model.

"Real" here means: on held-out Shakespeare it predicts far better than the unigram
baseline recorded at pretraining time (see docs/assay-tiny.md).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from assay.core.paths import assets_dir, cache_dir
from assay.lm import corpora

FOLDER = assets_dir() / "assay-tiny"


@pytest.fixture(scope="module")
def summary() -> dict:
    return json.loads((FOLDER / "pretrain_summary.json").read_text(encoding="utf-8"))


def test_folder_has_the_expected_files() -> None:
    for name in (
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "training_curve.json",
        "pretrain_summary.json",
    ):
        assert (FOLDER / name).is_file(), name
    assert (FOLDER / "model.safetensors").stat().st_size < 20 * 2**20


def test_tokenizer_loads_with_eos_pad_and_bos() -> None:
    tok = AutoTokenizer.from_pretrained(FOLDER)
    assert tok.eos_token == "<|endoftext|>" and tok.pad_token == "<|pad|>"
    assert tok.pad_token_id != tok.eos_token_id
    ids = tok("To be, or not to be")["input_ids"]
    assert ids[0] == tok.bos_token_id == tok.eos_token_id  # every text starts like a document
    assert tok.decode(ids, skip_special_tokens=True) == "To be, or not to be"


def test_summary_meets_the_pretraining_requirement(summary: dict) -> None:
    assert summary["unigram_entropy_nats_per_token"] - summary["val_loss_nats_per_token"] >= 1.5
    assert summary["abc_eval_loss_nats_per_token"] > summary["val_loss_nats_per_token"]


def test_model_beats_unigram_on_held_out_shakespeare(summary: dict) -> None:
    tok = AutoTokenizer.from_pretrained(FOLDER)
    model = AutoModelForCausalLM.from_pretrained(FOLDER, dtype=torch.float32).eval()
    assert model.config.model_type == "llama"
    assert sum(p.numel() for p in model.parameters()) == summary["params"]
    folder = corpora.prepare("shakespeare", cache_dir())
    with open(Path(folder) / "eval.jsonl", encoding="utf-8") as f:
        texts = [json.loads(next(f))["text"] for _ in range(8)]
    batch = tok(texts, truncation=True, max_length=128, padding=True, return_tensors="pt")
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    with torch.no_grad():
        loss = model(**batch, labels=labels).loss.item()
    assert loss < summary["unigram_entropy_nats_per_token"] - 1.0
