"""Engine workers as plain values: lifecycle states, supervisor events, load readings.

Model of the world: a worker is one vLLM server (one process group) the appliance routes
to. It is STARTING until its /health answers, then HEALTHY. A process that exits on its own
is EXITED; the supervisor waits an exponential backoff (`restart_backoff_s`) and starts it
again (STARTING), or gives up after too many failed starts in a row (FAILED). A HEALTHY
worker whose /health stops answering is UNHEALTHY until it answers again or is restarted.
On shutdown a worker is DRAINING (the router stops sending it new requests, running ones
finish) and then STOPPED. An external worker (not started by the appliance) only moves
between HEALTHY and UNHEALTHY.

Scale to zero adds two states and a way back from STOPPED. An idle HEALTHY worker started
with vLLM's sleep mode may be put ASLEEP (level 1: weights in host memory; level 2: weights
discarded; either way its KV cache is gone); any idle worker may be STOPPED on purpose (its
process ended, which is not a crash: nothing restarts it). Waking either is WAKING (a
/wake_up, or a new process starting) and then HEALTHY again; a wake that fails leaves it
where it was. `WorkerPowerState` is the coarse view of all states the admin API shows:
awake, asleep, stopped or waking.

A LoadSnapshot is one scrape of a worker's /metrics: gauges as read, counters cumulative
since the engine started (a restart resets them; `LoadSnapshot.since` then returns the new
values as they are).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum

from appliance.domain.records import WorkerId

WORKER_KEEPALIVE_S = 300
"""Seconds a worker the appliance starts keeps an idle connection open (vLLM's
VLLM_HTTP_TIMEOUT_KEEP_ALIVE, the simulator's uvicorn). Well above any tool wait between
turns, so a turn reuses a connection instead of opening one: a new connection cost up to
150 ms of a busy worker's event loop at 200 sessions (benchmarks/router_overhead.py)."""

UVICORN_KEEPALIVE_S = 5
"""uvicorn's default, so a vLLM server's the appliance did not start."""


class WorkerState(StrEnum):
    STARTING = "starting"
    HEALTHY = "healthy"
    UNHEALTHY = "unhealthy"
    EXITED = "exited"
    DRAINING = "draining"
    STOPPED = "stopped"
    """The process ended on purpose: at shutdown, or stopped idle (then it can be woken)."""
    FAILED = "failed"
    ASLEEP = "asleep"
    """The process runs, sleeping (vLLM's sleep mode): no KV, weights offloaded or gone."""
    WAKING = "waking"
    """Coming back from ASLEEP (/wake_up) or from STOPPED (a new process starting)."""


TRANSITIONS: Mapping[WorkerState, frozenset[WorkerState]] = {
    WorkerState.STARTING: frozenset(
        {WorkerState.HEALTHY, WorkerState.EXITED, WorkerState.DRAINING, WorkerState.FAILED}
    ),
    WorkerState.HEALTHY: frozenset(
        {
            WorkerState.UNHEALTHY,
            WorkerState.EXITED,
            WorkerState.DRAINING,
            WorkerState.ASLEEP,
            WorkerState.STOPPED,
        }
    ),
    WorkerState.UNHEALTHY: frozenset(
        {WorkerState.HEALTHY, WorkerState.EXITED, WorkerState.DRAINING, WorkerState.STOPPED}
    ),
    WorkerState.EXITED: frozenset({WorkerState.STARTING, WorkerState.FAILED, WorkerState.DRAINING}),
    WorkerState.DRAINING: frozenset({WorkerState.STOPPED}),
    WorkerState.STOPPED: frozenset({WorkerState.WAKING}),
    WorkerState.FAILED: frozenset({WorkerState.STOPPED}),
    WorkerState.ASLEEP: frozenset(
        {WorkerState.WAKING, WorkerState.STOPPED, WorkerState.EXITED, WorkerState.DRAINING}
    ),
    WorkerState.WAKING: frozenset(
        {
            WorkerState.HEALTHY,
            WorkerState.ASLEEP,
            WorkerState.STOPPED,
            WorkerState.EXITED,
            WorkerState.DRAINING,
        }
    ),
}
"""Every allowed move; anything else is a bug in the supervisor."""


def can_move(current: WorkerState, new: WorkerState) -> bool:
    return new == current or new in TRANSITIONS[current]


def accepts_requests(state: WorkerState) -> bool:
    """Whether the router may send this worker a new request."""
    return state == WorkerState.HEALTHY


AT_REST = frozenset({WorkerState.ASLEEP, WorkerState.STOPPED, WorkerState.WAKING})
"""Put to rest on purpose (asleep, or stopped idle) or on the way back from it: not serving
now, yet no fault: the next turn wakes it."""


def can_serve(state: WorkerState, draining: bool) -> bool:
    """Whether the worker serves a turn now or once woken: HEALTHY, or AT_REST while the
    appliance is not shutting down (`draining`: a STOPPED worker then is the end, not a
    rest). `/health` is ok while any worker can: a box whose workers all sleep is healthy.
    A worker that crashed (EXITED, STARTING again) or gave up (FAILED) cannot."""
    return not draining and (state == WorkerState.HEALTHY or state in AT_REST)


class WorkerPowerState(StrEnum):
    """What a worker costs and how soon it can serve: the admin API's `state`."""

    AWAKE = "awake"
    ASLEEP = "asleep"
    STOPPED = "stopped"
    WAKING = "waking"


_POWER = {
    WorkerState.STARTING: WorkerPowerState.WAKING,
    WorkerState.WAKING: WorkerPowerState.WAKING,
    WorkerState.HEALTHY: WorkerPowerState.AWAKE,
    WorkerState.UNHEALTHY: WorkerPowerState.AWAKE,
    WorkerState.DRAINING: WorkerPowerState.AWAKE,
    WorkerState.ASLEEP: WorkerPowerState.ASLEEP,
    WorkerState.EXITED: WorkerPowerState.STOPPED,
    WorkerState.STOPPED: WorkerPowerState.STOPPED,
    WorkerState.FAILED: WorkerPowerState.STOPPED,
}


def power_state(state: WorkerState) -> WorkerPowerState:
    """The coarse view of a lifecycle state: a process that holds its GPU and serves or
    will (awake), one sleeping (asleep), none (stopped), or one on its way up (waking)."""
    return _POWER[state]


@dataclass(frozen=True, slots=True)
class PowerChange:
    """One sleep, stop or wake of a worker as it happened, with how long it took."""

    worker: WorkerId
    before: WorkerState
    after: WorkerState
    duration_s: float
    """Measured: from the request (or the first wake call) to the state `after`."""
    level: int | None = None
    """The sleep level put to (sleep) or woken from (wake); None for a stop or a start."""
    spawned: bool = False
    """Whether a process was started (a wake from STOPPED)."""


class WorkerEventKind(StrEnum):
    STARTED = "started"
    """The process was spawned (`pid` set); `restarts` > 0 when it is a restart."""
    HEALTHY = "healthy"
    """/health answered 200 after a start; `detail` says how long the start took."""
    UNHEALTHY = "unhealthy"
    RECOVERED = "recovered"
    EXITED = "exited"
    """The process ended without being asked to (`exit_code`; negative: killed by a signal)."""
    RESTART_SCHEDULED = "restart_scheduled"
    """A restart will start after `backoff_s`."""
    GAVE_UP = "gave_up"
    """Too many failed starts in a row: the worker stays FAILED."""
    DRAINING = "draining"
    STOPPED = "stopped"
    SLEPT = "slept"
    """Put to sleep on request (`level`, `duration_s`); its KV is gone."""
    STOPPED_ON_REQUEST = "stopped_on_request"
    """Its process ended on request while the appliance runs (`duration_s`); its KV is gone
    and nothing restarts it until it is woken."""
    WAKE_STARTED = "wake_started"
    """A wake began (`level`: from that sleep; None: from stopped, a new process)."""
    WOKEN = "woken"
    """Awake again (`duration_s`: the measured wake, `level` as WAKE_STARTED's)."""
    WAKE_FAILED = "wake_failed"
    """The wake did not bring it up (`detail` says why); it stays where it was."""


@dataclass(frozen=True, slots=True)
class WorkerEvent:
    """One thing that happened to a worker, for the ledger and the log."""

    worker: WorkerId
    kind: WorkerEventKind
    time: float
    """Unix seconds."""
    state: WorkerState
    """The worker's state after the event."""
    restarts: int = 0
    """Restarts of this worker since the supervisor started it."""
    pid: int | None = None
    exit_code: int | None = None
    backoff_s: float | None = None
    detail: str = ""
    duration_s: float | None = None
    """How long a sleep, stop or wake took."""
    level: int | None = None
    """The sleep level of a SLEPT, WAKE_STARTED or WOKEN event."""


def restart_backoff_s(failures: int, *, base_s: float = 1.0, cap_s: float = 30.0) -> float:
    """The wait before restart number `failures` (1 = first) in a row: base, 2*base, ... cap."""
    if failures < 1:
        return 0.0
    return float(min(cap_s, base_s * 2.0 ** min(failures - 1, 62)))


@dataclass(frozen=True, slots=True)
class LoadSnapshot:
    """One reading of a worker's /metrics. Counters count tokens (or events) since its start."""

    time: float
    running: int
    waiting: int
    kv_cache_usage_perc: float
    """Fraction of the KV cache in use, 0..1 (vLLM's name keeps "perc")."""
    prefix_cache_queries_tokens: int = 0
    prefix_cache_hits_tokens: int = 0
    preemptions: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    prompt_tokens_by_source: Mapping[str, int] = field(default_factory=dict)
    """e.g. local_compute, local_cache_hit, external_kv_transfer."""
    prompt_tokens_cached_by_source: Mapping[str, int] = field(default_factory=dict)
    """e.g. device, host, p2p, disk, external_unspecified."""
    ttft_sum_s: float = 0.0
    ttft_count: int = 0
    prefill_sum_s: float = 0.0
    """Finished requests' seconds in prefill (first scheduling to first token), summed."""
    prefill_count: int = 0
    """Finished requests behind `prefill_sum_s` and the two token sums below."""
    prefill_fresh_tokens: int = 0
    """Their prompt tokens computed in prefill (not found in any cache)."""
    prefill_prompt_tokens: int = 0
    """Their prompt tokens, cached ones included."""
    kv_capacity_tokens: int | None = None
    """Tokens its KV pool holds: vLLM's `cache_config_info` (num_gpu_blocks less the null
    block, times block_size, summed over its engines); None when it does not say."""

    @property
    def prefix_hit_rate(self) -> float | None:
        """Hit tokens over queried tokens since the engine started; None before any query."""
        if self.prefix_cache_queries_tokens <= 0:
            return None
        return self.prefix_cache_hits_tokens / self.prefix_cache_queries_tokens

    @property
    def mean_prefill(self) -> tuple[int, int] | None:
        """The finished requests' mean prompt tokens computed in prefill (fresh) and in
        all, (fresh, prompt); None before any finished."""
        n = self.prefill_count
        if n <= 0:
            return None
        return self.prefill_fresh_tokens // n, self.prefill_prompt_tokens // n

    @property
    def busy(self) -> bool:
        return self.running + self.waiting > 0

    def since(self, earlier: LoadSnapshot) -> LoadSnapshot:
        """Counters as increments over `earlier` (gauges as now). A counter that went back
        means the engine restarted in between: the current values are the increments."""
        restarted = (
            self.prefix_cache_queries_tokens < earlier.prefix_cache_queries_tokens
            or self.prompt_tokens < earlier.prompt_tokens
        )
        if restarted:
            return self

        def diff(now: Mapping[str, int], then: Mapping[str, int]) -> dict[str, int]:
            return {k: v - then.get(k, 0) for k, v in now.items()}

        return LoadSnapshot(
            time=self.time,
            running=self.running,
            waiting=self.waiting,
            kv_cache_usage_perc=self.kv_cache_usage_perc,
            prefix_cache_queries_tokens=self.prefix_cache_queries_tokens
            - earlier.prefix_cache_queries_tokens,
            prefix_cache_hits_tokens=self.prefix_cache_hits_tokens
            - earlier.prefix_cache_hits_tokens,
            preemptions=self.preemptions - earlier.preemptions,
            prompt_tokens=self.prompt_tokens - earlier.prompt_tokens,
            generation_tokens=self.generation_tokens - earlier.generation_tokens,
            prompt_tokens_by_source=diff(
                self.prompt_tokens_by_source, earlier.prompt_tokens_by_source
            ),
            prompt_tokens_cached_by_source=diff(
                self.prompt_tokens_cached_by_source, earlier.prompt_tokens_cached_by_source
            ),
            ttft_sum_s=self.ttft_sum_s - earlier.ttft_sum_s,
            ttft_count=self.ttft_count - earlier.ttft_count,
            prefill_sum_s=self.prefill_sum_s - earlier.prefill_sum_s,
            prefill_count=self.prefill_count - earlier.prefill_count,
            prefill_fresh_tokens=self.prefill_fresh_tokens - earlier.prefill_fresh_tokens,
            prefill_prompt_tokens=self.prefill_prompt_tokens - earlier.prefill_prompt_tokens,
            kv_capacity_tokens=self.kv_capacity_tokens,
        )


@dataclass(frozen=True, slots=True)
class WorkerStatus:
    """What the state snapshot shows of one worker (`/admin/v1/state` "workers")."""

    id: WorkerId
    engine: str
    """"vllm" (started by the appliance) or "external"."""
    url: str
    gpus: tuple[int, ...]
    state: WorkerState
    draining: bool
    restarts: int
    pid: int | None = None
    load: LoadSnapshot | None = None
    sleep_level: int | None = None
    """1 or 2 while ASLEEP, else None."""
    last_wake_s: float | None = None
    """Its latest wake's measured seconds (None: never woken)."""

    @property
    def healthy(self) -> bool:
        return self.state == WorkerState.HEALTHY

    @property
    def power(self) -> WorkerPowerState:
        """awake, asleep, stopped or waking: the admin API's `state`."""
        return power_state(self.state)
