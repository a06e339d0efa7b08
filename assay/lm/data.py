"""Datasets in, tokenized examples out, then token-budget batches.

Every example keeps a stable id: its row index in the source split, through filtering,
`--max_samples`, sorting and every later step. Tokenization happens once and is cached.
"""

from __future__ import annotations

import hashlib
import json
import os
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from assay.core.config import DataConfig
from assay.core.console import note
from assay.core.errors import AssayError, first_line
from assay.core.paths import cache_dir
from assay.lm import corpora
from assay.lm.chat import conversation_text, tokenize_conversations
from assay.lm.table import Table

ID_COLUMN = "__assay_id__"
TOKENIZE_VERSION = 2
"""Bumped whenever tokenized examples change form (keys the tokenization cache; 2: what
--max_length cut is recorded)."""
CHAT_VERSION = 1
"""Bumped whenever conversations tokenize differently (keys the tokenization cache)."""
FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


def load_table(cfg: DataConfig) -> Table:
    """The dataset split as a `Table`, with the source row id in ID_COLUMN."""
    table = _load_split(cfg)
    table = table.with_column(ID_COLUMN, list(range(len(table))))
    if cfg.filter_column is not None:
        table = _filtered(table, cfg)
    if cfg.max_samples is not None:
        table = table.select(_sample(len(table), cfg.max_samples, cfg.sample_seed))
    if len(table) == 0:
        raise AssayError(f"dataset {cfg.dataset!r} (split {cfg.split!r}) has no examples left")
    _require_columns(table, _text_columns(cfg), cfg.dataset)
    return table


def _filtered(table: Table, cfg: DataConfig) -> Table:
    """The rows whose --filter_column is --filter_value; none is one line naming what there is."""
    assert cfg.filter_column is not None
    _require_columns(table, [cfg.filter_column], cfg.dataset)
    column = [str(v) for v in table[cfg.filter_column]]
    kept = table.select([i for i, v in enumerate(column) if v == cfg.filter_value])
    if len(kept) == 0 and column:
        values = sorted(set(column))
        shown = ", ".join(repr(v if len(v) <= 30 else v[:27] + "...") for v in values[:8])
        more = f" ({len(values)} distinct)" if len(values) > 8 else ""
        raise AssayError(
            f"dataset {cfg.dataset!r} (split {cfg.split!r}) has no row whose {cfg.filter_column!r} is "
            f"{cfg.filter_value!r}; its values: {shown}{more}"
        )
    return kept


def _text_columns(cfg: DataConfig) -> list[str]:
    if cfg.conversation_column:
        return [cfg.conversation_column]
    if cfg.prompt_column and cfg.completion_column:
        return [cfg.prompt_column, cfg.completion_column]
    return [cfg.text_column]


def _sample(n: int, k: int, seed: int | None) -> list[int]:
    """The first k rows, or (with a seed) k rows drawn at random, kept in source order."""
    if seed is None or k >= n:
        return list(range(min(k, n)))
    return sorted(np.random.default_rng(seed).choice(n, size=k, replace=False).tolist())


def _require_columns(table: Any, columns: list[str], name: str) -> None:
    """Every column present (in a `Table` or a `datasets.Dataset`), else one line naming them."""
    missing = [c for c in columns if c not in table.column_names]
    if missing:
        have = ", ".join(c for c in table.column_names if c != ID_COLUMN)
        raise AssayError(f"dataset {name!r} has no column {missing[0]!r}; available: {have}")


def _load_split(cfg: DataConfig) -> Table:
    source = cfg.dataset
    if source in corpora.BUNDLED:
        folder = corpora.prepare(source, cache_dir())
        path = folder / f"{cfg.split}.jsonl"
        if not path.exists():
            raise AssayError(f"bundled dataset {source!r} has splits train and eval, not {cfg.split!r}")
        return Table.from_jsonl(path)
    path = Path(source)
    if path.is_file():
        if cfg.split != "train":
            raise AssayError(
                f"{source} is a single file, read whole as one split, 'train' (not {cfg.split!r}): give "
                "the held-out rows as a file of their own, or pick rows of this one with the command's "
                "filter column and value options (see its --help)"
            )
        return _load_file(path, cfg)
    if path.is_dir():
        return _kept(_load_folder(path, cfg.split), cfg)
    if source.startswith((".", "/", "~")) or Path(source).suffix in (*FILE_BUILDERS, ".txt"):
        raise AssayError(f"dataset file {source!r} not found")
    return _kept(_load_hub(cfg), cfg)


