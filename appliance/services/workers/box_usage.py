"""The box's own usage, recorded in the ledger period by period: what no turn row holds.

Model of the world: the router's wall-clock time is cut into usage periods at multiples of
`ledger.usage_period_s` (aligned to the Unix epoch; the first from the router's start, the
last to its stop). At each boundary it writes one `usage_periods` row and one `worker_usage`
row per worker: the GPU-seconds the worker was awake in the period and of them busy (the
GPU meter's, services/workers/gpu_meter.py), and the joules its GPUs drew (the GPU probe's power
readings, each held over the time since the probe's previous tick: `EnergyMeter`). The
ledger prices the period as overhead (policy/overhead.py) at the price in effect at its end.

Nothing counts before it is durable: the next period starts where the last acknowledged
one ended, one write is in flight at a time, and a period whose write failed is covered by
the next one, so the rows never overlap and leave no gap while the router runs. A crash
loses at most the periods since the last acknowledged one. What the state shows
(`recorded`) is what the ledger acknowledged: the same rows `appliance costs` reads.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol

from appliance.domain.gpu import GpuSnapshot
from appliance.domain.records import WorkerId
from appliance.domain.usage import JOULES_PER_KWH, PeriodCost, UsagePeriod, WorkerUsage
from appliance.policy.overhead import Overhead
from appliance.ports import Clock, GpuProbe
from appliance.services.workers.gpu_meter import GpuTime

log = logging.getLogger(__name__)

FINAL_WRITE_WAIT_S = 5.0
"""At the stop, how long the last period waits for the write before it."""


class GpuOwner(Protocol):
    """A worker as the energy meter sees it: its id and the GPU indices it was given."""

    @property
    def id(self) -> WorkerId: ...

    @property
    def gpus(self) -> tuple[int, ...]: ...


class UsageLedger(Protocol):
    def record_usage(self, period: UsagePeriod) -> Future[PeriodCost]: ...


class AwakeBusy(Protocol):
    """The GPU meter (services/workers/gpu_meter.py)."""

    gpus_per_worker: int

    def reading(self, worker: WorkerId) -> GpuTime: ...


def gpu_owners(workers: Sequence[GpuOwner], simulated: bool) -> dict[int, WorkerId]:
    """Which worker each GPU index belongs to: the GPUs a worker was given; under the
    simulated engine a worker given none owns the simulated GPU at its position (the probe
    reads one per worker, in order). A GPU no worker owns is not the appliance's."""
    owners: dict[int, WorkerId] = {}
    for i, w in enumerate(workers):
        for index in w.gpus or ((i,) if simulated else ()):
            owners.setdefault(index, w.id)
    return owners


class EnergyMeter:
    """Joules each worker's GPUs drew since the router started: each tick's power reading
    times the seconds since the tick before (the simulated GPUs' power is their load over
    that interval; NVML's, the board's draw now)."""

    def __init__(self, workers: Callable[[], Sequence[GpuOwner]]) -> None:
        self.workers = workers
        self._last_at: float | None = None
        self._joules: dict[WorkerId, float] = {}

    def observe(self, snap: GpuSnapshot) -> None:
        last, self._last_at = self._last_at, snap.time
        if last is None or snap.time <= last:
            return  # the first tick, or the clock stepped back: nothing to hold
        simulated = (snap.driver or "").startswith("simulated")
        owners = gpu_owners(self.workers(), simulated)
        for r in snap.gpus:
            worker = owners.get(r.index)
            if worker is not None and r.power_w is not None:
                self._joules[worker] = self._joules.get(worker, 0.0) + r.power_w * (
                    snap.time - last
                )

    def joules(self, worker: WorkerId) -> float | None:
        """None: no power reading of its GPUs yet."""
        return self._joules.get(worker)


class GpuTick:
    """The GPU probe's latest reading, taken by the refresh loop (`take`), read by the
    state; each one feeds the energy meter."""

    def __init__(self, probe: GpuProbe, energy: EnergyMeter | None = None) -> None:
        self.probe = probe
        self.energy = energy if energy is not None else EnergyMeter(tuple)
        self.reading: GpuSnapshot = probe.snapshot()
        self.energy.observe(self.reading)

    def take(self, snap: GpuSnapshot) -> None:
        self.reading = snap
        self.energy.observe(snap)


