"""assay finetune: parameter sets, accumulation equivalence, order replay, resumption, dtypes."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from assay.core.config import DataConfig, ModelConfig, RuntimeConfig
from assay.core.errors import AssayError
from assay.core.precision import PrecisionPolicy
from assay.lm.data import load_examples
from assay.lm.models import load_model, load_tokenizer
from assay.training import finetune as ft
from assay.training.checkpoint import OPTIMIZER_STATE_FILE, load_second_moments
from assay.training.recipe import TrainRecipe
from assay.training.schedule import lr_factor, warmup_steps_for
from assay.training.step import train_step
from assay.training.subset import read_ids, replayed_plan
from tests.helpers import SAMPLE_TEXTS


@pytest.fixture
def data_jsonl(tmp_path) -> Path:
    path = tmp_path / "train.jsonl"
    rng = np.random.default_rng(0)
    with open(path, "w") as f:
        for i in range(24):
            text = " ".join(SAMPLE_TEXTS[j] for j in rng.choice(len(SAMPLE_TEXTS), size=1 + i % 3))
            f.write(json.dumps({"text": text, "group": f"g{i % 2}"}) + "\n")
    return path


def make_cfg(out: Path, model_dir: Path, data: Path, **kw) -> ft.FinetuneConfig:
    runtime = RuntimeConfig(
        precision=kw.pop("precision", "fp32"), seed=kw.pop("seed", 0), attention="eager", threads=1
    )
    model = ModelConfig(model=str(model_dir), lora_rank=kw.pop("lora_rank", 0))
    recipe_fields = {f.name for f in dataclasses.fields(TrainRecipe)}
    recipe = {"effective_batch_size": 8, "micro_batch_size": 4, "learning_rate": 1e-3}
    recipe |= {k: kw.pop(k) for k in list(kw) if k in recipe_fields}
    defaults = dict(eval_split="", log_every=1, save_every=0)
    return ft.FinetuneConfig(
        out=str(out),
        model=model,
        data=DataConfig(dataset=str(data), max_length=64),
        runtime=runtime,
        recipe=TrainRecipe(**recipe),
        **(defaults | kw),
    )


def weights(folder: Path) -> dict[str, torch.Tensor]:
    name = (
        "adapter_model.safetensors"
        if (folder / "adapter_model.safetensors").exists()
        else "model.safetensors"
    )
    return load_file(str(folder / name))


def test_lora_trains_only_adapter_and_full_trains_everything(tmp_path, tiny_model_dir, data_jsonl):
    base = weights(tiny_model_dir)
    ft.finetune(make_cfg(tmp_path / "lora", tiny_model_dir, data_jsonl, lora_rank=4, max_steps=2))
    adapter = weights(tmp_path / "lora" / "model")
    assert adapter and all("lora_" in k for k in adapter)
    assert any(k.endswith("lora_B.weight") and v.abs().sum() > 0 for k, v in adapter.items())  # B starts at 0
    moments = load_second_moments(tmp_path / "lora")
    assert moments and all("lora_" in k for k in moments)

    ft.finetune(make_cfg(tmp_path / "full", tiny_model_dir, data_jsonl, max_steps=2))
    full = weights(tmp_path / "full" / "model")
    changed = [k for k in base if not torch.equal(base[k], full[k])]
    assert set(changed) == set(base)  # every parameter moved
    assert len(load_second_moments(tmp_path / "full")) == len(base)


def _grads_after_step(model, examples, positions, micro, policy, pad_id):
    model.zero_grad(set_to_none=True)
    train_step(model, examples, positions, micro, policy, pad_id, None)
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def test_weighted_examples_train_as_replicated_ones(tiny_model_dir, data_jsonl):
    """A weight of k on an example gives exactly the step of that example k times in the batch."""
    policy = PrecisionPolicy.resolve("fp32")
    mcfg = ModelConfig(model=str(tiny_model_dir))
    tok = load_tokenizer(mcfg)
    _, examples = load_examples(DataConfig(dataset=str(data_jsonl), max_length=64), tok)
    model = load_model(mcfg, policy, attention="eager").train()
    w = np.ones(len(examples))
    w[[1, 4]] = (3.0, 2.0)
    weighted = _weighted_grads(model, examples, np.array([0, 1, 2, 4]), policy, tok.pad_token_id, w)
    replicated = _grads_after_step(
        model, examples, np.array([0, 1, 1, 1, 2, 4, 4]), 8, policy, tok.pad_token_id
    )
    for name in weighted:
        torch.testing.assert_close(weighted[name], replicated[name], rtol=1e-5, atol=1e-7)


def _weighted_grads(model, examples, positions, policy, pad_id, w):
    model.zero_grad(set_to_none=True)
    train_step(model, examples, positions, 8, policy, pad_id, None, w)
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def test_gradient_accumulation_matches_one_big_batch(tiny_model_dir, data_jsonl):
    policy = PrecisionPolicy.resolve("fp32")
    mcfg = ModelConfig(model=str(tiny_model_dir))
    tok = load_tokenizer(mcfg)
    _, examples = load_examples(DataConfig(dataset=str(data_jsonl), max_length=64), tok)
    model = load_model(mcfg, policy, attention="eager").train()
    positions = np.arange(8)
    one = _grads_after_step(model, examples, positions, 8, policy, tok.pad_token_id)
    four = _grads_after_step(model, examples, positions, 2, policy, tok.pad_token_id)
    eight = _grads_after_step(model, examples, positions, 1, policy, tok.pad_token_id)
    for name in one:
        torch.testing.assert_close(four[name], one[name], rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(eight[name], one[name], rtol=1e-5, atol=1e-7)
    # and the reference: the token-mean loss over the 8 examples computed by hand
    model.zero_grad(set_to_none=True)
    from assay.lm.data import collate
    from assay.lm.losses import token_losses

    batch = collate(examples, positions, tok.pad_token_id)
    losses = token_losses(
        model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits, batch["labels"]
    )
    (losses.sum() / (batch["labels"][:, 1:] != -100).sum()).backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(one[name], p.grad, rtol=1e-5, atol=1e-7)


def test_accumulated_runs_give_the_same_model(tmp_path, tiny_model_dir, data_jsonl):
    a = make_cfg(tmp_path / "a", tiny_model_dir, data_jsonl, micro_batch_size=8, max_steps=2)
    b = make_cfg(tmp_path / "b", tiny_model_dir, data_jsonl, micro_batch_size=2, max_steps=2)
    ft.finetune(a), ft.finetune(b)
    wa, wb = weights(tmp_path / "a" / "model"), weights(tmp_path / "b" / "model")
    for name in wa:
        torch.testing.assert_close(wa[name], wb[name], rtol=1e-4, atol=1e-6)


def test_keep_freed_memory_switches_the_allocator_before_training_and_keeps_the_model(
    tmp_path, tiny_model_dir, data_jsonl, monkeypatch
):
    steps: list[str] = []
    for name in ("load_model", "reuse_freed_memory"):
        real = getattr(ft, name)
        monkeypatch.setattr(ft, name, lambda *a, _n=name, _f=real, **k: steps.append(_n) or _f(*a, **k))
    real_run = ft.Trainer.run
    monkeypatch.setattr(ft.Trainer, "run", lambda self: steps.append("train") or real_run(self))
    ft.finetune(make_cfg(tmp_path / "returned", tiny_model_dir, data_jsonl, max_steps=2))
    assert steps == ["load_model", "train"]
    steps.clear()
    cfg = make_cfg(tmp_path / "kept", tiny_model_dir, data_jsonl, max_steps=2)
    ft.finetune(dataclasses.replace(cfg, runtime=dataclasses.replace(cfg.runtime, keep_freed_memory=True)))
    assert steps == ["load_model", "reuse_freed_memory", "train"]
    kept, returned = weights(tmp_path / "kept" / "model"), weights(tmp_path / "returned" / "model")
    for name in returned:
        torch.testing.assert_close(kept[name], returned[name], rtol=0, atol=0)


def test_ordered_replays_the_full_runs_order(tmp_path, tiny_model_dir, data_jsonl):
    ft.finetune(make_cfg(tmp_path / "full", tiny_model_dir, data_jsonl, num_epochs=2, max_steps=1))
    full = json.loads((tmp_path / "full" / "order.json").read_text())["epochs"]
    assert len(full) == 2 and sorted(full[0]) == list(range(24)) and full[0] != full[1]
    chosen = [3, 17, 5, 11, 20, 0]
    (tmp_path / "ids.txt").write_text("\n".join(map(str, chosen)))
    cfg = make_cfg(tmp_path / "sub", tiny_model_dir, data_jsonl, num_epochs=2, max_steps=1)
    cfg.selection, cfg.ordered = str(tmp_path / "ids.txt"), str(tmp_path / "full")
    summary = ft.finetune(cfg)
    sub = json.loads((tmp_path / "sub" / "order.json").read_text())["epochs"]
    for e in range(2):
        assert sub[e] == [i for i in full[e] if i in chosen]
    assert summary["examples"] == 6 and summary["pool_loss"] is not None
    with pytest.raises(AssayError, match="recorded 2 epoch"):
        replayed_plan(tmp_path / "full", np.array(chosen), 3)
    with pytest.raises(AssayError, match="never visited"):
        replayed_plan(tmp_path / "full", np.array([99]), 1)


def test_interrupted_run_resumes_to_the_same_result(tmp_path, tiny_model_dir, data_jsonl, monkeypatch):
    ref = make_cfg(tmp_path / "ref", tiny_model_dir, data_jsonl, num_epochs=2, micro_batch_size=2)
    ft.finetune(ref)

    def stop(step: int) -> None:
        if step == 4:
            raise KeyboardInterrupt

    cfg = make_cfg(
        tmp_path / "run", tiny_model_dir, data_jsonl, num_epochs=2, micro_batch_size=2, save_every=3
    )
    monkeypatch.setattr(ft, "_after_step", stop)
    with pytest.raises(KeyboardInterrupt):
        ft.finetune(cfg)
    assert (tmp_path / "run.part" / "checkpoint" / "state.json").exists()
    steps_seen = []
    monkeypatch.setattr(ft, "_after_step", steps_seen.append)
    ft.finetune(cfg)
    assert steps_seen[0] == 4  # resumed after the step-3 checkpoint
    for name, w in weights(tmp_path / "ref" / "model").items():
        torch.testing.assert_close(weights(tmp_path / "run" / "model")[name], w, rtol=1e-5, atol=1e-6)
    log = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train_steps = [r["step"] for r in log if "train_loss" in r and not r.get("final")]
    assert train_steps == list(range(1, 7))  # no step logged twice


@pytest.mark.parametrize("precision", ["bf16", "fp16", "bf16-pure"])
def test_precision_dtypes(tmp_path, tiny_model_dir, data_jsonl, precision):
    cfg = make_cfg(tmp_path / precision, tiny_model_dir, data_jsonl, precision=precision, max_steps=2)
    policy = PrecisionPolicy.resolve(precision)
    model = load_model(cfg.model, policy)
    data = ft.prepare_data(cfg, load_tokenizer(cfg.model))
    trainer = ft.Trainer(cfg, model, data, policy, 0, tmp_path)
    trainer.run()
    master = torch.bfloat16 if precision == "bf16-pure" else torch.float32
    for p in model.parameters():
        assert p.dtype == master
        state = trainer.optimizer.state[p]
        assert state["exp_avg_sq"].dtype == master and state["exp_avg"].dtype == master
        assert torch.isfinite(state["exp_avg_sq"]).all()
    assert (trainer.scaler is not None) == (precision == "fp16")
    ft.save_outputs(trainer, tmp_path, load_tokenizer(cfg.model))
    with safe_open(str(tmp_path / OPTIMIZER_STATE_FILE), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.float32}  # exported in fp32 always
        assert f.metadata()["precision"] == precision and f.metadata()["step"] == "2"


def test_schedule_warms_up_then_decays():
    warm = warmup_steps_for(10, 0.2, 0)
    factors = [lr_factor(s, 10, warm, "cosine") for s in range(10)]
    assert warm == 2 and factors[0] < factors[1] < factors[2] == 1.0
    assert all(a >= b for a, b in zip(factors[2:], factors[3:])) and factors[-1] < 0.05
    assert lr_factor(5, 10, 0, "constant") == 1.0 and lr_factor(5, 10, 0, "linear") == 0.5
    assert [
        len(b) for _, b in TrainRecipe(effective_batch_size=4, micro_batch_size=4).steps([np.arange(10)])
    ] == [4, 4, 2]


def test_selection_files_and_bad_input(tmp_path, tiny_model_dir, data_jsonl):
    (tmp_path / "a.json").write_text("[1, 2, 3]")
    (tmp_path / "b.jsonl").write_text('{"id": 4, "score": 1.0}\n{"id": 2, "score": 0.5}\n')
    assert read_ids(tmp_path / "a.json").tolist() == [1, 2, 3]
    assert read_ids(tmp_path / "b.jsonl").tolist() == [4, 2]
    (tmp_path / "dup.txt").write_text("1 1")
    with pytest.raises(AssayError, match="more than once"):
        read_ids(tmp_path / "dup.txt")
    with pytest.raises(AssayError, match="not found"):
        read_ids(tmp_path / "missing.txt")
    with pytest.raises(AssayError, match="multiple of"):
        make_cfg(tmp_path / "x", tiny_model_dir, data_jsonl, effective_batch_size=6, micro_batch_size=4)
    (tmp_path / "far.txt").write_text("1000")
    cfg = make_cfg(tmp_path / "x", tiny_model_dir, data_jsonl, selection=str(tmp_path / "far.txt"))
    with pytest.raises(AssayError, match="not in this dataset"):
        ft.finetune(cfg)


def test_an_adapter_of_a_bundled_model_names_its_base_by_alias(tmp_path, data_jsonl):
    """peft records the folder `assay-tiny` resolved to; the run records the alias, which loads in
    any checkout (the folder would not)."""
    from assay.lm.models import load_model

    out = tmp_path / "lora"
    ft.finetune(make_cfg(out, "assay-tiny", data_jsonl, lora_rank=2, max_steps=1))
    config = json.loads((out / "model" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == "assay-tiny"
    reloaded = load_model(ModelConfig(model=str(out / "model")), PrecisionPolicy.resolve("fp32", "cpu"))
    saved = weights(out / "model")
    state = {k.replace(".default", ""): v for k, v in reloaded.state_dict().items() if "lora_" in k}
    assert saved and all(torch.equal(state[k], v) for k, v in saved.items())
