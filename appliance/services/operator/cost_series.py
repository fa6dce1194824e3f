"""Cost per successful task over time, for the console's chart: a bounded in-memory series.

Model of the world: time is cut into windows of `window_s` seconds (aligned to the Unix
epoch, so every reader sees the same boundaries). Each point holds the figure for all the
tasks this run has seen as it stood at the last observation inside its window: the overall
cost per successful task (all attempted cost and the overhead spread over it / root tasks
that succeeded verified; None before the first success) and the number of successes so far.
Observations come with every state snapshot; a window in which nobody asked for one has no
point. The series keeps the newest `max_points` windows; the ledger, not this series, is
the history.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

DEFAULT_WINDOW_S = 10.0
DEFAULT_MAX_POINTS = 360
"""An hour of 10 s windows."""


@dataclass(frozen=True, slots=True)
class CostPoint:
    window_start: float
    cost_per_success: float | None
    succeeded: int


def overall(groups: Iterable[Mapping[str, Any]]) -> tuple[float | None, int]:
    """(cost per success, successes) over report rows that split the root tasks into
    groups: the groups' total costs (direct and overhead) summed over their successes
    summed."""
    cost, succeeded = 0.0, 0
    for g in groups:
        total = g.get("total_cost")
        cost += (total if total is not None else g.get("cost")) or 0.0
        succeeded += int(g.get("succeeded") or 0)
    return (cost / succeeded if succeeded else None), succeeded


class CostSeries:
    def __init__(
        self, window_s: float = DEFAULT_WINDOW_S, max_points: int = DEFAULT_MAX_POINTS
    ) -> None:
        if window_s <= 0 or max_points < 1:
            raise ValueError("a cost series needs window_s > 0 and max_points >= 1")
        self.window_s = window_s
        self._points: deque[CostPoint] = deque(maxlen=max_points)

    def observe(self, now: float, cost_per_success: float | None, succeeded: int) -> None:
        start = now - now % self.window_s
        point = CostPoint(start, cost_per_success, succeeded)
        if self._points and self._points[-1].window_start == start:
            self._points[-1] = point
        elif not self._points or self._points[-1].window_start < start:
            self._points.append(point)
        # An observation older than the newest window (a clock step back) is dropped.

    def points(self) -> list[dict[str, Any]]:
        """Oldest first, as JSON-ready dicts."""
        return [asdict(p) for p in self._points]

    def __len__(self) -> int:
        return len(self._points)