def _kept(dataset: Any, cfg: DataConfig) -> Table:
    """The columns of a `datasets.Dataset` a run reads, after checking that it has them."""
    needed = [*_text_columns(cfg), *([cfg.filter_column] if cfg.filter_column else [])]
    _require_columns(dataset, needed, cfg.dataset)
    return Table.from_dataset(dataset, needed)


def _datasets() -> Any:
    import datasets  # lazy: ~0.4 s and 90 MB; JSON-lines files never need it

    datasets.disable_progress_bars()
    return datasets


def _load_file(path: Path, cfg: DataConfig) -> Table:
    if path.stat().st_size == 0:
        raise AssayError(f"dataset file {path} is empty")
    if path.suffix == ".jsonl":
        return Table.from_jsonl(path)
    if path.suffix == ".txt":
        text = _datasets().load_dataset("text", data_files=str(path), split="train", sample_by="paragraph")
        return _kept(text, cfg)
    builder = FILE_BUILDERS.get(path.suffix)
    if builder is None:
        raise AssayError(f"{path}: unsupported file type; use .jsonl, .json, .parquet, .csv or .txt")
    try:
        loaded = _datasets().load_dataset(builder, data_files=str(path), split="train")
    except Exception as e:  # datasets raises many types for malformed files
        raise AssayError(f"could not read {path}: {first_line(e)}") from None
    return _kept(loaded, cfg)


def _load_folder(path: Path, split: str) -> Any:
    datasets = _datasets()
    try:
        loaded = datasets.load_from_disk(str(path))
    except FileNotFoundError:
        raise AssayError(f"{path} is not a saved Hugging Face dataset folder") from None
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise AssayError(f"{path} has splits {', '.join(loaded)}, not {split!r}")
        return loaded[split]
    return loaded


def _load_hub(cfg: DataConfig) -> Any:
    try:
        return _datasets().load_dataset(cfg.dataset, cfg.subset, split=cfg.split)
    except Exception as e:
        raise AssayError(
            f"dataset {cfg.dataset!r} is not a file, a folder, a bundled alias "
            f"({', '.join(corpora.BUNDLED)}) or a reachable hub dataset "
            f"({type(e).__name__}: {first_line(e)})"
        ) from None


