"""The box's usage periods (services/workers/box_usage.py): the GPUs' energy by worker, and periods
written from the last acknowledged boundary, never overlapping, never counted before the
ledger acknowledged them."""

from __future__ import annotations

import asyncio
from concurrent.futures import Future
from dataclasses import dataclass, field

import pytest

from appliance.domain.gpu import GpuReading, GpuSnapshot
from appliance.domain.records import WorkerId
from appliance.domain.usage import PeriodCost, UsagePeriod
from appliance.services.workers.box_usage import BoxUsage, EnergyMeter, GpuTick, gpu_owners
from appliance.services.workers.gpu_meter import GpuTime
from tests.fakes import ManualClock

W0, W1 = WorkerId("w0"), WorkerId("w1")


@dataclass
class Worker:
    id: WorkerId
    gpus: tuple[int, ...] = ()


def reading(index: int, power_w: float | None) -> GpuReading:
    return GpuReading(index, "H200", f"GPU-{index}", 1, 0, 1, None, None, power_w)


def snap(t: float, *powers: tuple[int, float | None], driver: str = "560") -> GpuSnapshot:
    return GpuSnapshot(t, driver, tuple(reading(i, p) for i, p in powers), None)


def test_a_worker_owns_the_gpus_it_was_given_and_a_simulated_one_its_position() -> None:
    given = [Worker(W0, (2, 3)), Worker(W1, (0,))]
    assert gpu_owners(given, simulated=False) == {2: W0, 3: W0, 0: W1}
    bare = [Worker(W0), Worker(W1)]
    assert gpu_owners(bare, simulated=True) == {0: W0, 1: W1}
    assert gpu_owners(bare, simulated=False) == {}  # e.g. the CPU build: no GPU is theirs


def test_energy_is_each_ticks_power_held_since_the_tick_before() -> None:
    meter = EnergyMeter(lambda: [Worker(W0, (0,)), Worker(W1, (1,))])
    meter.observe(snap(100.0, (0, 300.0), (1, 100.0)))  # the first tick: nothing yet
    assert meter.joules(W0) is None
    meter.observe(snap(100.5, (0, 400.0), (1, None), (7, 700.0)))  # GPU 7 is no worker's
    assert meter.joules(W0) == 200.0  # 400 W for 0.5 s
    assert meter.joules(W1) is None  # no reading of its GPU
    meter.observe(snap(100.0, (0, 400.0)))  # the clock stepped back: nothing to hold
    meter.observe(snap(102.0, (0, 100.0), (1, 150.0)))
    assert (meter.joules(W0), meter.joules(W1)) == (400.0, 300.0)


def test_a_simulated_probes_gpus_belong_to_the_workers_in_order() -> None:
    meter = EnergyMeter(lambda: [Worker(W0), Worker(W1)])
    tick = GpuTick(FakeProbe(snap(10.0, (0, 100.0), (1, 100.0), driver="simulated (model)")))
    tick.energy = meter
    tick.take(snap(10.0, (0, 100.0), (1, 100.0), driver="simulated (model)"))
    tick.take(snap(11.0, (0, 700.0), (1, 100.0), driver="simulated (model)"))
    assert (meter.joules(W0), meter.joules(W1)) == (700.0, 100.0)
    assert tick.reading.time == 11.0


@dataclass
class FakeProbe:
    first: GpuSnapshot

    def snapshot(self) -> GpuSnapshot:
        return self.first

    def close(self) -> None:
        pass


@dataclass
class Meter:
    """The GPU meter's readings: set by the test."""

    now: dict[WorkerId, GpuTime] = field(default_factory=dict)
    gpus_per_worker: int = 2

    def reading(self, worker: WorkerId) -> GpuTime:
        return self.now.get(worker, GpuTime(0.0, 0.0))


@dataclass
class Ledger:
    """Holds each write's Future for the test to resolve."""

    written: list[tuple[UsagePeriod, Future[PeriodCost]]] = field(default_factory=list)
    closed: bool = False

    def record_usage(self, period: UsagePeriod) -> Future[PeriodCost]:
        if self.closed:
            raise RuntimeError("closed")
        fut: Future[PeriodCost] = Future()
        self.written.append((period, fut))
        return fut


class House:
    def __init__(self) -> None:
        self.clock = ManualClock(1000.0)
        self.meter = Meter()
        self.energy = EnergyMeter(lambda: [Worker(W0, (0,)), Worker(W1, (1,))])
        self.energy.observe(snap(1000.0))
        self.ledger = Ledger()
        self.usage = BoxUsage(self.meter, self.energy, self.ledger, self.clock, 60.0)

    def at(self, t: float, w0: tuple[float, float], w1: tuple[float, float], watts: float) -> None:
        self.clock.t = t
        self.meter.now = {W0: GpuTime(*w0), W1: GpuTime(*w1)}
        self.energy.observe(snap(t, (0, watts), (1, None)))


