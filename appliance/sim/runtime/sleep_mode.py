"""vLLM's sleep mode on a simulated worker: what `POST /sleep`, `POST /wake_up` and
`GET /is_sleeping` do (dev mode), and how long the wake takes.

Model of the world (vLLM 0.32 `v1/engine/core.py` `sleep`/`wake_up`/`pause_scheduler`,
`entrypoints/serve/dev/sleep/api_router.py`): a sleep in the default mode "abort" pauses
the scheduler and aborts every request in flight (they finish with reason "abort"); at level
1 or 2 it then resets the prefix cache and the connector's (one AllBlocksCleared; here the
host tier's blocks also go, as BlockRemoved on the CPU medium), and the executor offloads
the weights to host memory (1) or discards them (2). A reset refused because blocks are
still held fails the sleep, as vLLM's `_reset_caches` raises. A request that arrives while
the worker sleeps is queued, not refused: it runs once the wake resumes scheduling.
`vllm:engine_sleep_state` shows awake, weights_offloaded (level 1) or discard_all (level 2).

What the simulator adds is time: a wake takes `wake_s[level - 1]` seconds of modelled GPU
time (stretched by the worker's time scale, as every step is); concurrent wake calls share
one wake. The sleep itself is immediate. Level 2's weights come back with the wake here; on
vLLM the caller reloads them (`/collective_rpc` `reload_weights`), which the simulated
worker answers at once.
"""

from __future__ import annotations

import asyncio
from typing import Protocol

from appliance.sim.core.engine import SimEngine
from appliance.sim.runtime.clock import EngineClock

SIM_WAKE_S = (1.0, 3.0)
"""Default wake seconds from sleep levels 1 and 2 (weights copied back from host memory;
weights reloaded from disk). Source: vLLM's sleep-mode benchmarks (blog.vllm.ai,
2025-10-26: level 1 wakes in 0.1-6 s, level 2 in 0.8-2.6 s, from 0.6B to 235B models on
A4000 to A100), not yet measured on the profile's GPU."""

SLEEP_GAUGE_KEYS = {0: "awake", 1: "weights_offloaded", 2: "discard_all"}


class Sleeper(Protocol):
    """What of a simulated worker its sleep mode uses (appliance/sim/runtime/worker.py's
    SimWorker)."""

    @property
    def engine(self) -> SimEngine: ...

    @property
    def clock(self) -> EngineClock: ...

    def nudge(self) -> None: ...

    def reset_prefix_cache(self) -> bool: ...


class SleepRefused(Exception):
    """The sleep could not reset the caches: blocks are still held (vLLM raises then)."""


class SleepMode:
    """One worker's sleep state; waits for new requests while it sleeps."""

    def __init__(self, worker: Sleeper, wake_s: tuple[float, float] = SIM_WAKE_S) -> None:
        if len(wake_s) != 2 or min(wake_s) < 0:
            raise ValueError(f"wake_s needs two non-negative seconds, got {wake_s!r}")
        self._worker = worker
        self.wake_s = wake_s
        self.level = 0
        self.sleeping = False
        self._awake = asyncio.Event()
        self._awake.set()
        self._waking: asyncio.Task[None] | None = None

    async def sleep(self, level: int) -> None:
        """Pause, abort what runs and, at level >= 1, drop the KV cache (its events go out
        at once). Sleeping again at another level changes the level."""
        if level not in (0, 1, 2):
            raise ValueError(f"sleep level must be 0, 1 or 2, got {level}")
        worker = self._worker
        self.sleeping, self.level = True, max(self.level, level)
        self._awake.clear()
        if worker.engine.abort_all(worker.clock.now()):
            worker.nudge()
            for _ in range(1000):  # until the engine loop has delivered the aborts
                if not worker.engine.has_unfinished_requests():
                    break
                await asyncio.sleep(0.001)
        if level >= 1:
            cache = worker.engine.cache
            if cache.host is not None:
                cache.host.discard(cache.host.hashes())
            if not worker.reset_prefix_cache():
                raise SleepRefused("Failed to reset the KV connector cache.")

    async def wake_up(self) -> None:
        """Back to awake after the modelled wake time; concurrent calls share one wake."""
        if not self.sleeping:
            return
        if self._waking is None or self._waking.done():
            self._waking = asyncio.create_task(self._wake())
        await asyncio.shield(self._waking)

    async def _wake(self) -> None:
        if self.level >= 1:
            await self._worker.clock.sleep(self.wake_s[self.level - 1])
        self.sleeping, self.level = False, 0
        self._awake.set()

    async def until_awake(self) -> None:
        """Returns when the worker is awake (at once when it is)."""
        await self._awake.wait()

    def gauge(self) -> dict[str, float]:
        """`vllm:engine_sleep_state` by its `sleep_state` label."""
        awake = not self.sleeping
        values = {key: 0.0 for key in SLEEP_GAUGE_KEYS.values()}
        values["awake"] = 1.0 if awake else 0.0
        if not awake and self.level >= 1:
            values[SLEEP_GAUGE_KEYS[self.level]] = 1.0
        return values
