"""The worker reaper's loop over a switch that changes states as the supervisor's does
(engines/supervision/power_control.py: a stop ends the process, concurrent wakes share one wake)."""

from __future__ import annotations

import asyncio
from concurrent.futures import Future
from dataclasses import replace

import pytest

from appliance.domain.records import WorkerId, WorkerPowerEvent
from appliance.domain.worker import LoadSnapshot, PowerChange, WorkerState, WorkerStatus
from appliance.policy.worker_power import CPU_VLLM_STATES, PowerSettings, power_table
from appliance.services.turns.turn import NoWorker
from appliance.services.workers.worker_reaper import PowerInputs, WorkerReaperLoop
from tests.fakes import ManualClock

W0 = WorkerId("w0")
TABLE = power_table((1.0, 3.0, 30.0), 16 << 30, 8 << 30, CPU_VLLM_STATES)


class Switch:
    """One worker's lifecycle state, changed as the supervisor's power control does."""

    def __init__(self, clock: ManualClock) -> None:
        self.state, self.calls, self._clock = WorkerState.HEALTHY, list[str](), clock
        self._wake: asyncio.Future[PowerChange] | None = None

    async def sleep(self, worker: WorkerId, level: int = 1) -> PowerChange:
        raise AssertionError("the CPU build cannot sleep")

    async def stop(self, worker: WorkerId) -> PowerChange:
        self.calls.append("stop")
        self.state = WorkerState.STOPPED
        return PowerChange(worker, WorkerState.HEALTHY, WorkerState.STOPPED, 0.2)

    async def wake(self, worker: WorkerId) -> PowerChange:
        if self._wake is None:  # the first caller wakes it; the others wait for that wake
            self.calls.append("wake")
            self.state = WorkerState.WAKING
            self._wake = asyncio.get_running_loop().create_future()
            await asyncio.sleep(0.01)
            self._clock.advance(30.0)
            self.state = WorkerState.HEALTHY
            self._wake.set_result(
                PowerChange(worker, WorkerState.STOPPED, WorkerState.HEALTHY, 30.0, spawned=True)
            )
        return await self._wake


class Rows:
    def __init__(self) -> None:
        self.power: list[WorkerPowerEvent] = []

    def record_worker_power(self, event: WorkerPowerEvent) -> Future[None]:
        self.power.append(event)
        done: Future[None] = Future()
        done.set_result(None)
        return done


def setup(busy: int = 0) -> tuple[WorkerReaperLoop, Switch, Rows, ManualClock, list[WorkerId]]:
    clock, rows, rested = ManualClock(), Rows(), list[WorkerId]()
    switch = Switch(clock)

    def workers() -> list[WorkerStatus]:
        load = LoadSnapshot(clock.now(), busy, 0, 0.0)
        return [WorkerStatus(W0, "vllm", "http://w0", (0,), switch.state, False, 0, load=load)]

    inputs = PowerInputs(workers, lambda w: 0, "m", TABLE, PowerSettings(worker_idle_s=5.0))
    loop = WorkerReaperLoop(
        switch,
        inputs,
        ledger=rows,
        clock=clock,  # type: ignore[arg-type]
        before_rest=rested.append,
    )
    return loop, switch, rows, clock, rested


def test_an_idle_worker_stops_and_a_turn_wakes_it_once_for_two() -> None:
    loop, switch, rows, clock, rested = setup()
    clock.advance(4.9)
    assert loop.tick(clock.now()) == []  # not idle long enough
    clock.advance(0.2)
    (decision,) = loop.tick(clock.now())
    asyncio.run(loop.rest(decision))
    assert switch.calls == ["stop"] and rested == [W0]  # the idle reaper heard first
    assert (rows.power[0].action, rows.power[0].from_state, rows.power[0].to_state) == (
        "stop",
        "awake",
        "stopped",
    )
    assert rows.power[0].state_s == pytest.approx(5.1) and rows.power[0].duration_s == 0.2
    assert loop.wake_s(W0) == 30.0  # what admission adds to a turn's first token
    clock.advance(60.0)
    assert loop.tick(clock.now()) == []  # at rest: nothing more to decide

    async def two_turns() -> list[bool]:
        return list(await asyncio.gather(loop.ensure_awake(), loop.ensure_awake()))

    assert asyncio.run(two_turns()) == [True, True]
    assert switch.calls == ["stop", "wake"]
    wake = rows.power[-1]
    assert (wake.action, wake.from_state, wake.to_state) == ("wake", "stopped", "awake")
    assert wake.state_s == pytest.approx(60.0) and wake.duration_s == 30.0 and len(rows.power) == 2
    assert loop.wake_s(W0) is None and loop.wake_seconds.count == 1
    assert asyncio.run(loop.ensure_awake()) is False  # awake: no wake


def test_a_busy_worker_and_a_reaper_without_an_idle_time_stay_awake() -> None:
    loop, switch, _, clock, _ = setup(busy=1)
    clock.advance(60.0)
    assert loop.tick(clock.now()) == [] and switch.calls == []
    off, _, _, clock, _ = setup()
    off._in = replace(off._in, settings=PowerSettings())
    clock.advance(60.0)
    assert off.tick(clock.now()) == []


def test_a_failed_wake_refuses_the_turn_as_no_worker_and_the_next_turn_tries_again() -> None:
    loop, switch, rows, clock, _ = setup()
    clock.advance(6.0)
    asyncio.run(loop.rest(loop.tick(clock.now())[0]))

    async def fails(worker: WorkerId) -> PowerChange:
        switch.calls.append("wake")
        raise RuntimeError("the process exited during its start")

    switch.wake = fails  # type: ignore[method-assign]
    with pytest.raises(NoWorker, match="waking w0 failed: the process exited"):
        asyncio.run(loop.ensure_awake())
    assert loop.wake_s(W0) == 30.0 and len(rows.power) == 1  # still stopped, no wake row
    with pytest.raises(NoWorker):
        asyncio.run(loop.ensure_awake())
    assert switch.calls == ["stop", "wake", "wake"]