def test_a_period_holds_each_workers_awake_busy_and_energy_since_the_last_boundary() -> None:
    h = House()
    h.at(1060.0, w0=(120.0, 30.0), w1=(120.0, 0.0), watts=200.0)
    written = h.usage.close_period()
    assert written is not None
    ((period, _),) = h.ledger.written
    assert (period.started_at, period.ended_at) == (1000.0, 1060.0)
    w0, w1 = period.workers
    assert (w0.worker, w0.gpus, w0.awake_s, w0.busy_s, w0.energy_j) == (W0, 2, 120.0, 30.0, 12000.0)
    assert (w1.awake_s, w1.busy_s, w1.energy_j) == (120.0, 0.0, None)
    # Not counted until acknowledged; a boundary meanwhile writes nothing (the next covers it).
    assert h.usage.recorded().through is None
    h.at(1120.0, w0=(240.0, 50.0), w1=(240.0, 0.0), watts=100.0)
    assert h.usage.close_period() is None
    written.set_result(PeriodCost(idle=0.21, energy=0.001, box=0.06))
    recorded = h.usage.recorded()
    assert recorded.through == 1060.0
    assert (recorded.overhead.idle, recorded.overhead.energy, recorded.overhead.box) == (
        0.21,
        0.001,
        0.06,
    )
    assert (recorded.awake_s, recorded.idle_s, recorded.energy_j, recorded.box_s) == (
        240.0,
        210.0,
        12000.0,
        60.0,
    )
    # The next period starts where the acknowledged one ended.
    h.at(1180.0, w0=(360.0, 50.0), w1=(360.0, 0.0), watts=100.0)
    assert h.usage.close_period() is not None
    period, _ = h.ledger.written[1]
    assert (period.started_at, period.ended_at) == (1060.0, 1180.0)
    assert [(w.awake_s, w.busy_s) for w in period.workers] == [(240.0, 20.0), (240.0, 0.0)]
    assert period.workers[0].energy_j == 12000.0  # 100 W for 60 s, then 60 s more


def test_a_period_whose_write_failed_is_covered_by_the_next() -> None:
    h = House()
    h.at(1060.0, w0=(120.0, 30.0), w1=(120.0, 0.0), watts=200.0)
    written = h.usage.close_period()
    assert written is not None
    written.set_exception(OSError("disk full"))
    assert h.usage.recorded().through is None
    h.at(1120.0, w0=(240.0, 30.0), w1=(240.0, 0.0), watts=200.0)
    assert h.usage.close_period() is not None
    period, _ = h.ledger.written[1]
    assert (period.started_at, period.ended_at) == (1000.0, 1120.0)
    assert period.workers[0].awake_s == 240.0
    assert period.workers[0].energy_j == 24000.0


def test_nothing_elapsed_or_a_closed_ledger_writes_nothing() -> None:
    h = House()
    assert h.usage.close_period() is None  # no time has passed
    h.ledger.closed = True
    h.at(1060.0, w0=(1.0, 0.0), w1=(1.0, 0.0), watts=100.0)
    assert h.usage.close_period() is None
    assert h.ledger.written == []


class SteppedClock(ManualClock):
    """Sleeps until the test lets it (`step`), then moves on by the time asked."""

    def __init__(self, t: float) -> None:
        super().__init__(t)
        self.go: asyncio.Queue[None] = asyncio.Queue()

    async def sleep(self, seconds: float) -> None:
        await self.go.get()
        self.advance(seconds)


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_the_loop_writes_at_each_boundary_and_the_last_part_period_at_the_stop() -> None:
    async def scenario() -> list[tuple[float, float]]:
        h = House()
        clock = SteppedClock(1010.0)
        h.usage = BoxUsage(h.meter, h.energy, h.ledger, clock, 60.0)
        task = asyncio.create_task(h.usage.run())
        clock.go.put_nowait(None)  # to the boundary at 1020: [1010, 1020)
        await settle()
        h.ledger.written[-1][1].set_result(PeriodCost())
        clock.go.put_nowait(None)  # [1020, 1080)
        await settle()
        clock.t += 12.5  # the stop comes 12.5 s into the next one
        task.cancel()
        await settle()
        assert len(h.ledger.written) == 2  # the last period waits for the write before it
        h.ledger.written[-1][1].set_result(PeriodCost())
        with pytest.raises(asyncio.CancelledError):
            await task
        return [(p.started_at, p.ended_at) for p, _ in h.ledger.written]

    assert asyncio.run(scenario()) == [(1010.0, 1020.0), (1020.0, 1080.0), (1080.0, 1092.5)]


def test_a_period_needs_a_length() -> None:
    h = House()
    with pytest.raises(ValueError, match="period_s > 0"):
        BoxUsage(h.meter, h.energy, h.ledger, h.clock, 0.0)
