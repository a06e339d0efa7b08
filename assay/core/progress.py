"""Progress bars that show throughput in tokens/s as well as examples/s."""

from __future__ import annotations

import sys
import time
from typing import Any


class Progress:
    """A tqdm bar over examples (or `unit`s) that also reports tokens/s when told tokens.
    Silent when `enabled` is false, or when notes are switched off (--quiet; see console.quiet)."""

    def __init__(self, total: int, desc: str, enabled: bool = True, initial: int = 0, unit: str = "ex"):
        from tqdm.auto import tqdm  # lazy: keeps the CLI start light

        from assay.core.console import quiet  # lazy: console imports progress users

        self.bar: Any = tqdm(
            total=total,
            desc=desc,
            unit=unit,
            unit_scale=unit != "ex",
            initial=initial,
            file=sys.stderr,
            disable=not enabled or quiet(),
            dynamic_ncols=True,
            mininterval=1.0,
        )
        self.tokens = 0
        self.start = time.perf_counter()

    def update(self, examples: int, tokens: int, **postfix: Any) -> None:
        self.tokens += tokens
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        self.bar.set_postfix(tok_s=f"{self.tokens / elapsed:,.0f}", **postfix, refresh=False)
        self.bar.update(examples)

    def set_done(self, done: int) -> None:
        """Move the bar to `done` units (for loops that report a running total)."""
        self.bar.update(done - self.bar.n)

    def close(self) -> None:
        self.bar.close()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
