"""A one-line progress bar on stderr (no dependency): `label [#####-----] 50% 600/1200 3.1 s`."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator
from typing import TextIO, TypeVar

T = TypeVar("T")


class ProgressBar:
    def __init__(
        self, label: str, total: int, *, stream: TextIO | None = None, width: int = 30
    ) -> None:
        self.label = label
        self.total = max(total, 1)
        self.stream = stream or sys.stderr
        self.width = width
        self.done = 0
        self._t0 = time.perf_counter()
        self._last = 0.0

    def update(self, n: int = 1) -> None:
        self.done += n
        now = time.perf_counter()
        if now - self._last >= 0.2 or self.done >= self.total:
            self._last = now
            self._draw(now)

    def _draw(self, now: float) -> None:
        frac = min(self.done / self.total, 1.0)
        bar = "#" * round(frac * self.width)
        self.stream.write(
            f"\r{self.label:<20} [{bar:<{self.width}}] {frac:4.0%} "
            f"{self.done}/{self.total} {now - self._t0:6.1f} s"
        )
        self.stream.flush()

    def close(self) -> None:
        self._draw(time.perf_counter())
        self.stream.write("\n")
        self.stream.flush()

    def wrap(self, items: Iterable[T]) -> Iterator[T]:
        for item in items:
            yield item
            self.update()
