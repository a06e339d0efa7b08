"""Shared pieces of every command's config. Pure data: validation only, no side effects.

Each command's config nests these (flags appear without a prefix: `--model`, `--dataset`,
`--precision`), so a flag means the same thing in every command.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

PrecisionName = Literal["auto", "fp32", "bf16", "fp16", "bf16-pure"]


@dataclass
class ModelConfig:
    """Which language model to load, and how."""

    model: str = "assay-tiny"
    """A local Hugging Face model folder, a hub id, a PEFT adapter folder, or an alias:
    `assay-tiny` (bundled ~4M-parameter Llama) or `smollm2-135m` (real SmolLM2-135M, offline)."""
    tokenizer: str | None = None
    """Tokenizer folder or hub id, when it differs from the model's."""
    lora_rank: int = 0
    """Attach a fresh LoRA adapter of this rank (0: none)."""
    lora_alpha: int = 16
    """LoRA scaling numerator (the update is scaled by alpha / rank)."""
    lora_modules: tuple[str, ...] = ()
    """Module names LoRA attaches to (default: every attention and MLP projection)."""
    trust_remote_code: bool = False
    """Run code shipped with a hub model. Off unless you trust its source."""

    def __post_init__(self) -> None:
        from assay.core.errors import AssayError

        if self.lora_rank < 0:
            raise AssayError(f"--lora_rank must be >= 0, got {self.lora_rank}")


@dataclass
class DataConfig:
    """Which texts to use, and how to cut them into examples."""

    dataset: str = "abc-tunes"
    """A local .jsonl/.json/.parquet/.csv/.txt file, a saved Hugging Face dataset folder,
    a hub dataset name, or a bundled alias: `abc-tunes` (real folk tunes in ABC notation)
    or `shakespeare`."""
    split: str = "train"
    """Which split to read (bundled datasets have `train` and `eval`)."""
    subset: str | None = None
    """Hub dataset configuration name, if the dataset has several."""
    text_column: str = "text"
    """Column holding the text (ignored when --prompt_column is given)."""
    prompt_column: str | None = None
    """Column holding a prompt (with --completion_column); only the completion's tokens carry loss."""
    completion_column: str | None = None
    """Column holding the completion (with --prompt_column)."""
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
        from assay.core.errors import AssayError

        if (self.prompt_column is None) != (self.completion_column is None):
            raise AssayError("--prompt_column and --completion_column go together")
        if self.max_samples is not None and self.max_samples <= 0:
            raise AssayError(f"--max_samples must be positive, got {self.max_samples}")
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
    """CPU threads for torch (0: torch's default)."""
    attention: Literal["auto", "sdpa", "eager"] = "auto"
    """Attention kernel; `eager` avoids fused kernels whose result can depend on batch
    composition under bf16."""


@dataclass
class QueryConfig:
    """Which texts are the queries: `assay score`, `filter`, `coreset` and `validate` read them alike.

    Queries are cut to the length the training examples they are compared with were cut to."""

    query_dataset: str | None = None
    """Dataset of queries (same forms as --dataset: a file, a folder, `abc-tunes`, ...)."""
    query_split: str = "eval"
    """Split of the query dataset."""
    query_text_column: str = "text"
    """Column holding the query text."""
    query_prompt_column: str | None = None
    """Column holding a prompt; then only the completion's tokens carry the query's loss."""
    query_completion_column: str | None = None
    """Column holding the completion (with --query_prompt_column)."""
    query_max_samples: int | None = None
    """Use only the first N queries (after filtering)."""
    query_filter_column: str | None = None
    """Keep only query rows whose column equals --query_filter_value (e.g. collection)."""
    query_filter_value: str | None = None
    """Value --query_filter_column must equal (e.g. oneill)."""
    query_text: tuple[str, ...] = ()
    """Ad-hoc query texts (`--query_text TEXT [TEXT ...]`), used along with --query_dataset."""

    def __post_init__(self) -> None:
        from assay.core.errors import AssayError

        if any(not text.strip() for text in self.query_text):
            raise AssayError("a --query_text is empty; give the text to attribute")
        if (self.query_filter_column is None) != (self.query_filter_value is None):
            raise AssayError("--query_filter_column and --query_filter_value go together")
        if (self.query_prompt_column is None) != (self.query_completion_column is None):
            raise AssayError("--query_prompt_column and --query_completion_column go together")
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
        return DataConfig(
            dataset=self.query_dataset,
            split=self.query_split,
            text_column=self.query_text_column,
            prompt_column=self.query_prompt_column,
            completion_column=self.query_completion_column,
            max_samples=self.query_max_samples,
            max_length=max_length,
            filter_column=self.query_filter_column,
            filter_value=self.query_filter_value,
        )
