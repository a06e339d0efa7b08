"""Shared fixtures: tiny random models and tokenizers built in code (no downloads)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import SAMPLE_TEXTS, make_tokenizer, tiny_llama


@pytest.fixture(scope="session")
def tiny_tokenizer():
    return make_tokenizer()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tiny_tokenizer) -> Path:
    """A saved tiny Llama + tokenizer folder, loadable with `--model DIR`."""
    folder = tmp_path_factory.mktemp("tiny-llama")
    tiny_llama(vocab_size=len(tiny_tokenizer)).save_pretrained(folder)
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
