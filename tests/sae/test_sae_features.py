"""The SAE feature browser (assay/sae/features.py) against a dense reference, and its file:
`assay sae train` writes OUT/features.json, which reads back to the same browser."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

from assay.cli import main
from assay.lm.data import Examples
from assay.sae.config import SaeArchConfig
from assay.sae.features import (
    FEATURES_FILE,
    HISTOGRAM_BINS,
    TOP_CONTEXTS,
    FeatureBrowser,
    LatentReader,
    browse,
)
from assay.sae.model import SparseAutoencoder
from tests.helpers import make_tokenizer, tiny_llama, write_word_texts

LENGTHS = (9, 17, 5, 12, 14)
IDS = [10, 11, 12, 13, 14]


def _examples(seqs: list[np.ndarray]) -> Examples:
    lengths = np.array([len(s) for s in seqs], dtype=np.int64)
    return Examples(
        ids=np.array(IDS[: len(seqs)], dtype=np.int64),
        offsets=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
        tokens=np.concatenate(seqs).astype(np.int32),
        loss_start=np.ones(len(seqs), dtype=np.int64),
    )


def _setup(dead_head: bool, act_scale: float = 1.0):
    """A tiny Llama, its tokenizer, a TopK SAE (64 latents) on block 0's output, five texts."""
    tok = make_tokenizer()
    model = tiny_llama(0, vocab_size=len(tok)).eval()
    g = torch.Generator().manual_seed(1)
    w = torch.randn(32, 64, generator=g) / 32**0.5
    b_enc = torch.zeros(64)
    if dead_head:
        b_enc[:20] = -1e3  # latents 0..19 never fire: the first 4 live ones lie past the kept head
    sae = SparseAutoencoder(32, 64, SaeArchConfig(architecture="topk", k=6))
    with torch.no_grad():
        for name, value in (("W_enc", w), ("b_enc", b_enc), ("W_dec", w.T), ("b_dec", torch.zeros(32))):
            getattr(sae, name).copy_(value)
        sae.act_scale.fill_(act_scale)
    rng = np.random.default_rng(0)
    seqs = [rng.integers(1, len(tok), size=n).astype(np.int32) for n in LENGTHS]
    return tok, model, sae, seqs


def _dense(model, sae, seqs) -> list[np.ndarray]:
    """[T_i, 64] latents of each text encoded alone (no padding), from the written-out hidden state."""
    out = []
    with torch.no_grad():
        for s in seqs:
            hidden = model(input_ids=torch.from_numpy(s[None].astype(np.int64)), output_hidden_states=True)
            out.append(sae.encode(hidden.hidden_states[1][0] * sae.act_scale).numpy())
    return out


@pytest.mark.parametrize("dead_head", [False, True])
def test_feature_browser_against_a_dense_reference(dead_head):
    """Densities, peaks, top contexts, activation histograms and logit effects equal those of each
    text encoded alone (no padding), read in padded token batches of lm.data; with the lowest
    latents dead the second pass gives the same answers."""
    tok, model, sae, seqs = _setup(dead_head)
    reader = LatentReader(model, sae, "model.layers.0", pad_id=0, token_batch_size=32)
    assert len(reader.batches(_examples(seqs))) >= 3  # several batches, padded
    fb = browse(reader, tok, _examples(seqs), 4)
    dense = _dense(model, sae, seqs)
    allz = np.concatenate(dense)  # [tokens, 64]
    assert fb.tokens == sum(LENGTHS) and fb.examples == len(seqs)
    np.testing.assert_array_equal(fb.fired, (allz > 0).sum(0))
    np.testing.assert_allclose(fb.l0, (allz > 0).sum(1).mean(), rtol=1e-9)
    live = np.flatnonzero((allz > 0).any(0))[:4]
    assert [f.latent for f in fb.features] == list(live) and (not dead_head or live[0] >= 20)
    w_u = model.get_output_embeddings().weight.detach()  # [V, 32]
    for f in fb.features:
        peaks = np.array([z[:, f.latent].max() for z in dense])
        order = [i for i in np.argsort(-peaks, kind="stable")[:TOP_CONTEXTS] if peaks[i] > 0]
        assert [c.example for c in f.contexts] == [IDS[i] for i in order]
        np.testing.assert_allclose(f.max_act, peaks.max(), rtol=1e-5)
        for c, i in zip(f.contexts, order):
            window = dense[i][:, f.latent]
            lo = max(0, int(window.argmax()) - 24)
            np.testing.assert_allclose(c.acts, window[lo : lo + len(c.acts)], rtol=1e-5, atol=1e-6)
            text = tok.decode([int(seqs[i][lo + c.peak])])
            if "\ufffd" not in text:  # (a partial UTF-8 byte is shown as its BPE symbol instead)
                assert c.tokens[c.peak] == (text.replace("\n", "⏎").replace("\t", "⇥") or "∅")
        values = allz[:, f.latent][allz[:, f.latent] > 0]
        ref, _ = np.histogram(values, bins=HISTOGRAM_BINS, range=(0.0, float(values.max())))
        assert f.nonzero == len(values) and sum(f.histogram) == len(values)
        assert np.abs(np.asarray(f.histogram) - ref).sum() <= 2  # a value on a bin edge may move
        effect = (sae.W_dec.detach()[f.latent] @ w_u.T).numpy()  # [V]
        np.testing.assert_allclose([v for _, v in f.promoted], np.sort(effect)[::-1][:8], rtol=1e-5)
        np.testing.assert_allclose([v for _, v in f.suppressed], np.sort(effect)[:8], rtol=1e-5)


