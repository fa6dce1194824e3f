"""The reports' percentile: nearest rank, the value at rank int(q * n) of the sorted values.

One definition for the replay's report and the live benchmark's, so that their figures are
read alike (a live p95 set beside the replay's it is checked against).
"""

from __future__ import annotations

from collections.abc import Sequence


def nearest_rank(values: Sequence[float], q: float) -> float | None:
    """The `q` (0..1) percentile of `values`; None when there are none."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(percentile_rank(q, len(ordered)), len(ordered) - 1)]


def percentile_rank(q: float, n: int) -> int:
    """The rank (from 0, ascending) whose value is the `q` percentile of `n` values."""
    return int(q * n)
