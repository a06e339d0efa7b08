"""`assay score`: attribute queries to the training examples of a gradient index.

OUT receives `top.jsonl` (proponents and opponents per query or aggregate), `queries.jsonl`,
`texts.jsonl` (id, summed loss and text of the training examples those list, for the first
REPORT_RECORDS records: what `assay report` shows), `summary.json` and, with --save_scores,
every score: `scores.npy` [A, N] float32. With --query_sae/--latent also `latent.json`: each
query's tokens with the latent's activation on them, and the latent's feature-browser record on
the SAE run's held-out texts (so the report runs no model).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
import tyro

from assay.attribution.build import GradientSetup, setup_from_index
from assay.attribution.collector import Objective
from assay.attribution.index import GradientIndex, open_index
from assay.attribution.kernel import RunningTop
from assay.attribution.score import (
    ScoreOptions,
    check_compatible,
    query_gradients,
    score_index,
    top_records,
    train_texts,
    warn_non_finite,
)
from assay.attribution.stream import CorpusConfig
from assay.bridge.latent import (
    HookedSae,
    latent_objective,
    load_hooked_sae,
    most_active_latent,
    silent_queries,
)
from assay.commands.score_table import print_results
from assay.commands.score_tokens import index_tokens
from assay.core.config import DataConfig, QueryConfig
from assay.core.console import note
from assay.core.disk import open_memmap_reserved
from assay.core.distributed import Distributed
from assay.core.errors import AssayError
from assay.core.runs import (
    CONFIG_FILE,
    DONE_FILE,
    RunFolder,
    config_from_dict,
    load_run_config,
    read_json,
    run_folder,
    write_json,
    write_jsonl,
)
from assay.counterfactual.from_run import ReplayedRun, load_replay, metagradient_scores
from assay.lm.data import ID_COLUMN, collate, load_table, texts_of, token_batches
from assay.lm.lean import keep_compute_casts
from assay.lm.queries import Queries, load_queries
from assay.sae.config import SaeTrainConfig
from assay.sae.features import FEATURES_FILE, FeatureBrowser, browse_sae_run, token_text
from assay.sae.train import sae_specs
from assay.training.finetune import FinetuneConfig

TEXTS_FILE = "texts.jsonl"
LATENT_FILE = "latent.json"
REPORT_RECORDS = 100
"""Records of top.jsonl whose training examples texts.jsonl holds (the report shows as many)."""
BROWSER_TEXTS = 200
"""Held-out texts for a latent's browser record when its SAE run has no features.json to match."""


