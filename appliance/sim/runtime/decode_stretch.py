"""A run of plain decode steps that touch no block, on the virtual driver's heap as one
event (`virtual.replay`'s fast path; the steps are `sim/core/decode_run.py`'s quiet steps).

Model of the world: an engine with nothing to do but decode, and no request of its batch
near a block edge or its end, runs the same step again and again; nothing it does is seen
by anyone until its outputs are handed over. So the driver plans the k such steps ahead
at once (`SimEngine.decode_stretch`) and runs none of them until someone may look: at the
stretch's end (every step ran and ended), or at an arrival, a timer or a finish anywhere,
at `t` (the stretch is cut): then the steps that started before `t` run (the first always:
it started when the stretch began), those that ended are held, and the one under way ends
at its own end as a single plain decode step. Step j starts at `starts[j]`: the stretch's
start plus the durations before it, added one by one as the driver adds them, so every
step starts and ends at the time it would have alone, to the bit.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass
from itertools import accumulate


@dataclass(frozen=True, slots=True)
class DecodeStretch:
    """The quiet steps ahead of one engine, planned at `starts[0]`."""

    durations: list[float]
    starts: list[float]
    """Each step's start, and last the end of the last one."""
    seq: int
    """Its event's sequence number on the driver's heap."""

    @classmethod
    def plan(cls, now: float, durations: list[float], seq: int) -> DecodeStretch:
        return cls(durations, list(accumulate(durations, initial=now)), seq)

    @property
    def end_s(self) -> float:
        return self.starts[-1]

    def started_by(self, t: float) -> int:
        """How many of its steps have started before `t` (the first always has)."""
        return bisect_left(self.starts, t, 1, len(self.durations))
