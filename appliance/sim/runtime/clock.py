"""Clocks for the simulated engine, and the live loop that drives one engine in real time.

Model of the world: the engine never reads a clock; whoever drives it passes `now`. A clock
has `now()` (seconds) and `async sleep(seconds)`. `RealClock` is the process's monotonic
clock. `VirtualClock` is simulated time that moves only when told: `advance` / `advance_to`
(the virtual-time driver in `virtual.py` does this for N engines), or `sleep`, which jumps
the time forward at once; that suits one sleeper at a time (a single `run_engine_loop` in a
test), not several coroutines that must interleave in time order.

`run_engine_loop` is the whole live driver: while the engine has work it steps at
`clock.now()`, sleeps the step's `duration_s` (against a deadline, so sleep overshoot does
not accumulate), then hands the `StepResult` to `on_step`, so tokens appear when the
modelled GPU would have produced them. When idle it waits on `wake` (set it after
`add_request` / `abort_request`). Setting `stop` ends it; a step in flight is delivered
first.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Protocol

from appliance.sim.core.engine import SimEngine
from appliance.sim.engine_io import StepResult


class EngineClock(Protocol):
    """What drives an engine: seconds that need not be wall time (`ports.Clock` is)."""

    def now(self) -> float: ...

    async def sleep(self, seconds: float) -> None: ...


class RealClock:
    """Wall time from `time.monotonic`."""

    def now(self) -> float:
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(max(seconds, 0.0))


class VirtualClock:
    """Simulated seconds; moves only when advanced (or by `sleep`, which jumps)."""

    def __init__(self, start_s: float = 0.0) -> None:
        self._now = start_s

    def now(self) -> float:
        return self._now

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"time cannot go back ({seconds} s)")
        self._now += seconds

    def advance_to(self, t: float) -> None:
        if t < self._now:
            raise ValueError(f"time cannot go back from {self._now} to {t}")
        self._now = t

    async def sleep(self, seconds: float) -> None:
        self.advance(max(seconds, 0.0))
        await asyncio.sleep(0)


async def run_engine_loop(
    engine: SimEngine,
    clock: EngineClock,
    on_step: Callable[[StepResult], None],
    wake: asyncio.Event,
    stop: asyncio.Event,
) -> None:
    """Step `engine` while it has work, pacing each step by its modelled duration."""
    while not stop.is_set():
        if not engine.has_unfinished_requests():
            wake.clear()
            await _wait_any(wake, stop)
            if not engine.has_unfinished_requests() and not stop.is_set():
                # Woken with nothing to run: a retention directive came (a live worker's
                # control channel wakes it), applied by a step of nothing else.
                on_step(engine.step(clock.now()))
            continue
        start = clock.now()
        result = engine.step(start)
        if result.duration_s > 0:
            await clock.sleep(start + result.duration_s - clock.now())
        else:
            await asyncio.sleep(0)  # let callers add requests; never spin the loop
        on_step(result)


async def _wait_any(*events: asyncio.Event) -> None:
    waiters = [asyncio.ensure_future(e.wait()) for e in events]
    try:
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waiters:
            w.cancel()
