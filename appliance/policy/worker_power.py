"""Worker power: which idle workers sleep or stop, and which one wakes when a turn needs one.

Model of the world: a worker is in one of four resting states, each with a wake time (how
long until it serves again) and what it holds while in it (`StateFigures`):

    awake     serving: weights and KV pool in GPU memory                    wake 0
    asleep-1  vLLM sleep level 1: weights copied to host memory, KV dropped  wake = copy back
    asleep-2  vLLM sleep level 2: weights and KV discarded                   wake = reload
    stopped   the worker process ended (works everywhere, the CPU build too) wake = restart

and, between a resting state and awake, `waking` (a wake under way, `waking_left_s`). The
figures are the caller's data (the GPU profile's wake times; a platform supports a subset:
vLLM's CPU build has no sleep mode, so `CPU_VLLM_STATES`).

The reaper's rule (`decide_power`), per worker group and its `worker_reaper:` settings: a
worker that is awake and idle (no running, waiting or held work: `held` counts the turns the
appliance holds for it) for at least `worker_idle_s` goes to the cheapest supported state
whose wake time is at most `max_wake_s`, cheapest meaning the least GPU memory held, then
the least host memory, then the faster wake. Of each model, `min_awake` workers stay
awake: the awake (and waking) workers that are not candidates count first, then the
candidates idle the shortest (their caches the warmest), ties by id. Held session KV on a
worker about to sleep is the caller's to release (or demote) first: sleep drops the KV.

Waking (`choose_wake`): a turn for a model with an awake worker needs no wake, unless every
awake worker has turns waiting (all saturated) and none is waking: then the fastest resting
worker wakes to add capacity (`MORE`) while the turn queues on an awake one. With none
awake but one waking, the turn waits for it (the soonest awake, ties by id) rather than
waking another; otherwise the worker fastest to wake does (ties by id). `wake_delay_s` is
what admission adds to the turn's expected time to first token: 0, the rest of a wake
under way, or a whole wake.

Pure: no clock (idle and waking times are arguments), no I/O. Every decision carries a
`kind` from a fixed set (metric labels), a sentence (`reason`) and its numbers.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum


class PowerState(StrEnum):
    """A worker's resting state (values as the ledger and the metrics name them)."""

    AWAKE = "awake"
    ASLEEP_1 = "asleep-1"
    """vLLM sleep level 1: weights offloaded to host memory, KV cache discarded."""
    ASLEEP_2 = "asleep-2"
    """vLLM sleep level 2: weights and KV cache discarded (reloaded on wake)."""
    STOPPED = "stopped"
    """The worker process ended; waking starts it again."""

    @property
    def shown(self) -> str:
        """The state as `/admin/v1/state` shows it: awake, asleep or stopped."""
        return "asleep" if self.sleep_level is not None else self.value

    @property
    def sleep_level(self) -> int | None:
        """vLLM's `/sleep?level=` for an asleep state (None: not asleep)."""
        return _SLEEP_LEVEL.get(self)


_SLEEP_LEVEL = {PowerState.ASLEEP_1: 1, PowerState.ASLEEP_2: 2}
WAKING = "waking"
"""The shown state of a worker whose wake is under way."""
ALL_STATES = frozenset(PowerState)
"""Every state: the simulated engine, and vLLM's CUDA build with `--enable-sleep-mode`."""
CPU_VLLM_STATES = frozenset({PowerState.AWAKE, PowerState.STOPPED})
"""vLLM's CPU build: no sleep mode, so a worker is awake or stopped."""


@dataclass(frozen=True, slots=True)
class StateFigures:
    """One state: how long a worker in it takes to serve again, and what it holds."""

    wake_s: float
    gpu_bytes: int = 0
    """GPU memory held while in it (awake: weights and KV pool; asleep: the CUDA context)."""
    host_bytes: int = 0
    """Host memory held while in it (asleep-1: the weights)."""

    def __post_init__(self) -> None:
        if not self.wake_s >= 0 or self.gpu_bytes < 0 or self.host_bytes < 0:
            raise ValueError(f"state figures must not be negative: {self}")


