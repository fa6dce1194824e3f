"""Sleep, stop and wake of the workers one supervisor started: the mechanisms the worker
reaper calls (appliance/engines/supervision/supervisor.py holds one as `Supervisor.power`).

Model of the world: a HEALTHY worker started with sleep mode (`WorkerHandle.can_sleep`:
vLLM's `--enable-sleep-mode` and its dev endpoints, the CUDA build) can be put ASLEEP at
level 1 or 2 (`POST /sleep`; vLLM aborts what runs, drops its KV cache, and offloads or
discards the weights). Any worker the supervisor started that is HEALTHY, UNHEALTHY or
ASLEEP can be STOPPED: its watcher is called off first, so the exit is neither reported as
a crash nor restarted, then its group gets SIGTERM (SIGKILL after the grace). Either way
its KV is gone, so the KV index forgets the worker and the retention channel its holds,
as on a restart. A wake brings an ASLEEP worker back (`POST /wake_up`, and after level 2
the weights reloaded from the model: `/collective_rpc reload_weights`) or starts a STOPPED
one again (spawn, await /health, a new watcher); it is WAKING meanwhile, HEALTHY after, and
where it was if the wake fails. Every caller of a wake while one is under way awaits that
same wake (single flight). Each step is measured (PowerChange.duration_s, the handle's
`last_wake_s`) and reported as a worker event: SLEPT, STOPPED_ON_REQUEST, WAKE_STARTED,
WOKEN or WAKE_FAILED. Sleeps, stops and wakes of one worker take turns (its `power_lock`).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import Callable, Sequence

from appliance.domain.errors import EngineError
from appliance.domain.records import WorkerId
from appliance.domain.worker import PowerChange, WorkerEventKind, WorkerState
from appliance.engines.errors import WorkerPowerRefused, WorkerStartFailed
from appliance.engines.supervision.supervised_worker import SupervisedWorker, SupervisorTimings
from appliance.engines.supervision.worker_process import signal_group

log = logging.getLogger(__name__)
SLEEP_LEVELS = (1, 2)
STOPPABLE = (WorkerState.HEALTHY, WorkerState.UNHEALTHY, WorkerState.ASLEEP)


class PowerControl:
    """Sleep, stop and wake for a supervisor's workers (`slots`, under `timings`: the stop's
    grace, the start's timeout and poll). `forget(slot, reason)`
    drops what the appliance knows of its KV and holds; `watch(slot)` starts its watcher;
    `stopping()` says the supervisor is shutting down (then nothing more is done)."""

    def __init__(
        self,
        slots: Sequence[SupervisedWorker],
        timings: SupervisorTimings,
        *,
        forget: Callable[[SupervisedWorker, str], None],
        watch: Callable[[SupervisedWorker], None],
        stopping: Callable[[], bool],
    ) -> None:
        self._slots = {s.id: s for s in slots}
        self._forget, self._watch, self._stopping = forget, watch, stopping
        self._grace_s = timings.term_grace_s
        self._startup_s, self._poll_s = timings.startup_timeout_s, timings.poll_s

    def _slot(
        self, worker: WorkerId, action: str, allowed: Sequence[WorkerState]
    ) -> SupervisedWorker:
        slot = self._slots[worker]
        if self._stopping():
            raise WorkerPowerRefused(f"cannot {action} worker {worker}: the appliance is stopping")
        if slot.handle.state not in allowed:
            raise WorkerPowerRefused(
                f"cannot {action} worker {worker} while it is {slot.handle.state.value}"
            )
        return slot

    async def sleep(self, worker: WorkerId, level: int = 1) -> PowerChange:
        """Put a HEALTHY worker to sleep at `level` (1: weights to host memory, 2: dropped).
        WorkerPowerRefused when it cannot sleep; the worker's error when /sleep fails (it
        is then woken again)."""
        if level not in SLEEP_LEVELS:
            raise ValueError(f"sleep level must be 1 or 2, got {level}")
        slot = self._slots[worker]
        if not slot.handle.can_sleep:
            raise WorkerPowerRefused(
                f"worker {worker} cannot sleep: it was not started with sleep mode "
                "(engine.sleep_mode, vLLM's CUDA build); stop it instead"
            )
        async with slot.power_lock:
            slot = self._slot(worker, "put to sleep", (WorkerState.HEALTHY,))
            started = time.monotonic()
            slot.move(WorkerState.ASLEEP)  # the router sends it nothing from now on
            try:
                await slot.handle.client.sleep(level)
            except EngineError:
                await self._undo_sleep(slot)
                raise
            slot.handle.sleep_level = level
            self._forget(slot, f"put to sleep (level {level})")
            took = time.monotonic() - started
            slot.emit(WorkerEventKind.SLEPT, level=level, duration_s=took)
            return PowerChange(worker, WorkerState.HEALTHY, WorkerState.ASLEEP, took, level)

    async def _undo_sleep(self, slot: SupervisedWorker) -> None:
        """A failed /sleep may have paused the engine: resume it (or leave it asleep)."""
        slot.move(WorkerState.WAKING)
        try:
            await slot.handle.client.wake_up()
        except EngineError as exc:
            slot.move(WorkerState.ASLEEP)
            log.warning("worker %s: /sleep failed and /wake_up too: %s", slot.id, exc.message)
            return
        slot.move(WorkerState.HEALTHY)

    async def stop(self, worker: WorkerId) -> PowerChange:
        """End a worker's process on purpose: it is STOPPED, not restarted, until woken."""
        slot = self._slots[worker]
        async with slot.power_lock:
            slot = self._slot(worker, "stop", STOPPABLE)
            before, started = slot.handle.state, time.monotonic()
            watcher, slot.watcher = slot.watcher, None
            if watcher is not None:
                watcher.cancel()
                await asyncio.gather(watcher, return_exceptions=True)
            slot.move(WorkerState.STOPPED)
            await slot.terminate(self._grace_s)
            slot.handle.pid, slot.healthy_since, slot.failures = None, None, 0
            self._forget(slot, "stopped on request")
            took = time.monotonic() - started
            slot.emit(WorkerEventKind.STOPPED_ON_REQUEST, duration_s=took)
            return PowerChange(worker, before, WorkerState.STOPPED, took)

    async def wake(self, worker: WorkerId) -> PowerChange:
        """Bring an ASLEEP or STOPPED worker back to HEALTHY; every call made while a wake
        is under way returns that wake's result. A HEALTHY worker: at once, 0 s."""
        slot = self._slots[worker]
        task = slot.wake_task
        if task is None or task.done():
            if slot.handle.state == WorkerState.HEALTHY and not slot.power_lock.locked():
                return PowerChange(worker, WorkerState.HEALTHY, WorkerState.HEALTHY, 0.0)
            task = asyncio.create_task(self._wake(slot), name=f"wake {worker}")
            slot.wake_task = task
        return await asyncio.shield(task)

    async def _wake(self, slot: SupervisedWorker) -> PowerChange:
        started = time.monotonic()
        async with slot.power_lock:
            state = slot.handle.state
            if state == WorkerState.HEALTHY:  # a sleep it waited for failed and undid itself
                return PowerChange(slot.id, state, state, time.monotonic() - started)
            slot = self._slot(slot.id, "wake", (WorkerState.ASLEEP, WorkerState.STOPPED))
            level = slot.handle.sleep_level if state == WorkerState.ASLEEP else None
            slot.move(WorkerState.WAKING)
            slot.emit(WorkerEventKind.WAKE_STARTED, level=level)
            try:
                if state == WorkerState.ASLEEP:
                    await self._resume(slot, level)
                else:
                    await self._start(slot)
            except (EngineError, OSError) as exc:
                slot.move(state)
                if state == WorkerState.ASLEEP:
                    slot.handle.sleep_level = level
                detail = exc.message if isinstance(exc, EngineError) else str(exc)
                slot.emit(WorkerEventKind.WAKE_FAILED, level=level, detail=detail)
                raise
            took = time.monotonic() - started
            slot.handle.last_wake_s = took
            slot.emit(WorkerEventKind.WOKEN, level=level, duration_s=took)
            return PowerChange(
                slot.id, state, WorkerState.HEALTHY, took, level, state == WorkerState.STOPPED
            )

    async def _resume(self, slot: SupervisedWorker, level: int | None) -> None:
        await slot.handle.client.wake_up()
        if level == 2:  # the memory is back, the weights' values are not
            await slot.handle.client.reload_weights()
        slot.move(WorkerState.HEALTHY)

    async def _start(self, slot: SupervisedWorker) -> None:
        """Spawn it and await /health; on failure nothing of it is left running."""
        await slot.spawn(WorkerState.WAKING)
        try:
            deadline = time.monotonic() + self._startup_s
            await slot.await_healthy(deadline, timeout_s=self._startup_s, poll_s=self._poll_s)
        except WorkerStartFailed:
            if slot.proc is not None and slot.proc.returncode is None:
                signal_group(slot.proc.pid, signal.SIGKILL)
            await slot.terminate(0.0)
            slot.handle.pid = None
            raise
        self._watch(slot)
