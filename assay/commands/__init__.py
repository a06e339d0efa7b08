"""One module per CLI command, each exposing `Config` (its typed config; the dataclass fields are
the flags and their docstrings the `--help`) and `run(cfg)` (the library call plus what the user
sees on the console). The table of commands is `COMMANDS`; modules load only when run."""

from __future__ import annotations

from dataclasses import dataclass

PRELOAD_LM = (
    "transformers.modeling_utils",
    "transformers.models.auto.modeling_auto",
    "transformers.models.auto.tokenization_auto",
)


@dataclass(frozen=True)
class Command:
    """A CLI command: the module under assay.commands that holds its Config and run."""

    module: str
    summary: str
    libraries: tuple[str, ...] = PRELOAD_LM
    """Modules `assay` imports ahead of the run (the model and data libraries it uses)."""

    @property
    def path(self) -> str:
        return f"assay.commands.{self.module}"


COMMANDS: dict[str, Command] = {
    "eval": Command("eval", "Per-example and mean loss of a model on a dataset."),
    "build": Command(
        "build", "Per-example projected loss gradients of a dataset, streamed to an on-disk index."
    ),
    "score": Command(
        "score", "Attribute queries to the training examples of an index (TrackStar and other modes)."
    ),
    "finetune": Command(
        "finetune", "Fine-tune a causal LM (full or LoRA) on a dataset or a selected subset."
    ),
    "filter": Command(
        "filter", "Select training examples by a strategy (random, loss, gradient scores, coverage)."
    ),
    "coreset": Command(
        "coreset", "Data selection proven by retraining: each strategy vs random vs full data."
    ),
    "validate": Command(
        "validate", "LDS of attribution methods on your fine-tune: retrain on random subsets, compare."
    ),
    "sae train": Command(
        "sae_train",
        "Train SAEs or transcoders on a model's activations, several from one pass (fp32 or bf16 autocast).",
    ),
    "sae eval": Command(
        "sae_eval", "Reconstruction and splice metrics (CE loss score, KL) of an SAE in SAELens format."
    ),
    "report": Command(
        "report",
        "One self-contained HTML report (charts, top examples, SAE feature browser) of run folders.",
        (),
    ),
    "demo": Command("demo", "The main job on the bundled defaults: real data, a real small model."),
}
