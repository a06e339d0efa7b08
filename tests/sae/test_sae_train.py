"""SAE training end to end on a tiny random Llama: splice metrics, caching, bf16 vs fp32, resume."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from assay.core.config import DataConfig, ModelConfig, RuntimeConfig
from assay.core.errors import AssayError
from assay.core.precision import PrecisionPolicy
from assay.sae import loop as loop_mod
from assay.sae import train as train_mod
from assay.sae.activations import (
    CachedActivations,
    LMActivations,
    ShuffledBatches,
    pack_contexts,
    write_cache,
)
from assay.sae.config import SaeArchConfig, SaeTrainConfig
from assay.sae.evaluate import splice_metrics
from assay.sae.metrics import DeadLatents, ReconstructionStats
from assay.sae.model import THRESHOLD_BETA, SparseAutoencoder
from assay.sae.optim import averaged as averaged_point
from assay.sae.train import default_learning_rate, init_from_data, make_optimizer, train_step
from tests.helpers import SAMPLE_TEXTS

HOOK = "model.layers.0"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:  # type: ignore[no-untyped-def]
    """~400 short documents mixing the sample texts (a few thousand tokens), as a saved dataset
    folder with a train split and a held-out eval split of 80 more."""
    from datasets import Dataset, DatasetDict

    rng = random.Random(0)
    rows = [{"text": " ".join(rng.sample(SAMPLE_TEXTS, 2))} for _ in range(480)]
    path = tmp_path_factory.mktemp("sae-data") / "docs"
    DatasetDict({"train": Dataset.from_list(rows[:400]), "eval": Dataset.from_list(rows[400:])}).save_to_disk(
        str(path)
    )
    return path


@pytest.fixture(scope="module")
def model(tiny_model_dir):  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()


def _contexts(model, n: int = 24, t: int = 16, seed: int = 0) -> np.ndarray:  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(seed)
    return rng.integers(0, model.config.vocab_size, size=(n, t)).astype(np.int64)


def test_splice_metrics_equal_a_manual_computation_with_hooks(model) -> None:  # type: ignore[no-untyped-def]
    torch.manual_seed(1)
    sae = SparseAutoencoder(32, 128, SaeArchConfig(architecture="topk", k=8))
    sae.act_scale.fill_(1.7)
    ids = torch.from_numpy(_contexts(model, 7))
    got = splice_metrics(model, sae, HOOK, ids.numpy(), batch_contexts=3)  # uneven batches

    def run(replace):  # type: ignore[no-untyped-def]
        def hook(_m, _i, out):  # type: ignore[no-untyped-def]
            h = out[0] if isinstance(out, tuple) else out
            new = replace(h)
            return (new, *out[1:]) if isinstance(out, tuple) else new

        handle = model.get_submodule(HOOK).register_forward_hook(hook)
        try:
            with torch.no_grad():
                return model(input_ids=ids).logits.double()
        finally:
            handle.remove()

    clean = run(lambda h: h)
    spliced = run(lambda h: sae.reconstruct(h))
    zero = run(torch.zeros_like)

    def ce(logits):  # type: ignore[no-untyped-def]
        return float(F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)))

    ref = {"ce_clean": ce(clean), "ce_spliced": ce(spliced), "ce_zero": ce(zero)}
    ref["ce_loss_score"] = (ref["ce_zero"] - ref["ce_spliced"]) / (ref["ce_zero"] - ref["ce_clean"])
    lc, ls = F.log_softmax(clean, -1), F.log_softmax(spliced, -1)
    ref["kl"] = float((lc.exp() * (lc - ls)).sum(-1).mean())
    for key, value in ref.items():
        assert got[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
    assert got["ce_spliced"] != pytest.approx(got["ce_clean"], abs=1e-4)  # the splice did something
    # reconstruction metrics from the same hook agree with a direct computation
    with torch.no_grad():
        h = model(input_ids=ids, output_hidden_states=True).hidden_states[1].reshape(-1, 32)
    stats = ReconstructionStats(32, 128)
    stats.update(h, sae.reconstruct(h), sae.encode(h * 1.7))
    assert got["fvu"] == pytest.approx(stats.result()["fvu"], rel=1e-5)


def test_cached_activations_give_the_same_batches_as_streaming(model, tmp_path) -> None:  # type: ignore[no-untyped-def]
    policy = PrecisionPolicy.resolve("fp32")
    stream = LMActivations(model, HOOK, _contexts(model, 40), policy, batch_contexts=8)
    write_cache(stream, tmp_path / "cache", {"hookpoint": HOOK}, chunk=16)
    cached = CachedActivations(tmp_path / "cache")
    assert (cached.n_contexts, cached.d_in) == (40, 32)
    a = ShuffledBatches(stream, batch_tokens=64, buffer_batches=4, seed=3)
    b = ShuffledBatches(cached, batch_tokens=64, buffer_batches=4, seed=3)
    for xa, xb in zip(list(_take(a.iterate(), 25)), _take(b.iterate(), 25)):  # crosses fills and epochs
        torch.testing.assert_close(xa, xb, rtol=1e-5, atol=1e-5)
    # a batch mixes many contexts, and resuming at batch i yields batch i
    assert len(np.unique(a.fill_contexts(0))) == 16
    later = list(_take(b.iterate(), 7))[-1]
    torch.testing.assert_close(next(b.iterate(6)), later)


def _take(it, n):  # type: ignore[no-untyped-def]
    for _ in range(n):
        yield next(it)


def _train_fvu(precision: str, source, optimizer: str, steps: int = 120) -> float:  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    sae = SparseAutoencoder(32, 256, SaeArchConfig(architecture="topk", k=8))
    batches = ShuffledBatches(source, batch_tokens=256, buffer_batches=4, seed=0)
    init_from_data(sae, batches.fill(0))
    lr = 3e-3 if optimizer == "adam" else default_learning_rate(256, True, "signum")
    opt = make_optimizer(sae, lr, optimizer)
    policy = PrecisionPolicy.resolve(precision)
    dead = DeadLatents(256, 10**9)
    for i, x in enumerate(_take(batches.iterate(), steps)):
        train_step(sae, opt, x * sae.act_scale, dead, policy, lr, 0.0, 1.0, first=i == 0)
    held_out = source.rows(np.arange(source.n_contexts - 8, source.n_contexts))  # fixed evaluation set
    stats = ReconstructionStats(32, 256)
    with averaged_point(opt):  # signum: evaluated at x, as fit() saves it
        stats.update(held_out, sae.reconstruct(held_out), sae.encode(held_out * sae.act_scale))
    return stats.result()["fvu"]


@pytest.mark.parametrize("optimizer", ["adam", "signum"])
def test_bf16_and_fp32_reach_the_same_fvu_on_the_same_cached_activations(model, tmp_path, optimizer) -> None:  # type: ignore[no-untyped-def]
    ids = pack_contexts(np.random.default_rng(0).integers(0, model.config.vocab_size, 96 * 16), 16)
    stream = LMActivations(model, HOOK, ids, PrecisionPolicy.resolve("fp32"), batch_contexts=32)
    write_cache(stream, tmp_path / "cache", {})
    cached = CachedActivations(tmp_path / "cache")
    f32, bf16 = _train_fvu("fp32", cached, optimizer), _train_fvu("bf16", cached, optimizer)
    assert f32 < 0.5  # it learned something
    assert abs(f32 - bf16) < 0.01, (f32, bf16)


def _cfg(tiny_model_dir, corpus, out, **kw) -> SaeTrainConfig:  # type: ignore[no-untyped-def]
    return SaeTrainConfig(
        out=str(out),
        model=ModelConfig(model=str(tiny_model_dir)),
        data=DataConfig(str(corpus)),
        runtime=RuntimeConfig(precision=kw.pop("precision", "fp32")),
        sae=SaeArchConfig(architecture=kw.pop("architecture", "topk"), d_sae=128, k=8),
        hookpoint=HOOK,
        training_tokens=12 * 256,
        batch_tokens=256,
        context_length=16,
        buffer_batches=4,
        lr_warmup_steps=2,
        metrics_every=2,
        checkpoint_every=4,
        eval_contexts=kw.pop("eval_contexts", 6),
        **kw,
    )


def test_a_file_as_activation_cache_is_refused_before_the_model_loads(tmp_path) -> None:  # type: ignore[no-untyped-def]
    (tmp_path / "cache").write_text("mine")
    with pytest.raises(AssayError, match="cache is a file; give a folder"):
        _cfg("no-model", "no-data", tmp_path / "out", cache_activations=str(tmp_path / "cache"))
    assert (tmp_path / "cache").read_text() == "mine"


@pytest.mark.parametrize("optimizer", ["adam", "signum"])
def test_resume_reaches_exactly_the_uninterrupted_weights(
    tiny_model_dir, corpus, tmp_path, monkeypatch, optimizer
) -> None:  # type: ignore[no-untyped-def]
    kw = {"architecture": "batchtopk", "optimizer": optimizer}
    straight = train_mod.train_sae(_cfg(tiny_model_dir, corpus, tmp_path / "a", **kw))
    real_step, calls = loop_mod.train_step, {"n": 0}

    def crashing_step(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls["n"] += 1
        if calls["n"] == 7:  # after the checkpoint at step 4
            raise KeyboardInterrupt
        return real_step(*args, **kwargs)

    monkeypatch.setattr(loop_mod, "train_step", crashing_step)
    cfg_b = _cfg(tiny_model_dir, corpus, tmp_path / "b", **kw)
    with pytest.raises(KeyboardInterrupt):
        train_mod.train_sae(cfg_b)
    assert (tmp_path / "b.part" / "checkpoint" / "state.json").exists()
    monkeypatch.setattr(loop_mod, "train_step", real_step)
    resumed = train_mod.train_sae(cfg_b)
    wa, wb = (
        load_file(str(tmp_path / "a" / "sae_weights.safetensors")),
        load_file(str(tmp_path / "b" / "sae_weights.safetensors")),
    )
    for name in wa:
        assert torch.equal(wa[name], wb[name]), name
    assert resumed["fvu"] == straight["fvu"]
    lines = [json.loads(line) for line in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in lines if "fvu" in r]  # training lines (eval lines carry eval/*)
    assert steps == sorted(steps) and len(steps) == len(set(steps))  # no duplicated lines after resume


def test_train_then_eval_command_on_the_saved_folder(tiny_model_dir, corpus, tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    from assay.cli import main

    summary = train_mod.train_sae(
        _cfg(
            tiny_model_dir,
            corpus,
            tmp_path / "run",
            precision="bf16",
            cache_activations=str(tmp_path / "cache"),
        )
    )
    assert summary["precision"] == "bf16" and summary["l0"] <= 8
    for key in (
        "eval/ce_clean",
        "eval/ce_spliced",
        "eval/ce_zero",
        "eval/ce_loss_score",
        "eval/kl",
        "eval/fvu",
    ):
        assert np.isfinite(summary[key])
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert {"l0", "mse", "fvu", "explained_variance", "dead_fraction"} <= set(lines[0])
    assert (tmp_path / "cache" / "meta.json").exists()
    code = main(
        ["sae", "eval", str(tmp_path / "run"), "--model", str(tiny_model_dir), "--dataset", str(corpus)]
        + ["--eval_contexts", "6"]
    )
    assert code == 0
    saved = json.loads((tmp_path / "run" / "eval.json").read_text())
    assert saved["hookpoint"] == HOOK
    for key in ("ce_clean", "ce_spliced", "ce_zero", "kl", "fvu", "l0"):  # same held-out contexts
        assert saved[key] == pytest.approx(summary[f"eval/{key}"], rel=1e-4, abs=1e-6), key
    assert "ce_loss_score" in capsys.readouterr().out
    again = ["sae", "eval", str(tmp_path / "run"), "--model", str(tiny_model_dir), "--dataset", str(corpus)]
    assert main(again) == 2  # an earlier evaluation is a result: not silently replaced
    assert "--overwrite" in capsys.readouterr().err
    assert json.loads((tmp_path / "run" / "eval.json").read_text()) == saved
    # without --model: the model cfg.json names (the one it was trained on), the same numbers
    default = ["sae", "eval", str(tmp_path / "run"), "--dataset", str(corpus), "--eval_contexts", "6"]
    assert main([*default, "--overwrite"]) == 0
    assert json.loads((tmp_path / "run" / "eval.json").read_text()) == saved
    # another model's activations (assay-tiny is 256 wide): one line naming both widths
    assert main([*default, "--model", "assay-tiny", "--out", str(tmp_path / "other.json")]) == 2
    assert "256-wide activations where the SAE has" in capsys.readouterr().err


def test_transcoder_trains_from_an_mlp_input_to_its_output_and_splices_its_prediction(
    tiny_model_dir, corpus, model, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    from assay.sae.saelens_format import load_sae

    # the random model's MLP outputs are near 0 (splicing them changes nothing): predict block 1's
    # output from block 0's MLP input instead, which exercises the same two-hook path
    mlp_in, mlp_out = "model.layers.0.post_attention_layernorm", "model.layers.1"
    cfg = _cfg(tiny_model_dir, corpus, tmp_path / "tc", architecture="relu", hookpoint_out=mlp_out)
    cfg.hookpoint = mlp_in
    summary = train_mod.train_sae(cfg)
    assert (summary["d_in"], summary["d_out"], summary["hookpoint_out"]) == (32, 32, mlp_out)
    assert summary["fvu"] < 1.0 and np.isfinite(summary["eval/fvu"])  # training predicts better than the mean
    tc, meta = load_sae(tmp_path / "tc")
    assert tc.transcoder and meta["hook_name"] == mlp_in and meta["hook_name_out"] == mlp_out
    # reference: hooks that capture the MLP's input and replace its output by the prediction
    ids = torch.from_numpy(pack_contexts(np.arange(6 * 16) % model.config.vocab_size, 16))
    got = splice_metrics(model, tc, mlp_in, ids.numpy(), hookpoint_out=mlp_out)
    seen: dict = {}
    h1 = model.get_submodule(mlp_in).register_forward_hook(lambda m, i, o: seen.update(x=o))  # a tensor
    h2 = model.get_submodule(mlp_out).register_forward_hook(
        lambda m, i, o: (
            (tc.reconstruct(seen["x"]), *o[1:]) if isinstance(o, tuple) else tc.reconstruct(seen["x"])
        )
    )
    try:
        with torch.no_grad():
            spliced = model(input_ids=ids).logits.double()
    finally:
        h1.remove()
        h2.remove()
    ce = F.cross_entropy(spliced[:, :-1].reshape(-1, spliced.shape[-1]), ids[:, 1:].reshape(-1))
    assert got["ce_spliced"] == pytest.approx(float(ce), rel=1e-4)
    assert got["ce_spliced"] != pytest.approx(got["ce_clean"], abs=1e-4)


def test_several_saes_from_one_pass_equal_the_same_saes_trained_alone(
    tiny_model_dir, corpus, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    hooks = ["model.layers.0", "model.layers.1"]
    multi = _cfg(
        tiny_model_dir, corpus, tmp_path / "multi", hookpoints=hooks, sweep_k=[4, 8], eval_contexts=0
    )
    summary = train_mod.train_sae(multi)
    assert sorted(summary["saes"]) == [f"{h}-k{k}" for h in hooks for k in (4, 8)]
    for hook, k in ((hooks[0], 8), (hooks[1], 4)):  # two of the four, alone (a third of the time)
        alone = _cfg(tiny_model_dir, corpus, tmp_path / f"{hook}-{k}", eval_contexts=0)
        alone.hookpoint, alone.sae.k = hook, k
        train_mod.train_sae(alone)
        wa = load_file(str(tmp_path / f"{hook}-{k}" / "sae_weights.safetensors"))
        wb = load_file(str(tmp_path / "multi" / f"{hook}-k{k}" / "sae_weights.safetensors"))
        for name in wa:
            assert torch.equal(wa[name], wb[name]), (hook, k, name)
        got = summary["saes"][f"{hook}-k{k}"]
        assert got["hookpoint"] == hook and got["l0"] <= k


def test_a_single_file_holds_out_its_last_contexts(tiny_model_dir, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A one-file dataset has no eval split: its last --eval_contexts contexts are held out, never
    trained on, and the run's held-out metrics and browser read exactly those."""
    from assay.lm.models import load_tokenizer
    from assay.sae.sources import split_contexts

    path = tmp_path / "one.jsonl"
    path.write_text("".join(json.dumps({"text": t * 3}) + "\n" for t in SAMPLE_TEXTS * 4))
    cfg = _cfg(tiny_model_dir, path, tmp_path / "sae", eval_contexts=3)
    tokenizer = load_tokenizer(cfg.model)
    train, held = split_contexts(cfg, tokenizer)
    assert held.shape == (3, 16)
    everything = np.concatenate([train, held])
    assert not any((held[i] == train).all(1).any() for i in range(3))  # nowhere in training
    np.testing.assert_array_equal(everything[-3:], held)  # the file's last contexts
    summary = train_mod.train_sae(cfg)
    assert "eval/ce_spliced" in summary and np.isfinite(summary["eval/fvu"])