@dataclass
class ScoreConfig:
    """Attribute queries to the training examples of an index built by `assay build`."""

    out: tyro.conf.Positional[str]
    """Output folder (top.jsonl, queries.jsonl, summary.json, optional scores.npy)."""
    index: str | None = None
    """The gradient index folder (the OUT of `assay build`) whose rows are scored."""
    finetune: str | None = None
    """Instead of an index: a finished, deterministic `assay finetune` run, attributed exactly by
    metagradients through every one of its optimizer steps (MAGIC; docs/attribution.md). The
    scores cover its training examples; --mode and the index options do not apply."""
    queries: tyro.conf.OmitArgPrefixes[QueryConfig] = field(default_factory=QueryConfig)
    options: tyro.conf.OmitArgPrefixes[ScoreOptions] = field(default_factory=ScoreOptions)
    save_scores: bool = False
    """Also write every score: scores.npy [queries or 1, N] float32 (what `assay validate` reads)."""
    token_batch_size: int = 2048
    """Most tokens per batch when computing the query gradients."""
    device: str = "auto"
    """cpu, cuda, cuda:N or auto."""
    show: int = 3
    """Proponents shown per query on stdout (top.jsonl holds --top_k)."""
    query_sae: str | None = None
    """An SAE folder (SAELens format). With --latent, each query is that latent's activation summed
    over the query's tokens instead of its loss: proponents are the training examples whose
    training step raises the feature (see docs/report.md)."""
    latent: int | None = None
    """The SAE latent to attribute (with --query_sae)."""
    query_batch_size: int = 1
    """--finetune: queries differentiated together in one reverse pass. One costs about 2.4
    training runs at 1.8x training's peak memory; each further query adds about three copies of
    the trainable parameters to the memory and saves time per query (4: 1.6 runs per query at
    2.4x the memory; docs/BENCHMARKS.md)."""
    trust_remote_code: bool = False
    """Run code shipped with the index's (or --finetune run's) model. Only this flag turns it on:
    a folder's saved settings never do."""
    checkpoint_every: int | None = None
    """--finetune: keep the training state every k steps during the replay. Default ⌈√T⌉ for a run
    of T steps: about 2√T states in memory for one extra forward replay of time. 1: no
    recomputation on the way back, T states (the most memory); 0: only the start."""
    replay_from_step: int = 0
    """--finetune: differentiate only the steps from this one on, the earlier ones held fixed (the
    examples' weights there are not attributed). MAGIC's remedy for a non-smooth start: in Adam's
    first steps the second moments are still tiny, and their exact derivatives can dominate the
    scores (docs/validation.md measures it)."""
    corpus: tyro.conf.OmitArgPrefixes[CorpusConfig] = field(default_factory=CorpusConfig)
    granularity: Literal["example", "token"] = "example"
    """token: also split the scores of each score column's first --token_proponents proponents over
    their tokens (tokens.jsonl; a heat map in `assay report`; docs/attribution.md)."""
    token_proponents: int = 5
    """With --granularity token: proponents per score column whose scores are split over tokens."""
    overwrite: bool = False
    """Replace a finished run in OUT."""

    def __post_init__(self) -> None:
        sources = {"--index": self.index, "--finetune": self.finetune, "--model": self.corpus.model}
        given = [flag for flag, source in sources.items() if source is not None]
        if len(given) != 1:
            clash = f"{' and '.join(given)} are different sources of the training examples; " if given else ""
            if "--model" in given and "--finetune" not in given:
                clash += "an index's queries use the model it was built with; "
            raise AssayError(
                f"{clash}give one of --index INDEX (gradient scores), --finetune RUN (metagradients) "
                "and --model MODEL --dataset DATA (a corpus scored on the fly, without an index)"
            )
        flag = self.corpus.first_set_flag() if self.corpus.model is None else None
        if flag is not None:
            raise AssayError(f"--{flag} describes a corpus scored on the fly: it goes with --model MODEL")
        if self.corpus.model is not None and self.options.search != "exact":
            raise AssayError("--search faiss needs an index: a corpus scored on the fly is scored exactly")
        if self.granularity == "token" and self.finetune is not None:
            raise AssayError("--granularity token splits gradient scores; --finetune has none")
        if self.token_proponents < 1:
            raise AssayError(f"--token_proponents must be positive, got {self.token_proponents}")
        if self.finetune is not None and (self.query_sae is not None or self.options.search != "exact"):
            raise AssayError("--finetune attributes the queries' losses: no --query_sae, no --search faiss")
        if self.query_batch_size < 1 or (self.checkpoint_every or 0) < 0 or self.replay_from_step < 0:
            raise AssayError(
                "--query_batch_size must be >= 1, --checkpoint_every and --replay_from_step >= 0"
            )
        if not self.queries.given:
            raise AssayError("give queries: --query_dataset DATASET and/or --query_text TEXT")
        if self.token_batch_size < 1 or self.show < 0:
            raise AssayError("--token_batch_size must be positive and --show >= 0")
        if self.options.search == "faiss" and self.save_scores:
            raise AssayError("--search faiss gives top-k only (no --save_scores)")
        if (self.query_sae is None) != (self.latent is None):
            raise AssayError("--query_sae and --latent go together")


def objective_of(cfg: ScoreConfig, setup: GradientSetup) -> Objective | None:
    """What each query's gradient is taken of: its loss (None), or an SAE latent's activation."""
    if cfg.query_sae is None:
        return None
    hooked = load_hooked_sae(cfg.query_sae).to(setup.policy.device)
    return latent_objective(hooked, int(cfg.latent or 0))


