"""`assay report`: real run folders (build, score, eval, finetune, sae train and a latent score on a
tiny model), a coreset experiment in its documented layout, a demo container, rendered into one
page and checked in a real headless Chromium (no console errors, no network, the numbers in the
DOM). The report reads run folders only: no model, tokenizer or SAE is loaded while it renders."""

from __future__ import annotations

import html
import json
import re
import shutil
from pathlib import Path
from xml.etree import ElementTree

import numpy as np
import pytest

from assay.cli import main
from assay.commands.score import ScoreConfig, pick_latent
from assay.core.config import QueryConfig
from assay.core.errors import AssayError
from assay.report import build_report
from assay.report.browser import Browser, find_chromium

NASTY = "To <b>be</b> or not & \"be\" <script>alert('x')</script>"
LONG = "X:9\nT:A long tune\nM:6/8\nK:D\n" + "\n".join(f"|:d2e f2g|a2b a2f|e2d B2A|{i}" for i in range(12))
TEXTS = [
    "To be, or not to be, that is the question.",
    "X:1\nT:The Kesh\nM:6/8\nK:G\nGAG GAB|ABA ABd|edd gdd|edB dBA|",
    "Now is the winter of our discontent made glorious summer by this sun of York.",
    LONG,
    "All the world's a stage, and all the men and women merely players.",
    "X:2\nT:Drowsy Maggie\nM:4/4\nK:Edor\nE2BE dEBE|E2BE AFDF|",
]
SAE_ARGS = (
    "--hookpoint model.layers.0 --training_tokens 2048 --batch_tokens 256 --context_length 32 "
    "--buffer_batches 2 --lm_batch_contexts 4 --metrics_every 2 --eval_every 4 --eval_contexts 6 "
    "--expansion_factor 2 --k 4 --precision fp32 --browser_latents 6 --browser_examples 6"
).split()


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _finetune_like(folder: Path, seed: int, base: float, slope: float) -> None:
    """A finished finetune run folder in `assay finetune`'s layout (metrics.jsonl, summary.json)."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"command": "finetune", "config": {"seed": seed}}))
    (folder / "run.json").write_text(json.dumps({"finished": "2026-01-01T00:00:00"}))
    rows = [{"step": 0, "eval_loss": base}]
    rows += [{"step": s, "train_loss": base - slope * s + 0.01 * np.sin(s), "lr": 1e-4} for s in range(1, 21)]
    rows += [{"step": s, "eval_loss": base - slope * s} for s in (10, 20)]
    _write_jsonl(folder / "metrics.jsonl", rows)


def make_coreset(root: Path) -> dict:
    """An `assay coreset` folder in its documented layout (results.json as experiments/report.py writes)."""
    root.mkdir()
    (root / "config.json").write_text(json.dumps({"command": "coreset", "config": {"fraction": 0.1}}))
    (root / "run.json").write_text(json.dumps({"finished": "2026-01-01T00:00:00"}))
    means = {"full": 1.2871, "random": 1.8784, "loss": 2.0123, "gradcos": 1.9011,
             "trackstar_bf16": 1.7633, "trackstar_fp32": 1.7635}  # fmt: skip
    rows = {}
    for i, (row, mean) in enumerate(means.items()):
        evals = [mean - 0.01, mean + 0.01]
        rows[row] = {
            "label": row, "seeds": [0, 1], "pool_loss": evals, "eval_loss": evals, "train_loss": evals,
            "wall_s": [10.0, 11.0], "examples": 1000 if row == "full" else 100, "steps": 20,
            "pool_loss_stats": {"mean": mean, "std": 0.0141},
            "eval_loss_stats": {"mean": mean, "std": 0.0141}, "wall_s_stats": {"mean": 10.5, "std": 0.7},
            "eval_vs_random": {"mean": mean - means["random"], "wins": 2 * (mean < means["random"]), "of": 2},
            "pool_vs_random": {"mean": mean - means["random"], "wins": 2 * (mean < means["random"]), "of": 2},
        }  # fmt: skip
        if row not in ("full", "random"):
            rows[row]["draws_beaten"] = 0.8 if mean < means["random"] else 0.1
        if row == "random":
            rows[row]["draws"] = {"eval_loss": [[mean - 0.02, mean], [mean, mean + 0.02]]}
        folder = root / "full" / "seed0" if row == "full" else root / "retrain" / row / "seed0"
        _finetune_like(folder, 0, 3.0, 0.05 + 0.01 * i)
    results = {"seeds": [0, 1], "fraction": 0.1, "query": "self", "rows": rows,
               "selection": {"overlap_trackstar_bf16_fp32": 0.962},
               "stage_s": {"full": 20.0, "retrain/random": 21.0}}  # fmt: skip
    (root / "results.json").write_text(json.dumps(results))
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_model_dir) -> dict[str, Path]:
    """Real runs of every command the report reads, made once for this module (~20 s)."""
    root = tmp_path_factory.mktemp("runs")
    data = _write_jsonl(root / "data.jsonl", [{"text": t} for t in TEXTS * 3])
    model = ["--model", str(tiny_model_dir)]
    out = {k: root / k for k in ("idx", "score", "eval", "ft", "sae", "coreset")}
    common = [*model, "--dataset", str(data), "--precision", "fp32"]
    assert (
        main(["build", str(out["idx"]), *common, "--projection_dim", "4", "--preconditioner", "trackstar"])
        == 0
    )
    query = ["--query_dataset", str(data), "--query_split", "train", "--query_max_samples", "2"]
    assert main(["score", str(out["score"]), "--index", str(out["idx"]), *query, "--query_text", NASTY]) == 0
    assert main(["eval", str(out["eval"]), *common]) == 0
    ft = ["--max_steps", "3", "--effective_batch_size", "4", "--micro_batch_size", "4", "--log_every", "1"]
    assert (
        main(["finetune", str(out["ft"]), *common, *ft, "--eval_dataset", str(data), "--eval_split", "train"])
        == 0
    )
    assert main(["sae", "train", str(out["sae"]), *model, "--dataset", str(data), *SAE_ARGS]) == 0
    make_coreset(out["coreset"])
    demo = root / "demo"
    demo.mkdir()
    (demo / "config.json").write_text(json.dumps({"command": "demo", "config": {"model": "assay-tiny"}}))
    (demo / "run.json").write_text(json.dumps({"finished": "2026-01-01T00:00:00"}))
    (demo / "losses.json").write_text(json.dumps({"shakespeare": 4.4123, "abc-tunes": 2.1357}))
    for name in ("idx", "score", "sae", "coreset"):
        shutil.copytree(out[name], demo / name)
    # a latent-attribution score run (`assay score --query_sae SAE --latent L`) on the demo's own SAE:
    # L is the latent most active on the query, so it fires there
    latent_query = ["--query_text", TEXTS[1]]
    cfg = ScoreConfig(
        out=str(demo / "score-latent"), index=str(demo / "idx"), queries=QueryConfig(query_text=(TEXTS[1],))
    )
    latent = pick_latent(cfg, str(demo / "sae"))
    score = ["score", str(demo / "score-latent"), "--index", str(demo / "idx"), *latent_query]
    assert main([*score, "--query_sae", str(demo / "sae"), "--latent", str(latent)]) == 0
    out["demo"] = demo
    out["data"] = data
    out["latent"] = latent  # type: ignore[assignment]
    return out


@pytest.fixture(scope="module")
def page(runs, tmp_path_factory) -> tuple[Path, str]:
    html_path = tmp_path_factory.mktemp("report") / "report.html"
    build_report([runs["demo"], runs["eval"], runs["ft"]], html_path, "assay demo report", features=6)
    return html_path, html_path.read_text()


def _top(run: Path) -> dict:
    return json.loads((run / "top.jsonl").read_text().splitlines()[0])


def test_every_kind_has_its_section_and_numbers(runs, page):
    _, text = page
    kinds = re.findall(r'<section class="run" id="[^"]*" data-kind="([^"]*)"', text)
    assert kinds == ["demo", "build", "score", "score", "coreset", "sae train", "eval", "finetune"]
    latent = runs["latent"]
    assert "Proponents (a step on them raises the latent)" in text and f"Where latent {latent} fires" in text
    # linked both ways: the score section to the latent's card, the card (pinned first) back
    assert f'href="#sae-latent-{latent}"' in text and f'id="sae-latent-{latent}"' in text
    assert 'href="#score-score-latent">attributed to training data' in text
    cards = re.findall(r'<div class="feature searchable" id="sae-latent-(\d+)"', text)
    saved = [f["latent"] for f in json.loads((runs["sae"] / "features.json").read_text())["features"]]
    assert cards == [str(latent)] + [str(v) for v in saved if v != latent][:6]  # pinned first
    index = json.loads((runs["idx"] / "index.json").read_text())
    assert f'>{index["num_examples"]}</div><div class="tile-label">examples' in text
    first = _top(runs["score"])
    pid, score = first["proponents"][0]
    assert f"{score:.4f}" in text and f">{pid}</td>" in text  # the top proponent, with its score
    assert html.escape(TEXTS[pid % len(TEXTS)][:20]) in text  # ... and its text, from texts.jsonl
    eval_summary = json.loads((runs["eval"] / "summary.json").read_text())
    assert f"{eval_summary['mean_loss']:.3f}" in text
    sae_summary = json.loads((runs["sae"] / "summary.json").read_text())
    assert f"{sae_summary['eval/fvu']:.3f}" in text and "Latent " in text and 'class="ctx"' in text
    assert "1.7633 ± 0.0141" in text and "96.2%" in text  # coreset table and bf16/fp32 overlap
    assert "random draws beaten" in text and "80%" in text and "-0.1151 (2/2)" in text
    assert "random (mean of 2 draws)" in text and "gradcos (mean of" not in text
    assert "4.412" in text and "2.136" in text  # the demo's own headline numbers
    assert text.count("<svg") >= 10  # real charts, inline


def test_page_is_self_contained_and_escaped(page):
    _, text = page
    assert "<script>alert" not in text and "&lt;script&gt;alert(&#x27;x&#x27;)&lt;/script&gt;" in text
    assert len(re.findall(r"<script", text)) == 1  # our own inline script, nothing else
    assert not re.search(r'(src|href)="(https?:)?//', text) and "<link" not in text and "@import" not in text
    assert "<details" in text and "A long tune" in text  # long texts folded, still present
    ids = re.findall(r'\sid="([^"]*)"', text)
    assert len(ids) == len(set(ids))  # the inline SVGs and the sections share one id space
    for svg in re.findall(r"<svg.*?</svg>", text, flags=re.S):
        ElementTree.fromstring(svg)  # every chart is well-formed XML


def test_degrades_gracefully(runs, tmp_path):
    """Missing optional files and unfinished runs give notes naming the command that writes them."""
    idx, score, texts, sae = (
        shutil.copytree(runs[k], tmp_path / name)
        for k, name in (("idx", "idx"), ("score", "score"), ("score", "texts"), ("sae", "sae"))
    )
    latent = shutil.copytree(runs["demo"] / "score-latent", tmp_path / "latent")
    (idx / "losses.npy").unlink()
    (score / "top.jsonl").unlink()
    (texts / "texts.jsonl").unlink()
    (latent / "latent.json").unlink()
    (sae / "metrics.jsonl").unlink()
    (sae / "features.json").unlink()
    (sae / "run.json").unlink()
    sae.rename(tmp_path / "sae.part")
    dirs = [idx, score, texts, latent, tmp_path / "sae"]
    text = build_report(dirs, tmp_path / "r.html", features=4, feature_examples=4).read_text()
    assert "No loss distribution" in text and "No scores" in text and "No training curves" in text
    assert "is unfinished" in text and "no features.json. `assay sae train` writes it" in text
    assert "no texts.jsonl (written by `assay score`" in text and "(text unavailable)" in text
    assert "no latent.json (written by `assay score --query_sae SAE --latent L`)" in text
    coreset = tmp_path / "coreset"
    make_coreset(coreset)
    (coreset / "results.json").unlink()
    (coreset / "run.json").unlink()
    text = build_report([coreset], tmp_path / "c.html").read_text()
    assert "No results table" in text and "Held-out loss" in text


def test_report_reads_run_folders_only(runs, tmp_path, monkeypatch):
    """With every way to load a model, tokenizer or SAE, or to read a layer, made to fail, the page
    still shows the browser from features.json and where the latent fires from latent.json; the
    SAE's weights are not even needed. In a fresh interpreter the report imports no torch."""
    import subprocess
    import sys

    import assay.lm.hooks
    import assay.lm.models
    import assay.sae.saelens_format

    def refuse(*args, **kwargs):
        raise AssertionError("the report must not load a model, tokenizer or SAE")

    for module, name in (
        (assay.lm.models, "load_model"), (assay.lm.models, "load_tokenizer"),
        (assay.sae.saelens_format, "load_sae"), (assay.lm.hooks, "capture_output"),
    ):  # fmt: skip
        monkeypatch.setattr(module, name, refuse)
    demo = shutil.copytree(runs["demo"], tmp_path / "demo")
    (demo / "sae" / "sae_weights.safetensors").unlink()
    text = build_report([demo], tmp_path / "r.html", features=3, feature_examples=2).read_text()
    latent = runs["latent"]
    assert f'id="sae-latent-{latent}"' in text and f"Where latent {latent} fires" in text
    assert len(re.findall(r'<div class="feature searchable"', text)) in (3, 4)  # 3, and the pinned one
    assert max(len(re.findall(r'<div class="ctx"', c)) for c in text.split('class="feature searchable"')) <= 2
    assert "could not be rendered" not in text and "unreadable" not in text
    code = (
        "import sys; from pathlib import Path; from assay.report import build_report; "
        f"build_report([Path({str(demo)!r})], Path({str(tmp_path / 'fresh.html')!r})); "
        "print(sorted(m for m in ('torch', 'transformers', 'safetensors') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip().splitlines()[-1] == "[]"


def test_cli_and_user_errors(runs, tmp_path, capsys):
    out = tmp_path / "r.html"
    assert main(["report", str(runs["eval"]), "-o", str(out)]) == 0
    assert out.exists() and "report:" in capsys.readouterr().out
    assert main(["report", str(runs["eval"]), "-o", str(out)]) == 0  # replaces its own report
    once = out.read_text()
    assert main(["report", str(runs["eval"]), str(runs["eval"]), "-o", str(out)]) == 0
    assert len(out.read_text()) == len(once)  # a folder named twice is one section
    foreign = tmp_path / "notes.html"
    foreign.write_text("<html>mine</html>")
    assert main(["report", str(runs["eval"]), "-o", str(foreign)]) == 2
    assert "not an assay report" in capsys.readouterr().err and foreign.read_text() == "<html>mine</html>"
    (tmp_path / "plain").mkdir()
    with pytest.raises(AssayError, match="not an assay run folder"):
        build_report([tmp_path / "plain"], tmp_path / "x.html")
    assert main(["report", str(tmp_path / "missing"), "-o", str(out)]) == 2
    assert "no such folder" in capsys.readouterr().err


chromium = find_chromium()
needs_browser = pytest.mark.skipif(
    chromium is None, reason="NO CHROMIUM: the browser test did not run; install it with `make browser`"
)


@needs_browser
def test_in_a_real_browser(runs, page, tmp_path):
    """Loads with no console errors or network requests; sections, numbers and search work."""
    html_path, _ = page
    with Browser(chromium, width=1280, height=2000) as browser:
        browser.open(html_path)
        assert browser.problems() == []
        assert all(u.startswith(("file:", "data:")) for u in browser.requests()), browser.requests()
        kinds = browser.evaluate("[...document.querySelectorAll('section.run')].map(s => s.dataset.kind)")
        assert kinds == ["demo", "build", "score", "score", "coreset", "sae train", "eval", "finetune"]
        assert browser.evaluate("document.querySelectorAll('nav.toc a').length") >= 8
        assert browser.evaluate("document.querySelectorAll('svg').length") >= 10
        saved = [f["latent"] for f in json.loads((runs["sae"] / "features.json").read_text())["features"]]
        shown = 1 + len([v for v in saved if v != runs["latent"]][:6])  # the attributed one, then 6
        assert browser.evaluate("document.querySelectorAll('.feature').length") == shown
        card = f"document.getElementById('sae-latent-{runs['latent']}')"
        assert (
            browser.evaluate(f"{card}.querySelector('a.badge').getAttribute('href')") == "#score-score-latent"
        )
        assert browser.evaluate(
            f"document.querySelector('a[href=\"#sae-latent-{runs['latent']}\"]') !== null"
        )
        overlap = browser.evaluate("document.body.innerText.includes('96.2%')")
        assert overlap
        # search: a query that only the nasty ad-hoc query's card contains
        cards = "document.querySelectorAll('section[data-kind=score]:not([id*=latent]) .card.searchable')"
        total = browser.evaluate(f"{cards}.length")
        box = "document.querySelector('section[data-kind=score]:not([id*=latent]) input.search')"
        browser.evaluate(
            f"(() => {{ const b = {box}; b.value = 'alert'; b.dispatchEvent(new Event('input')); }})()"
        )
        shown = browser.evaluate(f"[...{cards}].filter(c => !c.classList.contains('hidden')).length")
        assert total == 3 and shown == 1
        assert browser.problems() == []
        shot = browser.screenshot(tmp_path / "report.png")
    png = shot.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 50_000
    width, height = int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")
    assert (width, height) == (1280, 2000)


def test_latent_json_against_a_dense_reference(runs, tiny_model_dir):
    """latent.json (what `assay score --query_sae --latent` writes for the report): the query's
    tokens and the latent's activation on each equal the SAE applied to the model's hidden state of
    that query alone; the latent's browser record is the SAE run's own (features.json's, or
    computed on the same held-out texts)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from assay.bridge.latent import load_hooked_sae
    from assay.core.runs import config_from_dict, load_run_config
    from assay.sae.config import SaeTrainConfig
    from assay.sae.features import FeatureBrowser, browse_sae_run, token_text

    latent, sae_dir = runs["latent"], runs["demo"] / "sae"
    saved = json.loads((runs["demo"] / "score-latent" / "latent.json").read_text())
    assert saved["latent"] == latent and saved["hookpoint"] == "model.layers.0" and len(saved["queries"]) == 1
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    ids = tok(TEXTS[1])["input_ids"] + [tok.eos_token_id]  # as assay tokenizes a query
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    with torch.no_grad():
        hidden = model(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states[1][0]
        dense = load_hooked_sae(sae_dir).sae.encode(hidden)[:, latent].numpy()  # [T]
    query = saved["queries"][0]
    assert query["tokens"] == [token_text(tok, t, {}) for t in ids]
    np.testing.assert_allclose(query["acts"], dense, rtol=1e-4, atol=1e-5)
    assert dense.max() > 0  # the latent fires on the query (it was picked as the most active)
    browser = FeatureBrowser.load(sae_dir / "features.json")
    own = browser.feature(latent)
    if own is None:  # not in the browser's sample: computed on the same held-out texts
        cfg = config_from_dict(SaeTrainConfig, load_run_config(sae_dir)["config"])
        own = browse_sae_run(cfg, sae_dir, 0, browser.source["max_texts"], "cpu", first=(latent,)).features[0]
    assert saved["feature"]["latent"] == latent and saved["feature"]["contexts"] == own.to_json()["contexts"]
    assert saved["feature"]["histogram"] == own.histogram and saved["feature_sample"]["texts"] == 6


def test_score_writes_the_training_texts_it_lists(runs):
    """texts.jsonl (what the report shows beside each score): exactly the ids top.jsonl lists, each
    with its summed loss from the index and its text from the dataset row of that id."""
    rows = [json.loads(line) for line in (runs["score"] / "texts.jsonl").read_text().splitlines()]
    listed = {pid for r in (runs["score"] / "top.jsonl").read_text().splitlines()
              for pid, _ in json.loads(r)["proponents"] + json.loads(r)["opponents"]}  # fmt: skip
    assert sorted(r["id"] for r in rows) == sorted(listed)
    ids, losses = np.load(runs["idx"] / "ids.npy"), np.load(runs["idx"] / "losses.npy")
    for r in rows:
        assert r["text"] == (TEXTS * 3)[r["id"]]
        np.testing.assert_allclose(r["loss"], losses[np.flatnonzero(ids == r["id"])[0]], rtol=1e-6)


def test_a_filter_run_shows_what_it_kept(runs, tmp_path):
    """`assay filter`'s section: the kept share, the pool's scores, the kept examples with their
    texts (texts.jsonl, written by the filter run: the report reads run folders only)."""
    out = tmp_path / "kept"
    args = ["filter", str(out), "--strategy", "trackstar", "--index", str(runs["idx"]), "--query", "self"]
    assert main([*args, "--num_examples", "3"]) == 0  # the pool's texts come from the index's data
    kept = [json.loads(line) for line in (out / "selection.jsonl").read_text().splitlines()]
    texts = {r["id"]: r["text"] for r in map(json.loads, (out / "texts.jsonl").read_text().splitlines())}
    assert [r["id"] for r in kept] == list(texts)  # rank order, every kept example's text
    assert main(["report", str(out), "-o", str(tmp_path / "r.html")]) == 0
    page = (tmp_path / "r.html").read_text()
    assert "trackstar (score), query self" in page and "The first 20 kept examples" in page
    assert html.escape(texts[kept[0]["id"]].splitlines()[0]) in page