@dataclass
class Examples:
    """Tokenized examples, stored flat. Token j is a training target when j >= loss_start, or,
    where there is a loss mask (conversations: the assistant's turns), where the mask is set."""

    ids: np.ndarray  # [N] int64: row index in the source split
    offsets: np.ndarray  # [N+1] int64: example i is tokens[offsets[i]:offsets[i+1]]
    tokens: np.ndarray  # [total] int32
    loss_start: np.ndarray  # [N] int64: first position whose token carries loss (>= 1)
    loss_mask: np.ndarray | None = None  # [total] bool: which tokens carry loss (None: from loss_start)
    cut: tuple[int, int] = (0, 0)  # at tokenization: (examples cut to max_length, tokens they lost)

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def tokens_of(self, i: int) -> np.ndarray:
        return self.tokens[self.offsets[i] : self.offsets[i + 1]]

    def targets_of(self, i: int) -> np.ndarray:
        """[L] bool: which tokens of example i carry loss."""
        if self.loss_mask is not None:
            return self.loss_mask[self.offsets[i] : self.offsets[i + 1]]
        return np.arange(self.lengths[i]) >= self.loss_start[i]

    def num_loss_tokens(self) -> np.ndarray:
        """[N] how many targets of each example carry loss."""
        if self.loss_mask is not None:
            running = np.concatenate([[0], np.cumsum(self.loss_mask, dtype=np.int64)])
            return running[self.offsets[1:]] - running[self.offsets[:-1]]
        return np.maximum(self.lengths - self.loss_start, 0)

    def subset(self, positions: np.ndarray | list[int]) -> Examples:
        """The examples at these positions (not ids), in this order."""
        pos = np.asarray(positions, dtype=np.int64)
        return Examples.concatenate([self], [pos])

    @classmethod
    def concatenate(cls, parts: list[Examples], picks: list[np.ndarray] | None = None) -> Examples:
        """One Examples holding the parts' examples in order (with `picks`, those at part k's
        positions picks[k]); ids are kept as they are."""
        picks = picks if picks is not None else [np.arange(len(p)) for p in parts]
        pieces = [(part, int(i)) for part, pos in zip(parts, picks) for i in pos]
        lengths = np.array([part.lengths[i] for part, i in pieces], dtype=np.int64)
        masked = any(part.loss_mask is not None for part in parts)
        return cls(
            ids=_joined([part.ids[pos] for part, pos in zip(parts, picks)], np.int64),
            offsets=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
            tokens=_joined([part.tokens_of(i) for part, i in pieces], np.int32),
            loss_start=_joined([part.loss_start[pos] for part, pos in zip(parts, picks)], np.int64),
            loss_mask=_joined([part.targets_of(i) for part, i in pieces], np.bool_) if masked else None,
        )

    def positions_of(self, ids: np.ndarray | list[int]) -> np.ndarray:
        """Positions of the given example ids."""
        where = {int(v): i for i, v in enumerate(self.ids)}
        try:
            return np.array([where[int(v)] for v in ids], dtype=np.int64)
        except KeyError as e:
            raise AssayError(f"example id {e.args[0]} is not in this dataset") from None

    def save(self, path: Path) -> None:
        tmp = path.with_name(path.name + ".tmp.npz")
        arrays = {
            "ids": self.ids,
            "offsets": self.offsets,
            "tokens": self.tokens,
            "loss_start": self.loss_start,
        }
        if self.loss_mask is not None:
            arrays["loss_mask"] = self.loss_mask
        arrays["cut"] = np.asarray(self.cut, dtype=np.int64)
        np.savez(tmp, **arrays)  # type: ignore[arg-type]  # numpy's stub types one keyword as `allow_pickle`
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: Path) -> Examples:
        with np.load(path, allow_pickle=False) as f:
            mask = f["loss_mask"] if "loss_mask" in f.files else None
            cut = tuple(int(v) for v in f["cut"]) if "cut" in f.files else (0, 0)
            return cls(f["ids"], f["offsets"], f["tokens"], f["loss_start"], mask, (cut[0], cut[1]))