def prepare_queries(cfg: ScoreConfig, index: GradientIndex) -> tuple[GradientSetup, Queries, torch.Tensor]:
    """(setup, queries, [Q, D] fp32 gradients) computed exactly as the index's rows were."""
    setup = setup_from_index(index, cfg.device, cfg.trust_remote_code)
    check_compatible(index, setup)
    keep_compute_casts(setup.model, setup.policy)  # from here on the model only collects gradients
    queries, grads = checked_query_gradients(cfg, setup, int(index.meta["data"]["max_length"]))
    return setup, queries, grads


def checked_query_gradients(
    cfg: ScoreConfig, setup: GradientSetup, max_length: int
) -> tuple[Queries, torch.Tensor]:
    """(queries, [Q, D] fp32 gradients); a query whose gradient is all zero is refused (one line)."""
    queries = load_queries(cfg.queries, max_length, setup.tokenizer)
    grads = query_gradients(setup, queries.examples, cfg.token_batch_size, objective_of(cfg, setup))
    zero = silent_queries(grads.numpy())
    if len(zero):
        first = queries.ids[int(zero[0])]
        if cfg.query_sae is not None:
            raise AssayError(
                f"latent {cfg.latent} never fires on query {first!r} (all-zero gradient); choose queries "
                "where it fires (`assay report` on the SAE run shows its top contexts)"
            )
        raise AssayError(f"query {first!r} has an all-zero gradient; it cannot be attributed")
    return queries, grads


def run_score(cfg: ScoreConfig) -> dict[str, Any]:
    """Compute the queries' gradients like the index's, score, write OUT, print the table (or, with
    --finetune, the metagradient scores)."""
    if cfg.finetune is not None:
        summary, records, query_texts, texts = replay_score(cfg)
        print_results(records, query_texts, texts, cfg.show, cfg.out, cfg.save_scores)
        return summary
    if cfg.corpus.model is not None:
        from assay.commands.score_stream import stream_run  # it builds on this module

        return stream_run(cfg)
    assert cfg.index is not None
    index = open_index(cfg.index)
    RunFolder(cfg.out, "score", cfg, cfg.overwrite, resumable=False).check()  # before the gradients
    if cfg.options.top_k > len(index):
        note(f"--top_k {cfg.options.top_k} is above the index's {len(index)} rows: every row is listed, "
             "as a proponent and as an opponent")  # fmt: skip
    setup, queries, grads = prepare_queries(cfg, index)  # user errors surface before OUT.part exists
    if not Distributed.current().is_main:  # rank 0 streams the index and writes OUT
        with run_folder(cfg.out, "score", cfg, cfg.overwrite, resumable=False):
            return {}
    options = cfg.options
    with run_folder(cfg.out, "score", cfg, cfg.overwrite, resumable=False) as run:
        columns = len(queries.ids) if options.aggregate == "none" else 1
        scores_out = None
        if cfg.save_scores:
            scores_out = open_memmap_reserved(run.path / "scores.npy", np.float32, (columns, len(index)))
        start = time.perf_counter()
        top, whitening = score_index(index, grads, options, scores_out)
        seconds = time.perf_counter() - start
        if scores_out is not None:
            scores_out.flush()
            del scores_out
        records = top_records(index.ids, queries.ids, top, options.aggregate)
        write_jsonl(run.path / "top.jsonl", records)
        write_jsonl(
            run.path / "queries.jsonl", [{"query": q, "text": t} for q, t in zip(queries.ids, queries.texts)]
        )
        texts = write_train_texts(run.path / TEXTS_FILE, index, records, cfg.show)
        if cfg.granularity == "token":
            index_tokens(run.path, cfg, setup, index, grads, whitening, records[:REPORT_RECORDS])
        if cfg.query_sae is not None:
            write_json(run.path / LATENT_FILE, latent_record(cfg, setup, queries))
        summary = {
            "index": str(index.path),
            "mode": options.mode,
            "aggregate": options.aggregate,
            "search": options.search,
            "num_queries": len(queries.ids),
            "num_rows": len(index),
            "mix": whitening.mix if whitening else None,
            "damping": options.damping,
            "precision": setup.policy.name,
            "score_seconds": seconds,
            "rows_per_s": len(index) / max(seconds, 1e-9),
        }
        write_json(run.path / "summary.json", summary)
    print_results(records, dict(zip(queries.ids, queries.texts)), texts, cfg.show, cfg.out, cfg.save_scores)
    return summary