def test_pinned_latents_and_json_round_trip():
    """A pinned latent's record equals its record in the full browser, with or without a second
    pass; the browser survives JSON unchanged; an SAE at its training scale browses as folded."""
    tok, model, sae, seqs = _setup(dead_head=False, act_scale=3.0)
    examples = _examples(seqs)
    reader = LatentReader(model, sae, "model.layers.0", pad_id=0, token_batch_size=32)
    full = browse(reader, tok, examples, 40)  # more than the head keeps: a second pass
    last = full.features[-1].latent
    alone = browse(reader, tok, examples, 0, first=(last,))  # pinned: kept in the first pass
    assert [f.latent for f in alone.features] == [last]
    _same_record(alone.features[0], full.feature(last))
    np.testing.assert_array_equal(alone.fired, full.fired)
    pinned = browse(reader, tok, examples, 3, first=(last, 63, 999))  # 999 is no latent: ignored
    assert [f.latent for f in pinned.features][:2] == [last, 63] and len(pinned.features) == 5
    back = FeatureBrowser.from_json(json.loads(json.dumps(full.to_json())))
    assert back.features == full.features and back.tokens == full.tokens
    np.testing.assert_array_equal(back.fired, full.fired)
    folded = browse(LatentReader(model, sae.folded(), "model.layers.0", 0, 32), tok, examples, 40)
    np.testing.assert_array_equal(folded.fired, full.fired)
    for a, b in zip(folded.features, full.features):
        assert a.latent == b.latent and [c.example for c in a.contexts] == [c.example for c in b.contexts]
        np.testing.assert_allclose(a.max_act, b.max_act, rtol=1e-5)


def _same_record(a, b) -> None:
    """Equal records; logit effects to float rounding (a matmul over another set of rows)."""
    assert b is not None
    plain = {"promoted": [], "suppressed": []}
    assert dataclasses.replace(a, **plain) == dataclasses.replace(b, **plain)
    for key in plain:
        assert [t for t, _ in getattr(a, key)] == [t for t, _ in getattr(b, key)]
        np.testing.assert_allclose(
            [v for _, v in getattr(a, key)], [v for _, v in getattr(b, key)], rtol=1e-5
        )


SAE_ARGS = (
    "--hookpoint model.layers.0 --training_tokens 1024 --batch_tokens 256 --context_length 32 "
    "--buffer_batches 2 --lm_batch_contexts 4 --metrics_every 2 --eval_contexts 4 "
    "--expansion_factor 2 --k 4 --precision fp32"
).split()


