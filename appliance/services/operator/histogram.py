"""A Prometheus histogram kept in memory: cumulative bucket counts, sum and count."""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence

from prometheus_client.core import HistogramMetricFamily


class PromHistogram:
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

    def family(self, name: str, help_text: str) -> HistogramMetricFamily:
        """The histogram as a Prometheus metric family (cumulative buckets, sum, count)."""
        buckets, running = [], 0
        for bound, n in zip(self.bounds, self._counts, strict=False):
            running += n
            buckets.append((f"{bound:g}", running))
        buckets.append(("+Inf", self.count))
        return HistogramMetricFamily(name, help_text, buckets=buckets, sum_value=self.sum)