def test_resume_refuses_changed_data(tiny_model_dir, tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """An interrupted run resumed on other data is refused by name instead of mixing the two."""
    import assay.sae.loop as loop_mod

    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": t * 3}) + "\n" for t in SAMPLE_TEXTS * 4))
    cfg = _cfg(tiny_model_dir, data, tmp_path / "sae", eval_contexts=2)
    real_step, calls = loop_mod.train_step, []

    def crashing_step(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(1)
        if len(calls) == 5:
            raise KeyboardInterrupt
        return real_step(*args, **kwargs)

    monkeypatch.setattr(loop_mod, "train_step", crashing_step)
    with pytest.raises(KeyboardInterrupt):
        train_mod.train_sae(cfg)
    monkeypatch.setattr(loop_mod, "train_step", real_step)
    data.write_text(data.read_text().replace("the", "a"))  # same file, other texts
    with pytest.raises(AssayError, match="dataset"):
        train_mod.train_sae(cfg)


@pytest.mark.parametrize("optimizer", ["adam", "signum"])
def test_batchtopk_saves_the_threshold_of_its_final_weights(
    tiny_model_dir, corpus, tmp_path, monkeypatch, optimizer
) -> None:  # type: ignore[no-untyped-def]
    """The trained BatchTopK's JumpReLU threshold is the smallest activation BatchTopK keeps on the
    last batch at the saved weights (signum: the averaged point), so that batch fires N * k latents
    as trained; the threshold EMA of training, which lags the weights, would not."""
    real_step, calls = loop_mod.train_step, []

    def recording_step(sae, opt, x, *args, **kwargs):  # type: ignore[no-untyped-def]
        out = real_step(sae, opt, x, *args, **kwargs)
        calls.append((sae, x, float(out.min_kept)))
        return out

    monkeypatch.setattr(loop_mod, "train_step", recording_step)
    train_mod.train_sae(
        _cfg(tiny_model_dir, corpus, tmp_path / "sae", architecture="batchtopk", optimizer=optimizer)
    )
    sae, x, _ = calls[-1]
    ema = calls[0][2]
    for _, _, kept in calls[1:]:
        ema = THRESHOLD_BETA * ema + (1 - THRESHOLD_BETA) * kept
    with torch.no_grad():
        pre = sae.pre_acts(x)
    target = len(x) * sae.arch.k
    fired = int((pre > sae.threshold_buf).sum())
    assert target - 2 <= fired <= target, (fired, target)  # the minimum itself is not above it
    assert abs(int((pre > ema).sum()) - target) > 2  # the EMA would fail the line above
    saved = load_file(str(tmp_path / "sae" / "sae_weights.safetensors"))["threshold"]
    # saved unchanged: the folded activation scale leaves pre-activations as they are
    torch.testing.assert_close(saved, sae.threshold_buf)