@dataclass(frozen=True, slots=True)
class PowerTable:
    """The states a platform supports, with their figures (one per supported state)."""

    figures: Mapping[PowerState, StateFigures]
    supported: frozenset[PowerState] = ALL_STATES

    def __post_init__(self) -> None:
        if PowerState.AWAKE not in self.supported:
            raise ValueError("a platform that supports no awake state serves nothing")
        missing = sorted(self.supported - set(self.figures))
        if missing:
            raise ValueError(f"no figures for supported states: {', '.join(missing)}")

    def wake_s(self, state: PowerState) -> float:
        """Seconds from `state` to serving; ValueError for a state the platform lacks."""
        if state not in self.supported:
            raise ValueError(f"state {state} is not supported here")
        return self.figures[state].wake_s


ASLEEP_GPU_BYTES = 1 << 30
"""Judgement: what an asleep vLLM worker keeps on its GPU (CUDA context, allocator pools);
vLLM's sleep mode frees "90%+" of the GPU memory."""


def power_table(
    wake_s: tuple[float, float, float],
    weights_bytes: int,
    kv_bytes: int,
    supported: frozenset[PowerState] = ALL_STATES,
) -> PowerTable:
    """The four states with the wake times (asleep-1, asleep-2, stopped) and what each
    holds: awake the weights and the KV pool; asleep-1 a GPU context and the weights in host
    memory; asleep-2 the context; stopped nothing."""
    one, two, stopped = wake_s
    figures = {
        PowerState.AWAKE: StateFigures(0.0, weights_bytes + kv_bytes),
        PowerState.ASLEEP_1: StateFigures(one, ASLEEP_GPU_BYTES, weights_bytes),
        PowerState.ASLEEP_2: StateFigures(two, ASLEEP_GPU_BYTES),
        PowerState.STOPPED: StateFigures(stopped),
    }
    return PowerTable(figures, supported)


@dataclass(frozen=True, slots=True)
class PowerSettings:
    """One worker group's `worker_reaper:` settings."""

    worker_idle_s: float | None = None
    """Idle seconds before an awake worker sleeps or stops (None: always awake)."""
    max_wake_s: float = math.inf
    """The longest wake a state of this group may take."""
    min_awake: int = 0
    """Workers of each model kept awake however idle."""

    def __post_init__(self) -> None:
        if self.worker_idle_s is not None and not self.worker_idle_s >= 0:
            raise ValueError(f"worker_idle_s must not be negative, got {self.worker_idle_s}")
        if not self.max_wake_s >= 0 or self.min_awake < 0:
            raise ValueError("max_wake_s and min_awake must not be negative")


@dataclass(frozen=True, slots=True)
class WorkerPower:
    """One worker as the reaper sees it now."""

    worker_id: str
    model: str
    state: PowerState
    idle_s: float = 0.0
    """Seconds since it last had running, waiting or held work (0 while it has some)."""
    running: int = 0
    waiting: int = 0
    held: int = 0
    """Turns the appliance holds for it: queued by admission, or waiting for its wake."""
    waking_left_s: float | None = None
    """A wake from `state` is under way and ends in this many seconds (None: none is)."""

    def __post_init__(self) -> None:
        if self.waking_left_s is not None and (
            self.state is PowerState.AWAKE or self.waking_left_s < 0
        ):
            raise ValueError(f"worker {self.worker_id}: only a resting worker wakes, in >= 0 s")

    @property
    def busy(self) -> bool:
        return self.running + self.waiting + self.held > 0

    @property
    def shown_state(self) -> str:
        """awake, asleep, stopped or waking (`/admin/v1/state`)."""
        return WAKING if self.waking_left_s is not None else self.state.shown


class PowerAction(StrEnum):
    STAY = "stay"
    SLEEP = "sleep"
    STOP = "stop"


