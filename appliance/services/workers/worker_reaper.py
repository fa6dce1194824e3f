"""The worker reaper, live: idle workers sleep or stop (`policy/worker_power.py`), and a turn
that finds none awake wakes one and waits for it.

Model of the world: a worker is idle while it has no running or waiting request (its latest
reading), no turn of the router's in flight and no turn waiting for its wake; `tick` tracks
since when. Every `TICK_S` the policy decides over the workers the appliance can switch
(healthy ones, and those it put to rest); each SLEEP or STOP goes through the power switch
(`ports.WorkerPowerSwitch`, the supervisor's), after the idle reaper has been told that the
KV of the sessions waiting there goes with it (`before_rest`). A turn (`ensure_awake`, from
the turn desk before it places the turn) with no awake worker of its model wakes the one
fastest to wake, or waits for the one waking; its time to first token holds the wake, and
admission counted it first (`wake_s`). Each change is a `worker_power_events` row with the
seconds the worker spent in the state it left (GPU-seconds per state: times its GPUs), and
the GPU meter stops charging awake time while a worker rests.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass

from appliance.domain.records import WorkerId, WorkerPowerEvent
from appliance.domain.worker import PowerChange, WorkerState, WorkerStatus
from appliance.policy.worker_power import (
    PowerAction,
    PowerDecision,
    PowerSettings,
    PowerState,
    PowerTable,
    WakeKind,
    WorkerPower,
    choose_wake,
    decide_power,
)
from appliance.ports import Clock, Ledger, WorkerPowerSwitch
from appliance.services.operator.histogram import PromHistogram
from appliance.services.turns.turn import NoWorker
from appliance.services.workers.gpu_meter import GpuMeter

log = logging.getLogger(__name__)
TICK_S = 1.0
"""How often idle workers are decided on."""
WAKE_BOUNDS_S = (0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300)


@dataclass(frozen=True, slots=True)
class PowerInputs:
    """What the worker reaper reads of the live appliance."""

    workers: Callable[[], Sequence[WorkerStatus]]
    in_flight: Callable[[WorkerId], int]
    """The router's turns in flight at a worker."""
    model: str
    table: PowerTable
    settings: PowerSettings
    gpus_per_worker: int = 1