@dataclass(frozen=True, slots=True)
class RecordedUsage:
    """What the ledger acknowledged of this run's usage periods."""

    through: float | None = None
    """The end of the last acknowledged period (None: none yet)."""
    overhead: Overhead = field(default_factory=Overhead)
    awake_s: float = 0.0
    """GPU-seconds the workers were awake."""
    idle_s: float = 0.0
    """Of them, with nothing in flight (priced as overhead)."""
    energy_j: float = 0.0
    box_s: float = 0.0
    """Wall-clock seconds the periods covered."""

    def add(self, period: UsagePeriod, cost: PeriodCost) -> RecordedUsage:
        return RecordedUsage(
            through=period.ended_at,
            overhead=self.overhead + Overhead(cost.idle, cost.energy, cost.box),
            awake_s=self.awake_s + sum(w.awake_s for w in period.workers),
            idle_s=self.idle_s + sum(w.idle_s for w in period.workers),
            energy_j=self.energy_j + sum(w.energy_j or 0.0 for w in period.workers),
            box_s=self.box_s + period.seconds,
        )

    def summary(self) -> dict[str, Any]:
        """As the state shows it (`costs.overhead`)."""
        o = self.overhead
        return {
            "through": self.through,
            "idle": o.idle,
            "energy": o.energy,
            "box": o.box,
            "total": o.total,
            "awake_gpu_s": self.awake_s,
            "idle_gpu_s": self.idle_s,
            "energy_kwh": self.energy_j / JOULES_PER_KWH,
            "box_hours": self.box_s / 3600.0,
        }


@dataclass(frozen=True, slots=True)
class _Mark:
    """Where the next period starts: its time, and each worker's counters then."""

    at: float
    gpu: dict[WorkerId, GpuTime] = field(default_factory=dict)
    joules: dict[WorkerId, float | None] = field(default_factory=dict)


class BoxUsage:
    """Writes the usage periods (the module docstring) of the energy meter's workers."""

    def __init__(
        self,
        meter: AwakeBusy | None,
        energy: EnergyMeter,
        ledger: UsageLedger,
        clock: Clock,
        period_s: float,
    ) -> None:
        if period_s <= 0:
            raise ValueError("a usage period needs period_s > 0")
        self._meter, self._ledger, self._clock = meter, ledger, clock
        self.energy = energy
        self.period_s = period_s
        self._gpus = meter.gpus_per_worker if meter is not None else 1
        self._mark = self._mark_now()
        self._recorded = RecordedUsage()
        self._in_flight: Future[PeriodCost] | None = None
        self._lock = threading.Lock()  # the writer's thread acknowledges

    def recorded(self) -> RecordedUsage:
        return self._recorded

    def close_period(self) -> Future[PeriodCost] | None:
        """Writes the period from the last acknowledged boundary to now; None while the
        write before it is in flight (the next boundary covers both) or nothing elapsed."""
        with self._lock:
            if self._in_flight is not None:
                return None
            mark, now = self._mark, self._mark_now()
            if now.at <= mark.at:
                return None
            period = UsagePeriod(mark.at, now.at, self._usage(mark, now))
            try:
                written = self._ledger.record_usage(period)
            except Exception:
                log.exception("usage period %.3f-%.3f not recorded", mark.at, now.at)
                return None
            self._in_flight = written
        written.add_done_callback(lambda f: self._acknowledged(f, period, now))
        return written

    def _acknowledged(self, written: Future[PeriodCost], period: UsagePeriod, now: _Mark) -> None:
        with self._lock:
            self._in_flight = None
            if written.cancelled() or written.exception() is not None:
                what = f"usage period {period.started_at:.3f}-{period.ended_at:.3f}"
                log.warning("%s not recorded; the next one covers it", what)
                return
            cost = written.result()
            self._mark = now
            self._recorded = self._recorded.add(period, cost or PeriodCost())

    def _mark_now(self) -> _Mark:
        ids = [w.id for w in self.energy.workers()]
        return _Mark(
            self._clock.now(),
            {w: self._meter.reading(w) if self._meter else GpuTime(0.0, 0.0) for w in ids},
            {w: self.energy.joules(w) for w in ids},
        )

    def _usage(self, mark: _Mark, now: _Mark) -> tuple[WorkerUsage, ...]:
        rows = []
        for worker, reading in now.gpu.items():
            before = mark.gpu.get(worker, GpuTime(0.0, 0.0))
            joules, joules_before = now.joules.get(worker), mark.joules.get(worker)
            energy = None if joules is None else max(0.0, joules - (joules_before or 0.0))
            rows.append(
                WorkerUsage(
                    worker,
                    self._gpus,
                    awake_s=max(0.0, reading.awake_s - before.awake_s),
                    busy_s=max(0.0, reading.busy_s - before.busy_s),
                    energy_j=energy,
                )
            )
        return tuple(rows)

    async def run(self) -> None:
        """A period at each boundary until cancelled; then the last one, to the stop."""
        try:
            while True:
                now = self._clock.now()
                await self._clock.sleep((math.floor(now / self.period_s) + 1) * self.period_s - now)
                self.close_period()
        except asyncio.CancelledError:
            await self._last_period()
            raise

    async def _last_period(self) -> None:
        in_flight = self._in_flight
        if in_flight is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.wrap_future(in_flight), FINAL_WRITE_WAIT_S)
        self.close_period()
