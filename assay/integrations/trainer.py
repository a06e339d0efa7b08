"""`GradientCallback`: the per-example gradients of the batches a Hugging Face `Trainer` computes,
as an index per chosen step (by default each step that follows a checkpoint: an index per
checkpoint), at the weights of that step and with the optimizer's live second moments.

    trainer = Trainer(..., processing_class=tokenizer, callbacks=[GradientCallback("grads")])
    trainer.train()        # grads/step-N for each checkpoint-N; then: assay score --index grads/step-N

The rows of step N are taken during that step's own forwards and backwards (every micro-batch of
its gradient accumulation), so they cost the hooks' projections, not another pass; the step's
weights are the trainer's `checkpoint-N` (a copy is kept in the index: checkpoints get rotated).
Under torchrun (data parallel) every rank records its own micro-batches and rank 0 writes the one
index of the step's whole global batch.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from assay.attribution.live import LiveConfig, StepRecorder, precision_of
from assay.core.errors import AssayError


class GradientCallback(TrainerCallback):
    """Writes OUT/step-N, an index of the examples trained at optimizer step N (global_step N when
    the step begins), for each N in `steps` (None: each step right after a checkpoint is saved)."""

    def __init__(self, out: str | Path, steps: Iterable[int] | None = None, config: LiveConfig | None = None):
        self.out = Path(out)
        self.steps = None if steps is None else {int(s) for s in steps}
        self.config = config or LiveConfig()
        self.written: list[Path] = []
        """The indexes written so far, in order."""
        self._saved: set[int] = set()
        self._recorder: StepRecorder | None = None
        if self.steps is not None and self.config.normalizer != "none" and 0 in self.steps:
            raise AssayError(
                "step 0 has no optimizer second moments yet: choose steps >= 1 or normalizer none"
            )

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if args.fsdp or args.deepspeed:
            raise AssayError(
                "GradientCallback needs the whole model on every rank: data parallelism (torchrun) works, "
                "FSDP and DeepSpeed do not yet"
            )
        if args.gradient_checkpointing:
            raise AssayError(
                "GradientCallback needs each layer's forward once: turn gradient checkpointing off"
            )
        if self.steps is None and args.save_strategy == "no":
            raise AssayError(
                "GradientCallback(steps=None) follows the checkpoints, and this Trainer saves none"
            )

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._saved.add(state.global_step)

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        step = state.global_step
        if step not in (self.steps if self.steps is not None else self._saved):
            return
        precision = precision_of(bool(args.bf16), bool(args.fp16))
        recorder = StepRecorder(
            self.out / f"step-{step}", self.config, kwargs["model"], kwargs.get("processing_class"), precision
        )
        recorder.begin(kwargs.get("optimizer"))
        self._recorder = recorder

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # every micro-batch's backward is done and the weights are still the step's
        recorder, self._recorder = self._recorder, None
        if recorder is not None and (path := recorder.end()) is not None:
            self.written.append(path)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._recorder is not None:  # training stopped inside a step
            self._recorder.abandon()
            self._recorder = None
