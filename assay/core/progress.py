"""Progress bars that show throughput in tokens/s as well as examples/s."""

from __future__ import annotations

import sys
import time
from typing import Any


class Progress:
    """A tqdm bar over examples that also reports tokens/s. Silent when `enabled` is false."""

    def __init__(self, total: int, desc: str, enabled: bool = True, initial: int = 0):
        from tqdm.auto import tqdm

        self.bar: Any = tqdm(
            total=total,
            desc=desc,
            unit="ex",
            initial=initial,
            file=sys.stderr,
            disable=not enabled,
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

    def close(self) -> None:
        self.bar.close()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