def _joined(arrays: list[np.ndarray], dtype: Any) -> np.ndarray:
    return np.concatenate([np.zeros(0, dtype), *arrays]).astype(dtype)


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """A short hash identifying a tokenizer's vocabulary and rules.

    Truncation and padding are left out: they are per-call state that every `tokenizer(...)`
    call rewrites in the backend, so including them made the hash depend on whether the
    tokenizer had been called yet (e.g. on a tokenization cache hit).
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return hashlib.sha256(json.dumps(tokenizer.get_vocab(), sort_keys=True).encode()).hexdigest()[:16]
    raw = backend.to_str()
    known = _TOKENIZER_FINGERPRINTS.get(tokenizer)
    if known is not None and known[0] == raw:  # unchanged since the last call: parsing 1.5 MB
        return known[1]  # of JSON (a 49k vocabulary) again costs 0.2 s
    spec = json.loads(raw)
    spec.pop("truncation", None), spec.pop("padding", None)
    digest = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]
    _TOKENIZER_FINGERPRINTS[tokenizer] = (raw, digest)
    return digest


_TOKENIZER_FINGERPRINTS: weakref.WeakKeyDictionary[Any, tuple[str, str]] = weakref.WeakKeyDictionary()
"""tokenizer -> (its backend's serialized state, fingerprint) of the last call on it."""


def tokenize(table: Table, cfg: DataConfig, tokenizer: Any) -> Examples:
    """Tokenize every row once (cached by dataset, tokenizer and options)."""
    key = json.dumps(
        [
            TOKENIZE_VERSION,
            table.fingerprint,
            tokenizer_fingerprint(tokenizer),
            cfg.text_column,
            cfg.prompt_column,
            cfg.completion_column,
            cfg.max_length,
            len(table),
            *(
                [CHAT_VERSION, cfg.conversation_column, tokenizer.chat_template]
                if cfg.conversation_column
                else ()
            ),
        ]
    )
    path = cache_dir() / "tokenized" / (hashlib.sha256(key.encode()).hexdigest()[:24] + ".npz")
    if path.exists():
        return Examples.load(path)
    examples = _tokenize_rows(table, cfg, tokenizer)
    path.parent.mkdir(parents=True, exist_ok=True)
    examples.save(path)
    return examples


def _tokenize_rows(table: Table, cfg: DataConfig, tokenizer: Any) -> Examples:
    if cfg.conversation_column:
        return _tokenize_conversations(table, cfg, tokenizer)
    eos = tokenizer.eos_token_id

    def encode(column: str, special: bool) -> list[list[int]]:
        _require_text(table, column, cfg.dataset)
        # verbose=False: we truncate ourselves, so "longer than the maximum length" is noise
        return tokenizer(list(table[column]), add_special_tokens=special, verbose=False)["input_ids"]

    if cfg.prompt_column and cfg.completion_column:
        prompts, completions = encode(cfg.prompt_column, True), encode(cfg.completion_column, False)
    else:
        prompts, completions = [[] for _ in range(len(table))], encode(cfg.text_column, True)
    pieces, starts, lost = [], [], []
    for p, c in zip(prompts, completions):
        seq = list(p) + list(c) + ([eos] if eos is not None and (not c or c[-1] != eos) else [])
        pieces.append(np.asarray(seq[: cfg.max_length], dtype=np.int32))
        lost.append(len(seq) - len(pieces[-1]))
        starts.append(max(len(p), 1))
    lengths = np.array([len(s) for s in pieces], dtype=np.int64)
    return Examples(
        ids=np.asarray(table[ID_COLUMN], dtype=np.int64),
        offsets=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
        tokens=np.concatenate(pieces) if pieces else np.zeros(0, np.int32),
        loss_start=np.asarray(starts, dtype=np.int64),
        cut=_cut(lost),
    )


def _cut(lost: list[int]) -> tuple[int, int]:
    """(examples that lost tokens to --max_length, tokens lost)."""
    return sum(n > 0 for n in lost), sum(lost)


def _tokenize_conversations(table: Table, cfg: DataConfig, tokenizer: Any) -> Examples:
    """Each row's conversation through the chat template, the loss on the assistant's turns."""
    assert cfg.conversation_column is not None
    ids = [int(i) for i in table[ID_COLUMN]]
    tokens, masks = tokenize_conversations(table[cfg.conversation_column], ids, tokenizer, cfg.dataset)
    lost = [max(len(t) - cfg.max_length, 0) for t in tokens]
    tokens, masks = [t[: cfg.max_length] for t in tokens], [m[: cfg.max_length] for m in masks]
    lengths = np.array([len(t) for t in tokens], dtype=np.int64)
    firsts = [int(np.argmax(m)) if m.any() else len(m) for m in masks]
    return Examples(
        ids=np.asarray(ids, dtype=np.int64),
        offsets=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
        tokens=np.concatenate(tokens) if tokens else np.zeros(0, np.int32),
        loss_start=np.maximum(np.asarray(firsts, dtype=np.int64), 1),
        loss_mask=np.concatenate(masks) if masks else np.zeros(0, bool),
        cut=_cut(lost),
    )


def _require_text(table: Table, column: str, name: str) -> None:
    """Every value of `column` a string, else one line naming the first row that is not."""
    for row, value in enumerate(table[column]):
        if not isinstance(value, str):
            what = "missing (null)" if value is None else f"a {type(value).__name__}, not text"
            source_id = table[ID_COLUMN][row] if ID_COLUMN in table.column_names else row
            raise AssayError(
                f"dataset {name!r}: row {source_id} has no text in column {column!r} ({what}); "
                "fix or drop that row"
            )


def examples_fingerprint(*sets: Examples | None) -> str:
    """A hash of exactly what a run reads of its data: every example's id, tokens (offsets
    included) and first loss position, for each set in order (None counts as a set too)."""
    h = hashlib.sha256()
    for examples in sets:
        h.update(b"none" if examples is None else b"set")
        if examples is None:
            continue
        arrays = [examples.ids, examples.offsets, examples.tokens, examples.loss_start]
        for arr in arrays + ([] if examples.loss_mask is None else [examples.loss_mask]):
            data = np.ascontiguousarray(arr)
            h.update(f"{data.dtype}{data.shape}".encode())
            h.update(data.tobytes())
    return h.hexdigest()[:16]


def example_hashes(examples: Examples) -> np.ndarray:
    """[N] uint64: a hash of what decides each example's gradient row, its tokens and which of them
    carry loss (not its id), so the same example read from another file or split hashes alike."""
    out = np.empty(len(examples), dtype=np.uint64)
    for i in range(len(examples)):
        h = hashlib.blake2b(digest_size=8)
        h.update(np.ascontiguousarray(examples.tokens_of(i), dtype=np.int64).tobytes())
        h.update(np.packbits(examples.targets_of(i)).tobytes())
        out[i] = int.from_bytes(h.digest(), "little")
    return out


def load_examples(cfg: DataConfig, tokenizer: Any) -> tuple[Table, Examples]:
    """The table (for texts and metadata) and its tokenized examples, row for row."""
    table = load_table(cfg)
    examples = tokenize(table, cfg, tokenizer)
    if int(examples.num_loss_tokens().sum()) == 0:
        raise AssayError(f"dataset {cfg.dataset!r}: no tokens carry loss (empty texts or completions?)")
    note_cut(examples, f"{cfg.dataset}:{cfg.split}", cfg.max_length)
    return table, examples


def note_cut(examples: Examples, what: str, max_length: int) -> None:
    """Say how much of `what` --max_length cut off: nothing of a dataset is dropped without a word."""
    cut, lost = examples.cut
    if cut:
        share = lost / (lost + len(examples.tokens))
        note(
            f"{what}: {cut:,} of {len(examples):,} examples are longer than --max_length {max_length} and "
            f"were cut, losing {lost:,} tokens ({share:.1%} of the whole)"
        )


def bucket_length(n: int, multiple: int = 16) -> int:
    """Round a padded length up to few distinct shapes: CPU kernels set up per shape."""
    if n <= 64:
        return -(-n // multiple) * multiple
    step = 1 << max(n.bit_length() - 3, 4)  # four buckets per power of two
    return -(-n // step) * step


def token_batches(examples: Examples, token_batch_size: int, sort: bool = True) -> list[np.ndarray]:
    """Group example positions so each padded batch holds at most `token_batch_size` tokens.

    Sorting by length keeps padding small; an example longer than the budget gets a batch
    of its own. Batches come out in a deterministic order.
    """
    lengths = examples.lengths
    order = np.argsort(-lengths, kind="stable") if sort else np.arange(len(lengths))
    batches: list[np.ndarray] = []
    current: list[int] = []
    width = 0
    for pos in order:
        new_width = max(width, bucket_length(int(lengths[pos])))
        if current and new_width * (len(current) + 1) > token_batch_size:
            batches.append(np.asarray(current, dtype=np.int64))
            current, new_width = [], bucket_length(int(lengths[pos]))
        current.append(int(pos))
        width = new_width
    if current:
        batches.append(np.asarray(current, dtype=np.int64))
    return batches


def collate(
    examples: Examples,
    positions: np.ndarray,
    pad_id: int,
    device: torch.device | str = "cpu",
    pad_to: int | None = None,
) -> dict[str, torch.Tensor]:
    """Right-padded `input_ids`, `attention_mask` and `labels` (-100 where no loss)."""
    lengths = [int(examples.lengths[p]) for p in positions]
    width = pad_to or bucket_length(max(lengths))
    ids = torch.full((len(positions), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(positions), width), dtype=torch.long)
    labels = torch.full((len(positions), width), -100, dtype=torch.long)
    for row, pos in enumerate(positions):
        toks = torch.from_numpy(examples.tokens_of(int(pos)).astype(np.int64))
        n = len(toks)
        ids[row, :n] = toks
        mask[row, :n] = 1
        labels[row, :n] = toks.masked_fill(~torch.from_numpy(examples.targets_of(int(pos))), -100)
    return {"input_ids": ids.to(device), "attention_mask": mask.to(device), "labels": labels.to(device)}


def texts_of(table: Table, cfg: DataConfig) -> list[str]:
    """The readable text of each row (prompt + completion when those columns are used, a
    conversation's messages one per line)."""
    if cfg.conversation_column:
        return [conversation_text(v) for v in table[cfg.conversation_column]]
    if cfg.prompt_column and cfg.completion_column:
        return [f"{p}{c}" for p, c in zip(table[cfg.prompt_column], table[cfg.completion_column])]
    return [str(t) for t in table[cfg.text_column]]
