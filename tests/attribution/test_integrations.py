"""Gradients collected inside a real (tiny) Hugging Face Trainer run and a plain loop: the rows of a
step equal what `assay build` computes for that step's weights and examples, with the optimizer
state the Trainer saved in its checkpoint as the normalizer."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import assay
from assay.attribution.index import NORMALIZER_FILE, load_safetensors
from assay.cli import main
from assay.core.errors import AssayError
from assay.integrations import GradientCallback, LiveConfig, record_gradients
from tests.helpers import make_tokenizer, ok, tiny_llama, torchrun

WORDS = "the king queen folk tune jig reel air of to and a in my love".split()
FLAGS = ["--precision", "fp32", "--projection_dim", "4", "--token_batch_size", "64"]


def _texts(count: int = 24) -> list[str]:
    rng = np.random.default_rng(0)
    return [" ".join(rng.choice(WORDS, rng.integers(3, 14))) for _ in range(count)]


def _encode(tokenizer, text: str) -> list[int]:
    """As `assay build` tokenizes a text: the tokenizer's ids, then the end-of-sequence token."""
    return [*tokenizer(text)["input_ids"], tokenizer.eos_token_id]


def _collator(pad_id: int):
    """Right padding; every real token is a target (as in an index), padding is not."""

    def collate(rows: list[dict]) -> dict[str, torch.Tensor]:
        width = max(len(r["input_ids"]) for r in rows)
        ids = torch.full((len(rows), width), pad_id)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, : len(r["input_ids"])] = torch.tensor(r["input_ids"])
            mask[i, : len(r["input_ids"])] = 1
        return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}

    return collate


def train(
    root: Path,
    tokenizer,
    max_steps: int,
    save_steps: int,
    normalizer: str | None = None,
    lora: Path | None = None,
) -> GradientCallback:
    """A Trainer run (2 micro-batches of 3 per step and rank, AdamW, checkpoints every `save_steps`)
    with the callback on its checkpoints' steps (its normalizer: the default, or `normalizer`); with
    `lora` (a model folder), of a LoRA adapter on every linear layer of that model."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    data = [{"input_ids": _encode(tokenizer, t)} for t in _texts()]
    args = TrainingArguments(
        output_dir=str(root / "trainer"), per_device_train_batch_size=3, gradient_accumulation_steps=2,
        max_steps=max_steps, save_steps=save_steps, learning_rate=1e-2, report_to=[], use_cpu=True,
        seed=0, logging_steps=100, disable_tqdm=True,
    )  # fmt: skip
    config = LiveConfig(projection_dim=4, max_length=64)
    if normalizer is not None:
        config.normalizer = normalizer  # type: ignore[assignment]
    callback = GradientCallback(root / "grads", config=config)
    model = tiny_llama(vocab_size=len(tokenizer))
    if lora is not None:  # from a folder: the adapter records where its base is
        base = AutoModelForCausalLM.from_pretrained(lora)
        model = get_peft_model(base, LoraConfig(r=2, target_modules="all-linear", lora_dropout=0.0))
    trainer = Trainer(
        model=model, args=args, train_dataset=data,
        data_collator=_collator(tokenizer.pad_token_id), processing_class=tokenizer, callbacks=[callback],
    )  # fmt: skip
    trainer.train()
    return callback


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_tokenizer):
    """A 4-step run with checkpoints every 2 steps: (root, callback)."""
    root = tmp_path_factory.mktemp("trainer")
    return root, train(root, tiny_tokenizer, max_steps=4, save_steps=2)


def assert_rows_equal_assay_build(root: Path, step: int, examples: int, normalizer: str) -> None:
    """The index of `step` holds `examples` rows, each equal to `assay build`'s at checkpoint-`step`
    with the optimizer state saved there as the normalizer (`--normalizer normalizer`)."""
    folder = root / "grads" / f"step-{step}"
    index = assay.open_index(folder, verify="full")
    assert len(index) == examples
    texts = [json.loads(line)["text"] for line in (folder / "examples.jsonl").read_text().splitlines()]
    assert set(texts) <= set(_texts())
    checkpoint = root / "trainer" / f"checkpoint-{step}"
    ref = root / "ref"
    args = ["build", str(ref), "--model", str(checkpoint), "--dataset", str(folder / "examples.jsonl")]
    assert index.meta["normalizer"] == normalizer
    args += ["--normalizer", normalizer, "--optimizer_state", str(checkpoint / "optimizer.pt"), *FLAGS]
    assert main([*args, "--max_length", "64"]) == 0
    built = assay.open_index(ref)
    assert built.meta["model"]["fingerprint"] == index.meta["model"]["fingerprint"]  # the copy is θ_2
    for name, tensor in load_safetensors(ref / NORMALIZER_FILE).items():  # live vs the saved optimizer.pt
        torch.testing.assert_close(load_safetensors(folder / NORMALIZER_FILE)[name], tensor, rtol=0, atol=0)
    rows, want = np.asarray(index.gradients), np.asarray(built.gradients)
    np.testing.assert_allclose(rows, want, rtol=2e-4, atol=2e-5 * np.abs(want).max())
    np.testing.assert_allclose(index.losses, built.losses, rtol=1e-5)
    np.testing.assert_array_equal(index.token_counts, built.token_counts)


def test_trainer_rows_equal_assay_build_at_the_checkpoint(trained):
    root, callback = trained
    assert callback.written == [root / "grads" / "step-2"]  # checkpoint-4 ends the run: no step follows
    assert_rows_equal_assay_build(root, step=2, examples=6, normalizer="adafactor")  # the default


def test_trainer_under_torchrun_writes_the_global_batch(tmp_path):
    """2 data-parallel ranks: one index of the step's 12 examples (2 ranks x 2 micro-batches of 3),
    each row still `assay build`'s at the checkpoint (here with the exact Adam normalizer)."""
    ok(torchrun(__file__, str(tmp_path)))
    assert not (tmp_path / "grads" / "step-2").exists()  # checkpoint-2 ends the run
    assert_rows_equal_assay_build(tmp_path, step=1, examples=12, normalizer="adam")