def write_train_texts(path: Path, index: GradientIndex, records: list[dict], show: int) -> dict[int, str]:
    """Write {id, loss, text} of every training example the first REPORT_RECORDS records list (text
    null when the index's dataset can no longer be loaded); returns those texts and the texts of
    the examples `print_results` shows, read in one go."""
    listed = {int(pid) for r in records[:REPORT_RECORDS] for pid, _ in r["proponents"] + r["opponents"]}
    printed = {int(pid) for r in records for pid, _ in r["proponents"][:show] + r["opponents"][:1]}
    texts = train_texts(index, listed | printed)
    ids = np.asarray(index.ids)  # [N]
    rows_of = np.flatnonzero(np.isin(ids, np.fromiter(listed, dtype=np.int64, count=len(listed))))
    losses = {int(ids[r]): float(index.losses[r]) for r in rows_of}  # only the listed rows: N may be large
    rows = [{"id": i, "loss": losses[i], "text": texts.get(i)} for i in sorted(listed) if i in losses]
    write_jsonl(path, rows)
    return texts


def replay_score(cfg: ScoreConfig) -> tuple[dict[str, Any], list[dict], dict[Any, str], dict[int, str]]:
    """(summary, records, query texts, training texts) of metagradient scores through the --finetune
    run, written like any score run (rank 0 writes; under torchrun each rank replays the run and
    differentiates every world-th query)."""
    assert cfg.finetune is not None
    dist = Distributed.current()
    replayed = load_replay(cfg.finetune, cfg.device, cfg.checkpoint_every, cfg.trust_remote_code)
    steps = len(replayed.replay.run.steps)
    if cfg.replay_from_step >= steps:
        raise AssayError(
            f"--replay_from_step {cfg.replay_from_step} is past the last step of {cfg.finetune} ({steps - 1})"
        )
    note(f"replayed {cfg.finetune} in {replayed.replay_seconds:.1f} s (final weights within "
         f"{replayed.max_weight_difference:.1g} of the saved ones)")  # fmt: skip
    queries = load_queries(cfg.queries, replayed.max_length, replayed.tokenizer)
    start = time.perf_counter()
    scores = _metagradient_columns(cfg, replayed, queries)
    seconds = time.perf_counter() - start
    ids = np.asarray(replayed.train.ids)
    running = RunningTop(scores.shape[0], cfg.options.top_k)
    running.update(torch.from_numpy(scores.astype(np.float32)), 0)
    top = running.result()
    warn_non_finite(top, ids, str(cfg.finetune), "their metagradients overflowed")
    records = top_records(ids, queries.ids, top, cfg.options.aggregate)
    listed = {int(p) for r in records for p, _ in r["proponents"] + r["opponents"]}
    texts = texts_by_id(replayed_data(cfg.finetune), listed)
    summary = {
        "finetune": str(cfg.finetune), "mode": "replay", "aggregate": cfg.options.aggregate,
        "replay_from_step": cfg.replay_from_step,
        "num_queries": len(queries.ids), "num_rows": len(ids), "precision": replayed.policy.name,
        "replay_seconds": replayed.replay_seconds, "score_seconds": seconds,
        "max_weight_difference": replayed.max_weight_difference,
    }  # fmt: skip
    with run_folder(cfg.out, "score", cfg, cfg.overwrite, resumable=False) as run:
        if dist.is_main:
            if cfg.save_scores:
                np.save(run.path / "scores.npy", scores.astype(np.float32))
            np.save(run.path / "ids.npy", ids.astype(np.int64))
            write_jsonl(run.path / "top.jsonl", records)
            query_rows = [{"query": q, "text": t} for q, t in zip(queries.ids, queries.texts)]
            write_jsonl(run.path / "queries.jsonl", query_rows)
            write_jsonl(
                run.path / TEXTS_FILE, [{"id": i, "loss": None, "text": t} for i, t in sorted(texts.items())]
            )
            write_json(run.path / "summary.json", summary)
    return summary, records, dict(zip(queries.ids, queries.texts)), texts


