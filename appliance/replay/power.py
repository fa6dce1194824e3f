"""Scale to zero in the replay: idle simulated workers sleep or stop, and turns wake them.

Model of the world: each simulated worker is awake, asleep (vLLM sleep level 1 or 2) or
stopped, as `appliance.policy.worker_power` decides with one `--worker-reaper` setting
(`ReaperSetting`) and the GPU profile's wake times (`sim_power_table`). A worker is idle from
the step after which it has nothing running or waiting; once idle for `worker_idle_s` it
goes to the policy's state then (the decisions are taken lazily, at the next arrival or at
the end, for the times they were due: nothing else happens in between). Going there, it
releases every session it holds (counted) and its prefix cache is cleared (a stopped
worker's host tier too), with the KV events the router would see. Arrivals see only the
awake workers; with none awake, a turn waits for the worker waking soonest, else wakes the
fastest to wake (`choose_wake`), and its engine schedules nothing until the wake is over
(`SleepyEngine`): the wake is in the TTFT of every turn that waits for it, and one wake
serves them all. When every awake worker has turns waiting, the fastest resting one wakes
for the turns to come (the arrival itself queues on an awake one). A router that picks a
worker it was not offered (an anchor with state of its own) wakes that one.

Figures per row (`power` in the report): seconds per state summed over the workers, as
GPU-hours (awake counts the wakes: the GPU is held while it loads), wakes and the turns
that waited for one, sessions released by a sleep, sleeps by state; for a workload the
cost per successful task charging awake GPU-time (`awake_cost_per_success`, idle awake time
included); `added_ttft_p95_s` is filled in by the caller against the always-awake row of
the same routing and residency (`api.py`).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from appliance.domain.kv_events import KvEvent
from appliance.perf.profile import WakeTimes
from appliance.policy.worker_power import (
    PowerSettings,
    PowerState,
    PowerTable,
    WakeKind,
    WorkerPower,
    choose_wake,
    decide_power,
    power_table,
)
from appliance.replay.closed_loop import TaskOutcome
from appliance.sim.core.engine import SimEngine
from appliance.sim.engine_io import SimRequest, StepResult
from appliance.sim.runtime.engine_views import EngineView, Route

MODEL = "replay"
GIB = 1 << 30
ALWAYS_AWAKE = "always-awake"
_WAKING = "waking"


@dataclass(frozen=True, slots=True)
class ReaperSetting:
    """One `--worker-reaper IDLE_S[:MAX_WAKE_S[:MIN_AWAKE]]` (no idle time: always awake)."""

    worker_idle_s: float | None = None
    max_wake_s: float = math.inf
    min_awake: int = 0

    @property
    def label(self) -> str:
        if self.worker_idle_s is None:
            return ALWAYS_AWAKE
        parts = [f"{self.worker_idle_s:g}"]
        if self.max_wake_s != math.inf or self.min_awake:
            parts.append(f"{self.max_wake_s:g}")
        if self.min_awake:
            parts.append(str(self.min_awake))
        return ":".join(parts)

    @property
    def settings(self) -> PowerSettings:
        return PowerSettings(self.worker_idle_s, self.max_wake_s, self.min_awake)


def parse_worker_reaper(text: str) -> ReaperSetting:
    """`IDLE_S[:MAX_WAKE_S[:MIN_AWAKE]]`; ValueError naming the form."""
    parts = text.split(":")
    try:
        if not 1 <= len(parts) <= 3:
            raise ValueError(text)
        idle = float(parts[0])
        wake = float(parts[1]) if len(parts) > 1 and parts[1] else math.inf
        keep = int(parts[2]) if len(parts) > 2 else 0
        PowerSettings(idle, wake, keep)  # checks the values
    except ValueError:
        raise ValueError(
            f"--worker-reaper {text!r}: give IDLE_S[:MAX_WAKE_S[:MIN_AWAKE]], e.g. 60 or 60:5"
        ) from None
    return ReaperSetting(idle, wake, keep)


def sim_power_table(wake: WakeTimes, kv_bytes: int) -> PowerTable:
    """The simulated workers' states (all four) with the profile's wake times."""
    seconds = (wake.asleep_1.seconds, wake.asleep_2.seconds, wake.stopped.seconds)
    return power_table(seconds, wake.weights_bytes, kv_bytes)


class SleepyEngine(SimEngine):
    """A simulated engine that schedules nothing until `ready_s` (a wake under way)."""

    ready_s = 0.0

    def step(self, now: float) -> StepResult:
        if now < self.ready_s:
            return StepResult(self.ready_s - now, [], [], 0, idle_until_s=self.ready_s)
        return super().step(now)


@dataclass(slots=True)
class _PoweredWorker:
    state: PowerState = PowerState.AWAKE
    since_s: float = 0.0
    ready_s: float | None = None
    """While waking: when the wake is over."""
    idle_since_s: float | None = 0.0


class WorkerReaper:
    """One replay's worker reaper: wraps the router (`route`), watches steps (`on_step`),
    and sums each worker's time per state (`summary`)."""

    def __init__(
        self,
        engines: Sequence[SimEngine],
        setting: ReaperSetting,
        table: PowerTable,
        on_events: Callable[[int, float, list[KvEvent]], None],
    ) -> None:
        self.engines, self.setting, self.table = engines, setting, table
        self.on_events = on_events
        self.workers = [_PoweredWorker() for _ in engines]
        self.seconds: Counter[str] = Counter()
        self.sleeps: Counter[str] = Counter()
        self.wakes = 0
        self.waited_turns = 0
        self.released_sessions = 0
        self.last_s = 0.0

    # --- the replay's callbacks ---

    def routed(self, route: Route) -> Route:
        """`route`, offered only the awake workers (or the one a turn waits for)."""

        def power_route(req: SimRequest, views: Sequence[EngineView]) -> int:
            now = req.arrival_s
            self.catch_up(now)
            choice = choose_wake(MODEL, self.views(now), self.table)
            awake = [v for v in views if self.workers[v.index].state is PowerState.AWAKE]
            offered = awake
            if choice.kind is WakeKind.MORE:
                self._wake(int(str(choice.worker_id)), now)
            elif choice.kind is not WakeKind.AWAKE:
                offered = [views[int(str(choice.worker_id))]]
            w = route(req, offered)
            self._busy(w, now)
            return w

        return power_route

    def on_step(self, i: int, now: float, result: StepResult) -> None:
        if not self.engines[i].has_unfinished_requests():
            worker = self.workers[i]
            worker.idle_since_s = now if worker.idle_since_s is None else worker.idle_since_s

    # --- the policy's view and its decisions ---

    def views(self, now: float) -> list[WorkerPower]:
        out = []
        for i, w in enumerate(self.workers):
            idle, stats = w.idle_since_s, self.engines[i].stats
            out.append(
                WorkerPower(
                    str(i),
                    MODEL,
                    w.state,
                    idle_s=now - idle if idle is not None else 0.0,
                    running=max(stats.num_running, int(idle is None)),
                    waiting=stats.num_waiting,
                    waking_left_s=None if w.ready_s is None else max(w.ready_s - now, 0.0),
                )
            )
        return out

    def catch_up(self, now: float) -> None:
        """Wakes that ended and sleeps that fell due up to `now`, each at its own time."""
        for i, w in enumerate(self.workers):
            if w.ready_s is not None and w.ready_s <= now:
                self._enter(i, PowerState.AWAKE, w.ready_s)
        idle_s = self.setting.worker_idle_s
        if idle_s is not None:
            due = sorted(
                {
                    max(w.idle_since_s + idle_s, self.last_s)
                    for w in self.workers
                    if w.idle_since_s is not None and w.state is PowerState.AWAKE
                }
            )
            for t in (t for t in due if t <= now):
                self._decide(t)
        self.last_s = max(self.last_s, now)

    def _decide(self, t: float) -> None:
        for d in decide_power(self.views(t), self.setting.settings, self.table):
            if d.target is not PowerState.AWAKE and self.workers[int(d.worker_id)].state is (
                PowerState.AWAKE
            ):
                self._sleep(int(d.worker_id), d.target, t)

    def _sleep(self, i: int, target: PowerState, t: float) -> None:
        """Release the worker's held sessions and drop its KV, then enter `target`."""
        engine = self.engines[i]
        cache = engine.cache
        for pin in cache.pins:
            cache.end_pin(pin.owner)
            self.released_sessions += 1
        cache.reset()
        if target is PowerState.STOPPED and engine.host is not None:
            engine.host.discard(engine.host.hashes())
        self.on_events(i, t, cache.take_events())
        self.sleeps[target.value] += 1
        self._enter(i, target, t)

    def _busy(self, i: int, now: float) -> None:
        """A turn was routed to worker `i`: it is busy, and wakes if it rests."""
        w = self.workers[i]
        if w.state is not PowerState.AWAKE and w.ready_s is None:
            self._wake(i, now)
        if w.ready_s is not None:
            self.waited_turns += 1
        w.idle_since_s = None

    def _wake(self, i: int, now: float) -> None:
        """Start worker `i`'s wake; it is idle from its end unless a turn comes."""
        w = self.workers[i]
        self._account(i, now)
        w.ready_s = w.idle_since_s = now + self.table.wake_s(w.state)
        engine = self.engines[i]
        if isinstance(engine, SleepyEngine):
            engine.ready_s = w.ready_s
        self.wakes += 1

    def _account(self, i: int, t: float) -> None:
        w = self.workers[i]
        self.seconds[_WAKING if w.ready_s is not None else w.state.value] += t - w.since_s
        w.since_s = t

    def _enter(self, i: int, state: PowerState, t: float) -> None:
        self._account(i, t)
        w = self.workers[i]
        w.state, w.ready_s = state, None

    # --- the row's figures ---

    def summary(self, end_s: float) -> dict[str, object]:
        """Time per state to `end_s` (GPU-hours), wakes, waits and releases."""
        self.catch_up(end_s)
        for i in range(len(self.workers)):
            self._account(i, max(end_s, self.workers[i].since_s))
        awake_s = self.seconds[PowerState.AWAKE.value] + self.seconds[_WAKING]
        asleep_s = self.seconds[PowerState.ASLEEP_1.value] + self.seconds[PowerState.ASLEEP_2.value]
        return {
            "setting": self.setting.label,
            "awake_gpu_h": round(awake_s / 3600, 4),
            "asleep_gpu_h": round(asleep_s / 3600, 4),
            "stopped_gpu_h": round(self.seconds[PowerState.STOPPED.value] / 3600, 4),
            "waking_gpu_h": round(self.seconds[_WAKING] / 3600, 4),
            "wakes": self.wakes,
            "waited_turns": self.waited_turns,
            "released_sessions": self.released_sessions,
            "sleeps": dict(sorted(self.sleeps.items())),
            "awake_gpu_s": round(awake_s, 3),
            "added_ttft_p95_s": None,
            "awake_cost_per_success": None,
        }


def awake_cost_per_success(
    power: dict[str, object], outcomes: Sequence[TaskOutcome], *, gpu_second: float
) -> float | None:
    """Awake GPU-seconds (idle and waking included) priced per GPU-second, over the root
    tasks that succeeded verified (None: none did)."""
    wins = sum(
        1 for o in outcomes if o.parent_id is None and o.completed and o.succeeds and o.verified
    )
    awake_s = power["awake_gpu_s"]
    assert isinstance(awake_s, float | int)
    return round(awake_s * gpu_second / wins, 8) if wins else None
