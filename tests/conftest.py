"""Shared fixtures: tiny random models and tokenizers built in code (no downloads)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

SAMPLE_TEXTS = [
    "X:1\nT:The Kesh\nM:6/8\nK:G\nGAG GAB|ABA ABd|edd gdd|edB dBA|",
    "To be, or not to be, that is the question.",
    "Whether 'tis nobler in the mind to suffer the slings and arrows of outrageous fortune.",
    "X:2\nT:Drowsy Maggie\nM:4/4\nK:Edor\nE2BE dEBE|E2BE AFDF|",
    "Now is the winter of our discontent made glorious summer by this sun of York.",
    "All the world's a stage, and all the men and women merely players.",
]


def write_word_texts(path: Path, count: int, max_words: int) -> Path:
    """`count` random texts of 3..max_words-1 words as jsonl (seeded): varied lengths in one file."""
    rng = np.random.default_rng(0)
    words = "the king queen folk tune jig reel air of to and a in my love".split()
    with open(path, "w") as f:
        for _ in range(count):
            f.write(json.dumps({"text": " ".join(rng.choice(words, rng.integers(3, max_words)))}) + "\n")
    return path


def make_tokenizer(vocab_size: int = 300):
    """A byte-level BPE tokenizer trained in a second on SAMPLE_TEXTS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(SAMPLE_TEXTS * 4, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")


def make_llama(vocab_size: int, seed: int = 0):
    """A 2-layer random Llama small enough for exact gradient checks."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    return LlamaForCausalLM(cfg)


@pytest.fixture(scope="session")
def tiny_tokenizer():
    return make_tokenizer()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tiny_tokenizer) -> Path:
    """A saved tiny Llama + tokenizer folder, loadable with `--model DIR`."""
    folder = tmp_path_factory.mktemp("tiny-llama")
    make_llama(len(tiny_tokenizer)).save_pretrained(folder)
    tiny_tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture
def texts_jsonl(tmp_path) -> Path:
    """A small jsonl dataset with text, prompt/completion and group columns."""
    path = tmp_path / "data.jsonl"
    with open(path, "w") as f:
        for i, text in enumerate(SAMPLE_TEXTS):
            row = {"text": text, "prompt": text[:10], "completion": text[10:], "group": f"g{i % 2}"}
            f.write(json.dumps(row) + "\n")
    return path