def _metagradient_columns(cfg: ScoreConfig, replayed: ReplayedRun, queries: Queries) -> np.ndarray:
    """[Q, N] per-query metagradient scores, or [1, N] for --aggregate mean (one reverse pass of the
    mean query loss) and max; per-query rows are shared out over torchrun ranks."""
    if cfg.options.aggregate == "mean":
        first = cfg.replay_from_step
        return metagradient_scores(replayed, queries.examples, True, first_step=first) / len(queries.ids)
    dist = Distributed.current()
    mine = dist.interleave_array(np.arange(len(queries.ids)))
    part = metagradient_scores(
        replayed, queries.examples.subset(mine), False, cfg.query_batch_size, cfg.replay_from_step
    )
    scores = np.zeros((len(queries.ids), len(replayed.train)))
    for positions, rows in dist.gather((mine, part)):
        scores[positions] = rows
    return scores.max(axis=0, keepdims=True) if cfg.options.aggregate == "max" else scores


def replayed_data(run_dir: str) -> DataConfig:
    """The training data config of a finetune run folder."""
    return config_from_dict(FinetuneConfig, read_json(Path(run_dir) / CONFIG_FILE)["config"]).data


def texts_by_id(data: DataConfig, ids: set[int]) -> dict[int, str]:
    """Texts of the given example ids of a dataset ({} when it can no longer be loaded)."""
    try:
        table = load_table(data)
    except AssayError as e:
        note(f"training texts unavailable ({e}); showing ids only")
        return {}
    subset = table.select([i for i, v in enumerate(table[ID_COLUMN]) if int(v) in ids])
    return dict(zip((int(v) for v in subset[ID_COLUMN]), texts_of(subset, data)))


def pick_latent(cfg: ScoreConfig, sae_dir: str) -> int:
    """The latent of the SAE in SAE_DIR most active on the queries of `cfg` (summed over tokens)."""
    if cfg.index is None:
        raise AssayError("--query_sae needs --index (the latent is attributed through an index)")
    index = open_index(cfg.index)
    setup = setup_from_index(index, cfg.device, cfg.trust_remote_code)
    queries = load_queries(cfg.queries, int(index.meta["data"]["max_length"]), setup.tokenizer)
    return most_active_latent(setup.model, load_hooked_sae(sae_dir), queries.examples, setup.pad_id)


# ---- latent.json: what the report shows of a latent query, computed while the model is here ----
def latent_record(cfg: ScoreConfig, setup: GradientSetup, queries: Queries) -> dict[str, Any]:
    """latent.json of a `--query_sae/--latent` run: each query's tokens with the latent's activation
    on them, and the latent's browser record (None, with `feature_note` saying why, when it cannot
    be made)."""
    latent = int(cfg.latent or 0)
    hooked = load_hooked_sae(str(cfg.query_sae))
    feature, why, sample = latent_feature(str(cfg.query_sae), latent, cfg.device)
    if why:
        note(f"latent {latent}: no feature-browser record ({why})")
    return {
        "latent": latent,
        "sae": str(cfg.query_sae),
        "hookpoint": hooked.hookpoint,
        "queries": query_activations(setup, hooked, latent, queries, cfg.token_batch_size),
        "feature": feature,
        "feature_note": why,
        "feature_sample": sample,
    }