class PowerKind(StrEnum):
    """Why a worker stays or goes, as one of a fixed set (metric labels, counts)."""

    DISABLED = "disabled"
    """The group has no `worker_idle_s`: always awake."""
    NOT_AWAKE = "not_awake"
    """Asleep, stopped or waking already: nothing to decide."""
    BUSY = "busy"
    IDLE_TOO_SHORT = "idle_too_short"
    MIN_AWAKE = "min_awake"
    NO_STATE_FITS = "no_state_fits"
    """No supported state wakes within `max_wake_s`."""
    CHEAPEST_FIT = "cheapest_fit"


@dataclass(frozen=True, slots=True)
class PowerDecision:
    """What becomes of one worker: `target` is the state to be in (its own to stay)."""

    worker_id: str
    target: PowerState
    kind: PowerKind
    reason: str
    idle_s: float
    worker_idle_s: float | None
    max_wake_s: float
    wake_s: float
    """The target's wake time."""
    recheck_in_s: float | None = None
    """Idle too short: the seconds until it reaches `worker_idle_s` (ask again then)."""

    @property
    def action(self) -> PowerAction:
        if self.kind is not PowerKind.CHEAPEST_FIT:
            return PowerAction.STAY
        return PowerAction.STOP if self.target is PowerState.STOPPED else PowerAction.SLEEP


def sleep_target(max_wake_s: float, table: PowerTable) -> PowerState | None:
    """The cheapest supported state other than awake that wakes within `max_wake_s`: the
    least GPU memory held, then host memory, then the faster wake (None: none fits)."""
    fits = [s for s in table.supported - {PowerState.AWAKE} if table.wake_s(s) <= max_wake_s]
    if not fits:
        return None
    return min(fits, key=lambda s: _cost_key(s, table))


def _cost_key(state: PowerState, table: PowerTable) -> tuple[int, int, float, int]:
    f = table.figures[state]
    return (f.gpu_bytes, f.host_bytes, f.wake_s, _ORDER.index(state))


_ORDER = tuple(PowerState)


def decide_power(
    workers: Sequence[WorkerPower], settings: PowerSettings, table: PowerTable
) -> tuple[PowerDecision, ...]:
    """One decision per worker of a group, in their order (see the module)."""
    idle_s = settings.worker_idle_s
    target = sleep_target(settings.max_wake_s, table)
    kept = _kept_awake(workers, settings) if idle_s is not None else set()
    return tuple(_decide_one(w, settings, table, target, w.worker_id in kept) for w in workers)


def _candidate(w: WorkerPower, worker_idle_s: float) -> bool:
    """Awake (so not waking: only a resting worker wakes), idle, for long enough."""
    return w.state is PowerState.AWAKE and not w.busy and w.idle_s >= worker_idle_s


def _kept_awake(workers: Sequence[WorkerPower], settings: PowerSettings) -> set[str]:
    """Candidates kept awake so that each model keeps `min_awake` awake or waking workers."""
    assert settings.worker_idle_s is not None
    kept: set[str] = set()
    for model in sorted({w.model for w in workers}):
        mine = [w for w in workers if w.model == model]
        up = [w for w in mine if w.state is PowerState.AWAKE or w.waking_left_s is not None]
        candidates = [w for w in up if _candidate(w, settings.worker_idle_s)]
        short = settings.min_awake - (len(up) - len(candidates))
        ranked = sorted(candidates, key=lambda w: (w.idle_s, w.worker_id))
        kept.update(w.worker_id for w in ranked[: max(short, 0)])
    return kept


