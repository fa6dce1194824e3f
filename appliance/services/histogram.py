"""A Prometheus histogram kept in memory: cumulative bucket counts, sum and count."""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence


class Histogram:
    """Observations counted into fixed upper bounds (`le`), as Prometheus exposes them."""

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(sorted(bounds))
        self._counts = [0] * (len(self.bounds) + 1)  # the last one: above every bound
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self._counts[bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def lines(self, name: str, help_text: str) -> list[str]:
        """The histogram in Prometheus text format."""
        out = [f"# HELP {name} {help_text}", f"# TYPE {name} histogram"]
        running = 0
        for bound, n in zip(self.bounds, self._counts, strict=False):
            running += n
            out.append(f'{name}_bucket{{le="{bound:g}"}} {running}')
        out += [
            f'{name}_bucket{{le="+Inf"}} {self.count}',
            f"{name}_sum {self.sum:.6f}",
            f"{name}_count {self.count}",
        ]
        return out