def test_an_index_written_during_training_is_scored(trained, tmp_path):
    root, _ = trained
    out = tmp_path / "s"
    query = ["--query_text", "the king and a folk tune"]
    assert main(["score", str(out), "--index", str(root / "grads" / "step-2"), *query, "--top_k", "3"]) == 0
    top = json.loads((out / "top.jsonl").read_text().splitlines()[0])
    texts = [json.loads(line) for line in (out / "texts.jsonl").read_text().splitlines()]
    assert len(top["proponents"]) == 3 and all(t["text"] for t in texts)


def test_a_lora_trainer_step_equals_assay_build_of_its_checkpoint(tmp_path, tiny_tokenizer, tiny_model_dir):
    """A LoRA adapter's index (the Trainer turns use_cache off while it trains; the adapter copy
    loads with its base's config) matches its own saved model, and `assay build` of the adapter
    checkpoint, and is scored."""
    train(tmp_path, tiny_tokenizer, max_steps=3, save_steps=2, lora=tiny_model_dir)
    assert_rows_equal_assay_build(tmp_path, step=2, examples=6, normalizer="adafactor")
    out = tmp_path / "s"
    index = ["--index", str(tmp_path / "grads" / "step-2"), "--query_text", "the king and a folk tune"]
    assert main(["score", str(out), *index, "--top_k", "3"]) == 0


def test_a_plain_loop_step_equals_assay_build(tmp_path, tiny_tokenizer):
    model = tiny_llama(vocab_size=len(tiny_tokenizer))
    model.save_pretrained(tmp_path / "m")
    tiny_tokenizer.save_pretrained(tmp_path / "m")
    batch = _collator(tiny_tokenizer.pad_token_id)(
        [{"input_ids": _encode(tiny_tokenizer, t)} for t in _texts(5)]
    )
    model.train()
    with record_gradients(
        tmp_path / "g", model, tiny_tokenizer, config=LiveConfig(projection_dim=4, normalizer="none")
    ):
        # a mean over the batch's tokens, scaled as a loop may scale it (accumulation, a loss scaler):
        # rescaled to each example's summed loss
        (model(**batch).loss * 0.25).backward()
    data = tmp_path / "g" / "examples.jsonl"
    assert (
        main(["build", str(tmp_path / "ref"), "--model", str(tmp_path / "m"), "--dataset", str(data), *FLAGS])
        == 0
    )
    rows, want = (np.asarray(assay.open_index(tmp_path / p).gradients) for p in ("g", "ref"))
    np.testing.assert_allclose(rows, want, rtol=2e-4, atol=2e-5 * np.abs(want).max())


def test_misuse_is_one_line(tmp_path, tiny_tokenizer):
    model = tiny_llama(vocab_size=len(tiny_tokenizer)).train()
    ids = torch.tensor([_encode(tiny_tokenizer, "the king")])
    with pytest.raises(AssayError, match="labels="):
        with record_gradients(tmp_path / "a", model, tiny_tokenizer, config=LiveConfig(normalizer="none")):
            model(input_ids=ids).logits.sum().backward()
    with pytest.raises(AssayError, match="not followed by the backward"):
        with record_gradients(tmp_path / "b", model, tiny_tokenizer, config=LiveConfig(normalizer="none")):
            model(input_ids=ids, labels=ids)
            model(input_ids=ids, labels=ids)
    with pytest.raises(AssayError, match="no second moments"):
        with record_gradients(tmp_path / "c", model, tiny_tokenizer, torch.optim.AdamW(model.parameters())):
            pass
    assert not any(p.name.endswith(".part") for p in tmp_path.iterdir())  # nothing half-written is left


if __name__ == "__main__":  # a rank of test_trainer_under_torchrun_writes_the_global_batch
    train(Path(sys.argv[1]), make_tokenizer(), max_steps=2, save_steps=1, normalizer="adam")
    # Tear the Trainer's gloo group down before exit: left to the interpreter's shutdown, its
    # threads can be destroyed while still joinable, and the rank aborts (seen under load).
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