@torch.no_grad()
def query_activations(
    setup: GradientSetup, hooked: HookedSae, latent: int, queries: Queries, token_batch_size: int
) -> list[dict[str, Any]]:
    """[{query, tokens, acts}]: the latent's activation at each token of each query, as the query
    objective sees it (the index's model and precision; fp32 SAE)."""
    examples = queries.examples
    hooked.to(setup.policy.device)
    cache: dict[int, str] = {}
    out: dict[int, dict[str, Any]] = {}
    for positions in token_batches(examples, token_batch_size):
        batch = collate(examples, positions, setup.pad_id, setup.policy.device)
        with setup.policy.autocast():
            acts = hooked.latents(setup.model, batch)[:, :, latent].float().cpu().numpy()  # [B, T]
        for row, pos in enumerate(positions):
            seq = examples.tokens_of(int(pos))
            out[int(pos)] = {
                "query": queries.ids[int(pos)],
                "tokens": [token_text(setup.tokenizer, int(t), cache) for t in seq],
                "acts": [float(a) for a in acts[row, : len(seq)]],
            }
    return [out[i] for i in range(len(examples))]


def latent_feature(sae_dir: str, latent: int, device: str) -> tuple[dict | None, str, dict[str, Any]]:
    """(the latent's browser record, why there is none, the sample it was computed on).

    Taken from the SAE run's features.json when the latent is there; else computed on the same
    held-out texts (the SAE run's model, dataset and context length). An SAE folder that is not
    a finished `assay sae train` run has no held-out texts to read.
    """
    folder = Path(sae_dir)
    cfg = _sae_run_config(folder)
    if cfg is None:
        return None, f"{sae_dir} is not a finished `assay sae train` run: no held-out texts to read", {}
    browser = None
    if (folder / FEATURES_FILE).exists():
        browser = FeatureBrowser.load(folder / FEATURES_FILE)
        found = browser.feature(latent)
        if found is not None:
            return found.to_json(), "", _sample_of(browser)
    texts = int((browser.source.get("max_texts") if browser else None) or BROWSER_TEXTS)
    try:
        computed = browse_sae_run(cfg, folder, 0, texts, device, first=(latent,))
    except AssayError as e:
        return None, str(e), {}
    return computed.features[0].to_json(), "", _sample_of(computed)


def _sae_run_config(folder: Path) -> SaeTrainConfig | None:
    """The config of the finished `assay sae train` run whose SAE is in `folder`: the run's own, or,
    for one SAE of several trained in one pass (a subfolder), the run's for that SAE alone."""
    for run, name in ((folder, ""), (folder.parent, folder.name)):
        try:
            saved = load_run_config(run)
        except AssayError:
            continue
        if saved.get("command") == "sae train" and (run / DONE_FILE).exists():
            specs = dict(sae_specs(config_from_dict(SaeTrainConfig, saved["config"])))
            return specs.get(name)
    return None


def _sample_of(browser: FeatureBrowser) -> dict[str, Any]:
    return {"texts": browser.examples, "tokens": browser.tokens, **browser.source}


DEMO_QUERIES = QueryConfig(
    query_dataset="abc-tunes",
    query_split="eval",
    query_filter_column="collection",
    query_filter_value="oneill",
)
"""The README's main job queries: held-out Irish (O'Neill) tunes."""


def score_demo(index_dir: str, out_dir: str, queries: int = 3, overwrite: bool = False) -> dict[str, Any]:
    """The README's main job: attribute held-out O'Neill tunes to the ABC training tunes."""
    q = dataclasses.replace(DEMO_QUERIES, query_max_samples=queries)
    return run_score(ScoreConfig(out=out_dir, index=index_dir, queries=q, overwrite=overwrite))


def latent_demo(index_dir: str, sae_dir: str, out: str, queries: int = 3, overwrite: bool = False) -> dict:
    """The SAE latent most active on the demo's queries, attributed to the training tunes."""
    q = dataclasses.replace(DEMO_QUERIES, query_max_samples=queries)
    cfg = ScoreConfig(out=out, index=index_dir, queries=q, overwrite=overwrite)
    latent = pick_latent(cfg, sae_dir)
    return run_score(dataclasses.replace(cfg, query_sae=str(sae_dir), latent=latent))


Config = ScoreConfig
run = run_score