def test_sae_train_writes_the_browser_and_replays(tmp_path, tiny_model_dir, capsys):
    """`assay sae train` writes features.json (what browse_sae_run computes from the saved config);
    --browser_latents 0 skips it; `assay replay` rebuilds the command's config; --help lists the
    two options; a finished run without features.json gets it on a rerun, without retraining."""
    from assay.commands.sae_train import Config, ensure_feature_browser
    from assay.core.errors import AssayError
    from assay.core.runs import config_from_dict, load_run_config
    from assay.sae.features import browse_sae_run

    data = write_word_texts(tmp_path / "words.jsonl", 80, 24)
    out = tmp_path / "sae"
    args = [str(out), "--model", str(tiny_model_dir), "--dataset", str(data), *SAE_ARGS]
    assert main(["sae", "train", *args, "--browser_latents", "5", "--browser_examples", "4"]) == 0
    saved = FeatureBrowser.load(out / FEATURES_FILE)
    assert len(saved.features) == 5 and saved.examples == 4 and saved.source["max_texts"] == 4
    cfg = config_from_dict(Config, load_run_config(out)["config"])
    assert isinstance(cfg, Config) and cfg.browser_latents == 5
    again = browse_sae_run(cfg, out, 5, 4, "cpu")
    assert again.to_json() == saved.to_json()  # deterministic, and exactly what the run wrote
    (out / FEATURES_FILE).unlink()
    metrics = (out / "metrics.jsonl").read_text()
    assert main(["sae", "train", *args, "--browser_latents", "5", "--browser_examples", "4"]) == 0
    assert FeatureBrowser.load(out / FEATURES_FILE).to_json() == saved.to_json()
    assert (out / "metrics.jsonl").read_text() == metrics  # not retrained
    assert main(["replay", str(out), "--out", str(tmp_path / "again")]) == 0
    assert FeatureBrowser.load(tmp_path / "again" / FEATURES_FILE).features == saved.features
    skip = tmp_path / "skip"
    assert main(["sae", "train", str(skip), *args[1:], "--browser_latents", "0"]) == 0
    assert not (skip / FEATURES_FILE).exists() and (skip / "run.json").exists()
    assert ensure_feature_browser(skip, 5, 4) == skip / FEATURES_FILE  # the demo's route: after the fact
    written = (skip / FEATURES_FILE).read_text()
    assert len(FeatureBrowser.load(skip / FEATURES_FILE).features) == 5
    ensure_feature_browser(skip, 7, 4)  # has one: left as it is
    assert (skip / FEATURES_FILE).read_text() == written
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"command": "eval", "config": {}}))
    with pytest.raises(AssayError, match="not a finished `assay sae train` run"):
        ensure_feature_browser(other, 5, 4)
    capsys.readouterr()
    with pytest.raises(SystemExit):
        main(["sae", "train", "--help"])
    help_text = capsys.readouterr().out
    assert "--browser_latents" in help_text and "--browser_examples" in help_text and "--k" in help_text


def test_several_saes_from_one_pass_each_get_a_browser_and_a_report_part(tmp_path, tiny_model_dir):
    """--hookpoints: each SAE's folder gets its features.json (as that SAE trained alone would),
    and `assay report` shows each SAE at its own hookpoint (not the default --hookpoint)."""
    from assay.commands.sae_train import Config
    from assay.commands.score import latent_feature
    from assay.core.runs import config_from_dict, load_run_config
    from assay.sae.features import browse_sae_run

    data = write_word_texts(tmp_path / "words.jsonl", 80, 24)
    out = tmp_path / "multi"
    args = [str(out), "--model", str(tiny_model_dir), "--dataset", str(data), *SAE_ARGS]
    hooks = ["--hookpoints", "model.layers.0", "model.layers.1"]
    assert main(["sae", "train", *args, *hooks, "--browser_latents", "3", "--browser_examples", "4"]) == 0
    cfg = config_from_dict(Config, load_run_config(out)["config"])
    for hook in ("model.layers.0", "model.layers.1"):
        saved = FeatureBrowser.load(out / hook / FEATURES_FILE)
        assert saved.source["hookpoint"] == hook and len(saved.features) == 3
        one = dataclasses.replace(cfg, hookpoint=hook, hookpoints=[])
        assert browse_sae_run(one, out / hook, 3, 4, "cpu").to_json() == saved.to_json()
        # a latent of one of them attributed (`assay score --query_sae OUT/HOOK`): its record, its texts
        record, why, sample = latent_feature(str(out / hook), 0, "cpu")
        assert record is not None and not why and sample["hookpoint"] == hook
    assert main(["report", str(out), "-o", str(tmp_path / "r.html")]) == 0
    page = (tmp_path / "r.html").read_text()
    assert "2 topk SAEs at model.layers.0, model.layers.1" in page
    assert 'id="multi-model-layers-1-browser"' in page and "No feature browser" not in page