def _decide_one(
    w: WorkerPower,
    settings: PowerSettings,
    table: PowerTable,
    target: PowerState | None,
    kept: bool,
) -> PowerDecision:
    idle_s, limit = settings.worker_idle_s, settings.max_wake_s

    def stay(kind: PowerKind, reason: str, recheck_in_s: float | None = None) -> PowerDecision:
        return PowerDecision(
            w.worker_id, w.state, kind, reason, w.idle_s, idle_s, limit, 0.0, recheck_in_s
        )

    if idle_s is None:
        return stay(PowerKind.DISABLED, "no worker_idle_s: always awake")
    if w.state is not PowerState.AWAKE:  # asleep, stopped, or waking from one of them
        return stay(PowerKind.NOT_AWAKE, f"{w.shown_state}: nothing to decide")
    if w.busy:
        work = f"{w.running} running, {w.waiting} waiting, {w.held} held"
        return stay(PowerKind.BUSY, f"busy: {work}")
    if w.idle_s < idle_s:
        left = idle_s - w.idle_s
        return stay(PowerKind.IDLE_TOO_SHORT, f"idle {w.idle_s:g} s of {idle_s:g} s", left)
    if kept:
        return stay(PowerKind.MIN_AWAKE, f"kept awake: min_awake {settings.min_awake}")
    if target is None:
        return stay(PowerKind.NO_STATE_FITS, f"no supported state wakes within {limit:g} s")
    wake_s = table.wake_s(target)
    reason = (
        f"idle {w.idle_s:g} s >= {idle_s:g} s: {target} is the cheapest state that wakes "
        f"within {limit:g} s ({wake_s:g} s)"
    )
    return PowerDecision(
        w.worker_id, target, PowerKind.CHEAPEST_FIT, reason, w.idle_s, idle_s, limit, wake_s
    )


class WakeKind(StrEnum):
    """What a turn for a model needs of its workers."""

    AWAKE = "awake"
    """One is awake: no wake."""
    MORE = "more"
    """Every awake worker has turns waiting: the fastest resting one wakes for the next
    turns; this one goes to an awake worker."""
    WAIT = "wait"
    """One is waking: the turn waits for it."""
    WAKE = "wake"
    """None is awake or waking: the fastest to wake wakes."""
    NO_WORKER = "no_worker"
    """The model has no worker at all."""


@dataclass(frozen=True, slots=True)
class WakeChoice:
    """The worker a turn waits for (None: no wake needed, or no worker), and how long."""

    kind: WakeKind
    worker_id: str | None
    added_s: float
    """Seconds the wait adds to the turn's time to first token."""
    reason: str
    from_state: PowerState | None = field(default=None)
    """The state a WAKE or WAIT worker is leaving."""


def choose_wake(model: str, workers: Sequence[WorkerPower], table: PowerTable) -> WakeChoice:
    """The worker a turn for `model` waits for (see the module)."""
    mine = [w for w in workers if w.model == model]
    awake = [w for w in mine if w.state is PowerState.AWAKE]
    waking = [w for w in mine if w.waking_left_s is not None]
    resting = [w for w in mine if w.state is not PowerState.AWAKE and w.waking_left_s is None]
    if awake:
        if waking or not resting or any(w.waiting == 0 for w in awake):
            return WakeChoice(WakeKind.AWAKE, None, 0.0, f"a worker of {model} is awake")
        w = min(resting, key=lambda w: (table.wake_s(w.state), w.worker_id))
        reason = (
            f"all {len(awake)} awake workers have turns waiting: wakes {w.worker_id} from "
            f"{w.state} ({table.wake_s(w.state):g} s)"
        )
        return WakeChoice(WakeKind.MORE, w.worker_id, 0.0, reason, w.state)
    if waking:
        w = min(waking, key=lambda w: (w.waking_left_s, w.worker_id))
        left = w.waking_left_s
        assert left is not None
        return WakeChoice(
            WakeKind.WAIT, w.worker_id, left, f"waits {left:g} s for {w.worker_id}", w.state
        )
    if not mine:
        return WakeChoice(WakeKind.NO_WORKER, None, 0.0, f"no worker serves {model}")
    w = min(mine, key=lambda w: (table.wake_s(w.state), w.worker_id))
    wake_s = table.wake_s(w.state)
    reason = f"wakes {w.worker_id} from {w.state}: {wake_s:g} s"
    return WakeChoice(WakeKind.WAKE, w.worker_id, wake_s, reason, w.state)


def wake_delay_s(model: str, workers: Sequence[WorkerPower], table: PowerTable) -> float:
    """What admission adds to a turn's expected time to first token for its wake: 0 with a
    worker awake, the rest of a wake under way, else the fastest worker's wake time."""
    return choose_wake(model, workers, table).added_s
