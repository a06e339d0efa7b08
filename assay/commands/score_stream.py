"""`assay score OUT --model M --dataset D --query_...` without --index: a corpus scored on the fly.

Writes what a score run over an index writes (top.jsonl, queries.jsonl, texts.jsonl, summary.json,
with --save_scores scores.npy), plus ids.npy and losses.npy ([N]: each corpus example's id and
summed loss, in the corpus's order, the columns of scores.npy). Resumable: rerun the same command.
The arithmetic is attribution/stream.py's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from assay.attribution.score import top_records, warn_non_finite
from assay.attribution.stream import StreamResult, corpus_setup, plan_for, stream_scores
from assay.commands.score import (
    REPORT_RECORDS,
    TEXTS_FILE,
    ScoreConfig,
    checked_query_gradients,
)
from assay.commands.score_table import print_results
from assay.commands.score_tokens import TOKENS_FILE, write_tokens
from assay.core.disk import open_memmap_reserved
from assay.core.distributed import Distributed
from assay.core.errors import AssayError
from assay.core.runs import check_inputs, run_folder, write_json, write_jsonl
from assay.lm.data import examples_fingerprint, texts_of, tokenizer_fingerprint


def stream_run(cfg: ScoreConfig) -> dict[str, Any]:
    """Score the corpus of --model/--dataset on the fly, write OUT, print the table."""
    if Distributed.current().active:
        raise AssayError("a corpus scored on the fly runs in one process: under torchrun, build an index")
    build = cfg.corpus.build_config(cfg.device, cfg.token_batch_size, cfg.trust_remote_code)
    options = cfg.options
    with run_folder(cfg.out, "score", cfg, cfg.overwrite) as run:
        setup, table, examples = corpus_setup(build, run.path)
        queries, grads = checked_query_gradients(cfg, setup, build.data.max_length)
        fingerprints = {"dataset": examples_fingerprint(examples), "model": str(setup.fingerprint)}
        fingerprints |= {"tokenizer": tokenizer_fingerprint(setup.tokenizer)}
        check_inputs(run, {**fingerprints, "queries": examples_fingerprint(queries.examples)})
        columns = len(queries.ids) if options.aggregate == "none" else 1
        outputs = {"losses": _per_row(run.path / "losses.npy", (len(examples),), run.resumed)}
        if cfg.save_scores:
            outputs["scores"] = _per_row(run.path / "scores.npy", (columns, len(examples)), run.resumed)
        np.save(run.path / "ids.npy", examples.ids.astype(np.int64))
        result = stream_scores(
            setup,
            examples,
            build,
            grads,
            options,
            run.path,
            outputs,
            run.resumed,
            cfg.corpus.stream_buffer_mib,
        )
        cause = "their gradients are finite, so the queries' preconditioning overflowed; raise --damping"
        warn_non_finite(result.top, examples.ids, "the corpus", cause)
        records = top_records(examples.ids, queries.ids, result.top, options.aggregate)
        write_jsonl(run.path / "top.jsonl", records)
        query_rows = [{"query": q, "text": t} for q, t in zip(queries.ids, queries.texts)]
        write_jsonl(run.path / "queries.jsonl", query_rows)
        texts = _write_texts(
            run.path / TEXTS_FILE, table, examples, records, np.asarray(outputs["losses"]), cfg
        )
        if cfg.granularity == "token":
            plan = plan_for(grads, options, result.whitening)
            position_of = {int(i): k for k, i in enumerate(examples.ids)}
            write_tokens(
                run.path / TOKENS_FILE, setup, examples, position_of, plan, records[:REPORT_RECORDS], cfg
            )
        summary = _summary(cfg, result, len(queries.ids), len(examples), setup.policy.name)
        write_json(run.path / "summary.json", summary)
    print_results(records, dict(zip(queries.ids, queries.texts)), texts, cfg.show, cfg.out, cfg.save_scores)
    return summary


def _per_row(path: Path, shape: tuple[int, ...], resumed: bool) -> np.ndarray:
    """A float32 .npy memmap of `shape`: reopened when resuming (its rows so far are kept)."""
    if resumed and path.exists():
        arr = np.lib.format.open_memmap(path, mode="r+")
        if arr.shape == shape and arr.dtype == np.float32:
            return arr
    return open_memmap_reserved(path, np.float32, shape)


def _write_texts(
    path: Path, table: Any, examples: Any, records: list[dict], losses: np.ndarray, cfg: ScoreConfig
) -> dict[int, str]:
    """texts.jsonl ({id, loss, text} of the examples the first records list) from the corpus itself;
    returns the texts of every example the records list."""
    listed = {int(p) for r in records for p, _ in r["proponents"] + r["opponents"]}
    positions = examples.positions_of(sorted(listed))
    texts = dict(zip(sorted(listed), texts_of(table.select([int(p) for p in positions]), cfg.corpus.data)))
    shown = {int(p) for r in records[:REPORT_RECORDS] for p, _ in r["proponents"] + r["opponents"]}
    loss = dict(zip(sorted(listed), (float(losses[p]) for p in positions)))
    write_jsonl(path, [{"id": i, "loss": loss[i], "text": texts[i]} for i in sorted(shown)])
    return texts


def _summary(
    cfg: ScoreConfig, result: StreamResult, queries: int, rows: int, precision: str
) -> dict[str, Any]:
    options = cfg.options
    return {
        "index": None, "corpus": cfg.corpus.data.dataset, "model": cfg.corpus.model, "mode": options.mode,
        "aggregate": options.aggregate, "search": "stream", "num_queries": queries, "num_rows": rows,
        "mix": result.whitening.mix if result.whitening else None, "damping": options.damping,
        "precision": precision, "score_seconds": result.seconds,
        "rows_per_s": rows / max(result.seconds, 1e-9), "gradients_computed": result.rows_computed,
    }  # fmt: skip