class WorkerReaperLoop:
    def __init__(
        self,
        switch: WorkerPowerSwitch,
        inputs: PowerInputs,
        *,
        ledger: Ledger,
        clock: Clock,
        meter: GpuMeter | None = None,
        before_rest: Callable[[WorkerId], None] | None = None,
    ) -> None:
        self._switch = switch
        self._in = inputs
        self._ledger = ledger
        self._clock = clock
        self._meter = meter
        self._before_rest = before_rest
        now = clock.now()
        self._started = now
        self._busy_at: dict[WorkerId, float] = {}  # when each was last seen busy
        self._state_since: dict[WorkerId, float] = {}
        self._resting: dict[WorkerId, PowerState] = {}  # the state it was put to
        self._waking: dict[WorkerId, float] = {}  # when its wake began
        self._waiting: dict[WorkerId, int] = {}  # turns waiting for its wake
        self._acting: set[WorkerId] = set()
        self._more: set[asyncio.Task[None]] = set()  # wakes for capacity, not awaited
        self.wake_seconds = PromHistogram(WAKE_BOUNDS_S)
        """Measured wakes (`appliance_worker_wake_seconds`)."""

    # --- what the policy sees ---------------------------------------------------------

    def views(self, now: float) -> list[WorkerPower]:
        """The workers the reaper may switch, as the policy sees them now."""
        views = []
        for w in self._in.workers():
            state = self._state_of(w)
            if state is None:
                continue
            load = w.load
            running, waiting = (load.running, load.waiting) if load is not None else (0, 0)
            running += self._in.in_flight(w.id)
            held = self._waiting.get(w.id, 0)
            if running + waiting + held or state is not PowerState.AWAKE:
                self._busy_at[w.id] = now
            began = self._waking.get(w.id)
            left = None
            if began is not None and state is not PowerState.AWAKE:
                left = max(0.0, self._in.table.wake_s(state) - (now - began))
            idle = now - self._busy_at.setdefault(w.id, self._started)
            views.append(
                WorkerPower(w.id, self._in.model, state, idle, running, waiting, held, left)
            )
        return views

    def _state_of(self, w: WorkerStatus) -> PowerState | None:
        """Its resting state as the policy names it; None: not the reaper's to switch (a
        worker starting, failing, draining, or one it did not put to rest)."""
        if w.draining:
            return None
        if w.state is WorkerState.HEALTHY:
            return PowerState.AWAKE
        if w.state in (WorkerState.ASLEEP, WorkerState.STOPPED, WorkerState.WAKING):
            return self._resting.get(w.id)
        return None

    def wake_s(self, worker: WorkerId) -> float | None:
        """Seconds until a resting worker could serve (the rest of a wake under way, or a
        whole one); None: awake, or not the reaper's."""
        for v in self.views(self._clock.now()):
            if v.worker_id == worker and v.state is not PowerState.AWAKE:
                left = v.waking_left_s
                return left if left is not None else self._in.table.wake_s(v.state)
        return None

    # --- deciding and switching -------------------------------------------------------

    def tick(self, now: float) -> list[PowerDecision]:
        """The decisions to carry out now: idle workers to put to rest."""
        if self._in.settings.worker_idle_s is None:
            return []
        views = [v for v in self.views(now) if v.worker_id not in self._acting]
        decided = decide_power(views, self._in.settings, self._in.table)
        return [d for d in decided if d.action is not PowerAction.STAY]

    async def rest(self, d: PowerDecision) -> None:
        """Puts the worker to the decision's state."""
        worker = WorkerId(d.worker_id)
        self._acting.add(worker)
        try:
            if self._before_rest is not None:
                self._before_rest(worker)
            level = d.target.sleep_level
            if level is None:
                change = await self._switch.stop(worker)
            else:
                change = await self._switch.sleep(worker, level)
            self._resting[worker] = d.target
            self._changed(
                worker,
                "stop" if level is None else "sleep",
                PowerState.AWAKE,
                d.target,
                change,
                d.reason,
            )
        finally:
            self._acting.discard(worker)

    async def ensure_awake(self) -> bool:
        """Before a turn is placed: with no worker of the model awake, wake the fastest (or
        wait for the one waking); with every awake one queueing, wake one more meanwhile.
        Whether the turn waited for a wake."""
        choice = choose_wake(self._in.model, self.views(self._clock.now()), self._in.table)
        if choice.worker_id is None or choice.kind is WakeKind.AWAKE:
            return False
        worker = WorkerId(choice.worker_id)
        if choice.kind is WakeKind.MORE:
            task = asyncio.get_running_loop().create_task(self._wake(worker, choice.reason))
            self._more.add(task)
            task.add_done_callback(self._more.discard)
            return False
        self._waiting[worker] = self._waiting.get(worker, 0) + 1
        try:
            await self._wake(worker, choice.reason)
        except Exception as e:  # it stays where it was; the turn is refused, saying why
            raise NoWorker(f"no worker serves this model now: waking {worker} failed: {e}") from e
        finally:
            self._waiting[worker] -= 1
        return True

    async def _wake(self, worker: WorkerId, reason: str) -> None:
        state = self._resting.get(worker)
        if state is None:
            return
        self._waking.setdefault(worker, self._clock.now())
        try:
            change = await self._switch.wake(worker)  # concurrent callers share one wake
        finally:
            self._waking.pop(worker, None)
        if self._resting.pop(worker, None) is not None:  # the first caller back records it
            self.wake_seconds.observe(change.duration_s)
            self._changed(worker, "wake", state, PowerState.AWAKE, change, reason)

    def _changed(
        self,
        worker: WorkerId,
        action: str,
        was: PowerState,
        now_in: PowerState,
        change: PowerChange,
        reason: str,
    ) -> None:
        now = self._clock.now()
        # A wake counts as awake (the GPU is taken from its start), a stop until it is done.
        left_at = now - change.duration_s if now_in is PowerState.AWAKE else now
        since = self._state_since.get(worker, self._started)
        self._state_since[worker] = left_at
        self._busy_at[worker] = now
        if self._meter is not None:
            self._meter.rests(worker, now_in is not PowerState.AWAKE, left_at)
        log.info(
            "worker reaper: %s %s (%s -> %s) in %.2f s: %s",
            action,
            worker,
            was,
            now_in,
            change.duration_s,
            reason,
        )
        row = WorkerPowerEvent(
            now,
            worker,
            action,
            was.value,
            now_in.value,
            change.duration_s,
            left_at - since,
            self._in.gpus_per_worker,
            reason,
        )
        self._ledger.record_worker_power(row).add_done_callback(_log_refusal)

    async def run(self) -> None:
        """Decides every `TICK_S` and carries out each decision, until cancelled."""
        async with asyncio.TaskGroup() as group:
            while True:
                try:
                    for d in self.tick(self._clock.now()):
                        self._acting.add(WorkerId(d.worker_id))
                        group.create_task(self._rest_logged(d))
                except Exception:
                    log.exception("worker reaper: a tick failed")
                await asyncio.sleep(TICK_S)

    async def _rest_logged(self, d: PowerDecision) -> None:
        try:
            await self.rest(d)
        except Exception as e:
            log.warning("worker reaper: could not %s %s: %s", d.action, d.worker_id, e)


def _log_refusal(written: Future[None]) -> None:
    exc = written.exception()
    if exc is not None:
        log.error("worker reaper: the ledger refused a row: %s", exc)
