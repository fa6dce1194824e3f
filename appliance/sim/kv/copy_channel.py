"""The engine's one host -> GPU copy channel: copies run one after another, each starting
when the one before it has ended (`sim/core/engine.py`'s host loads and `prefetch_lane.py`'s
promotions queue on the same channel)."""

from __future__ import annotations


class CopyChannel:
    def __init__(self) -> None:
        self.free_s = 0.0
        """When the last queued copy ends."""

    def reserve(self, now: float, copy_s: float) -> float:
        """Queue a copy of `copy_s` seconds at `now`; returns when it ends."""
        self.free_s = max(now, self.free_s) + copy_s
        return self.free_s
