"""What the ledger stores of the box itself: its usage periods (`usage_periods` and
`worker_usage`), the time and energy no turn row holds.

A usage period is a span of wall-clock time the router ran, [started_at, ended_at), and for
each worker the GPU-seconds it was awake in it, of them those with an attempt in flight
(busy), and the joules its GPUs drew. Plain frozen values, stdlib only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from appliance.domain.records import PriceId, WorkerId

JOULES_PER_KWH = 3_600_000.0


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


@dataclass(frozen=True, slots=True)
class WorkerUsage:
    worker: WorkerId
    gpus: int
    awake_s: float
    """GPU-seconds awake in the period (its GPUs times the seconds it was not asleep or
    stopped); a wake counts as awake."""
    busy_s: float
    """Of `awake_s`, those with an attempt in flight: what its turns' gpu_s add up to."""
    energy_j: float | None = None
    """Joules its GPUs drew in the period, asleep or awake; None: no power reading."""

    def __post_init__(self) -> None:
        values = (self.awake_s, self.busy_s, self.energy_j or 0.0)
        _require(all(math.isfinite(v) and v >= 0 for v in values), "usage cannot be negative")
        _require(self.gpus >= 0, "a worker has 0 GPUs or more")

    @property
    def idle_s(self) -> float:
        """GPU-seconds awake with nothing in flight."""
        return max(0.0, self.awake_s - self.busy_s)


@dataclass(frozen=True, slots=True)
class UsagePeriod:
    started_at: float
    ended_at: float
    workers: tuple[WorkerUsage, ...] = ()

    def __post_init__(self) -> None:
        _require(self.ended_at >= self.started_at, "a usage period cannot end before it starts")

    @property
    def seconds(self) -> float:
        return self.ended_at - self.started_at


@dataclass(frozen=True, slots=True)
class PeriodCost:
    """A usage period priced (policy/overhead.py `price_period`): its overhead in parts."""

    idle: float = 0.0
    """Its idle awake GPU-seconds at the GPU-second price."""
    energy: float = 0.0
    """Its joules at the energy price."""
    box: float = 0.0
    """Its seconds at the box's price per hour."""
    price_id: PriceId | None = None
    by_worker: tuple[tuple[float, float], ...] = ()
    """(idle, energy) of each of the period's workers, in its order."""

    @property
    def total(self) -> float:
        return self.idle + self.energy + self.box
