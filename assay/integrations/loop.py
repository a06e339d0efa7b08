"""`record_gradients`: the per-example gradients of a plain training loop's step, as an index.

    for step, batch in enumerate(loader):
        chosen = step in (100, 200)
        with record_gradients(f"grads/step-{step}", model, tokenizer, optimizer) if chosen else nullcontext():
            model(**batch).loss.backward()        # input_ids=, attention_mask=, labels= by keyword
        optimizer.step(); optimizer.zero_grad()

Every training forward (model in train mode, called with `labels=`) and the backward of its own
loss inside the block become rows of the index in OUT, taken at the weights the block began with
(copied into OUT/model), normalized by the optimizer's second moments at that moment.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from assay.attribution.live import LiveConfig, StepRecorder
from assay.core.config import PrecisionName


@contextmanager
def record_gradients(
    out: str | Path,
    model: Any,
    tokenizer: Any,
    optimizer: Any = None,
    config: LiveConfig | None = None,
    precision: PrecisionName = "fp32",
) -> Iterator[StepRecorder]:
    """Record the block's training forwards and backwards as the index OUT (module docstring).

    `precision`: the loop's own mixed precision (bf16 or fp16 autocast, else fp32), recorded so
    that `assay score` computes the queries' gradients alike. Nothing is written if the block
    fails or runs no training forward; the loop itself is never changed.
    """
    recorder = StepRecorder(out, config or LiveConfig(), model, tokenizer, precision)
    recorder.begin(optimizer)
    try:
        yield recorder
    except BaseException:
        recorder.abandon()
        raise
    recorder.end()
