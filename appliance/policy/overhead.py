"""The box's overhead (gpu_seconds mode) and how it is spread over the work it served.

The model of the world, in two rules:

1. A usage period (domain/usage.py: a span of the router's wall-clock time, and per worker
   its awake and busy GPU-seconds and the joules its GPUs drew) costs, in gpu_seconds mode,
       idle   = sum over workers of max(0, awake_s - busy_s) * gpu_second
       energy = sum over workers of energy_j / 3,600,000 * energy_per_kwh
       box    = (ended_at - started_at) / 3600 * box_per_hour
   at the price version in effect at its end; in tokens mode nothing (a price list per
   token is the whole price). The busy GPU-seconds are not here: the turns carry them
   (policy/costs.py rule 1), so every awake GPU-second is priced once.

2. A report's overhead is the sum of its periods' costs inside its time range, a period
   partly inside in proportion to the part inside, and it is spread over the report's
   groups in proportion to their GPU-seconds (the gpu_s of their task trees' attempts): the
   box's idle time, energy and capacity are bought for the work that uses its GPUs, so a
   group that used twice the GPU time bears twice the overhead; tool costs (bought outside
   the box) draw none, and a price change inside the range does not move the split. The
   basis is the groups' own GPU-seconds, or a larger total when the caller knows the work
   of the range went beyond the groups it shows (the state's forgotten tasks). When no
   group used a GPU-second (and no larger basis is given), each root task bears an equal
   share. A group's cost per successful task is then (direct cost + its share) / its
   verified successes.

Pure: no I/O, no clock.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from appliance.domain.records import CostMode, Price
from appliance.domain.usage import JOULES_PER_KWH, PeriodCost, UsagePeriod
from appliance.policy.costs import CostGroup

SECONDS_PER_HOUR = 3600.0


def price_period(price: Price | None, period: UsagePeriod) -> PeriodCost:
    """Rule 1: the period's overhead at `price` (None: no price in effect, nothing)."""
    if price is None or price.mode is not CostMode.GPU_SECONDS:
        none = tuple((0.0, 0.0) for _ in period.workers)
        return PeriodCost(price_id=price.price_id if price else None, by_worker=none)
    by_worker = tuple(
        (
            w.idle_s * price.gpu_second,
            (w.energy_j or 0.0) / JOULES_PER_KWH * price.energy_per_kwh,
        )
        for w in period.workers
    )
    return PeriodCost(
        idle=math.fsum(idle for idle, _ in by_worker),
        energy=math.fsum(energy for _, energy in by_worker),
        box=period.seconds / SECONDS_PER_HOUR * price.box_per_hour,
        price_id=price.price_id,
        by_worker=by_worker,
    )


@dataclass(frozen=True, slots=True)
class Overhead:
    """Overhead in parts, in the currency of the prices."""

    idle: float = 0.0
    energy: float = 0.0
    box: float = 0.0

    @property
    def total(self) -> float:
        return self.idle + self.energy + self.box

    def __add__(self, other: Overhead) -> Overhead:
        return Overhead(self.idle + other.idle, self.energy + other.energy, self.box + other.box)

    def scaled(self, factor: float) -> Overhead:
        return Overhead(self.idle * factor, self.energy * factor, self.box * factor)


@dataclass(frozen=True, slots=True)
class UsageRow:
    """One priced usage period as a report reads it."""

    started_at: float
    ended_at: float
    cost: Overhead


def overhead_in(
    rows: Iterable[UsageRow], since: float | None = None, until: float | None = None
) -> Overhead:
    """Rule 2's overhead of the range [since, until) (None: open on that side)."""
    lo = -math.inf if since is None else since
    hi = math.inf if until is None else until
    total = Overhead()
    for row in rows:
        total += row.cost.scaled(_inside(row.started_at, row.ended_at, lo, hi))
    return total


def _inside(start: float, end: float, lo: float, hi: float) -> float:
    """The share of [start, end) inside [lo, hi); an instant counts whole where it lies."""
    if end <= start:
        return 1.0 if lo <= start < hi else 0.0
    overlap = min(end, hi) - max(start, lo)
    return max(0.0, overlap) / (end - start)


def spread_overhead(
    groups: Sequence[CostGroup], overhead: Overhead, *, basis_gpu_s: float = 0.0
) -> list[CostGroup]:
    """Rule 2's spread: each group with its share of `overhead` and its cost per success
    counting it. `basis_gpu_s` is the work's GPU-seconds when more than the groups'."""
    basis = max(math.fsum(g.gpu_s for g in groups), basis_gpu_s)
    tasks = sum(g.tasks for g in groups)

    def share(g: CostGroup) -> float:
        if basis > 0:
            return g.gpu_s / basis
        return g.tasks / tasks if tasks else 0.0  # no GPU time anywhere: per root task

    return [_charged(g, overhead.scaled(share(g))) for g in groups]


def _charged(g: CostGroup, share: Overhead) -> CostGroup:
    total = g.cost + share.total
    return replace(
        g,
        overhead_idle=share.idle,
        overhead_energy=share.energy,
        overhead_box=share.box,
        cost_per_success=total / g.succeeded if g.succeeded else None,
    )


def with_overhead(
    groups: Sequence[CostGroup],
    rows: Sequence[UsageRow],
    *,
    since: float | None = None,
    until: float | None = None,
    window_s: float | None = None,
) -> list[CostGroup]:
    """The report's groups (policy/costs.py `cost_per_success` with the same range and
    windows) charged with rule 2: without windows the range's overhead over all of them,
    with windows each window's over the groups of that window. The overhead of a window
    no group was created in is in no group."""
    if window_s is None:
        return spread_overhead(groups, overhead_in(rows, since, until))
    charged: dict[int, CostGroup] = {}
    for start in {g.window_start for g in groups}:
        lo, hi = since, until
        if start is not None:  # windows start at `since`: none starts before it
            lo, hi = start, start + window_s if until is None else min(start + window_s, until)
        mine = [g for g in groups if g.window_start == start]
        for i, c in enumerate(spread_overhead(mine, overhead_in(rows, lo, hi))):
            charged[id(mine[i])] = c
    return [charged[id(g)] for g in groups]
