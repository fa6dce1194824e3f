"""One snapshot of the running appliance, for `/admin/v1/state` and the console, and the
appliance's own `/metrics`.

Every number comes from a source of truth the appliance holds: worker readings (health,
/metrics), the GPU probe's latest tick, the router's sessions (resident tokens by tier from
the KV index, held ones from the workers' retention connectors: `services/residency/session_kv.py`),
the task book, and the router's own counters. Nothing is estimated here. Beside them: the
operator's event feed (newest first), each session's residency decision (an operator's
release until its next turn, else the idle reaper's), the idle reaper's status, and the
cost-per-success series, which every snapshot extends. Under the simulated engine the GPU
probe is the simulator's model, and `gpu_driver` says so.

`snapshot` gathers these facts as a `StateSnapshot`; the API publishes it as the document
the console reads (appliance/api/admin/state_document.py builds its `AdminStateView`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from appliance.domain.gpu import GpuSnapshot
from appliance.domain.records import TaskId, WorkerId
from appliance.domain.worker import WorkerPowerState, WorkerStatus
from appliance.policy.costs import (
    GROUP_KEYS,
    AttemptRow,
    TaskRow,
    cost_per_success,
    group_row,
)
from appliance.policy.overhead import spread_overhead
from appliance.services.operator.cost_series import CostSeries, overall
from appliance.services.operator.events import EventFeed
from appliance.services.operator.histogram import PromHistogram
from appliance.services.residency.branch_kv import TaskKv, task_kv, task_kv_of
from appliance.services.residency.session_kv import SessionKv, SessionKvNow
from appliance.services.sessions.sessions import SessionState
from appliance.services.tasks.admission import AdmissionService
from appliance.services.tasks.task_state import TaskState
from appliance.services.tasks.tasks import TaskBook
from appliance.services.turns.turn_desk import TurnDesk
from appliance.services.workers.box_usage import BoxUsage, RecordedUsage
from appliance.services.workers.gpu_meter import GpuTime

EVENTS_SHOWN = 100


@dataclass
class StateSources:
    workers: Callable[[], Sequence[WorkerStatus]]
    desk: TurnDesk
    tasks: TaskBook
    gpus: Callable[[], GpuSnapshot | None]
    clock_now: Callable[[], float]
    kv_bytes_per_token: int
    currency: str
    events: EventFeed | None = None
    kv: SessionKv | None = None
    """Where each session's KV is, what was decided, and the idle reaper's status."""
    cost_series: CostSeries | None = None
    admission: AdmissionService | None = None
    wakes: PromHistogram | None = None
    """The worker reaper's measured wakes (None: it is off)."""
    kv_tokens: Callable[[WorkerId], int] | None = None
    """Tokens of KV the index holds on a worker's GPU now (None: not known)."""
    usage: BoxUsage | None = None
    """The box's usage periods the ledger acknowledged: the overhead (None: none kept)."""


@dataclass(frozen=True, slots=True)
class Fleet:
    """The workers, each one's measured prefill slowdown and KV tokens on its GPU, the GPU
    probe's latest tick, and the idle reaper's status."""

    workers: list[WorkerStatus]
    prefill_slowdown: dict[WorkerId, float]
    gpu: GpuSnapshot | None
    residency: dict[str, Any]
    kv_tokens: dict[WorkerId, int]
    gpu_time: dict[WorkerId, GpuTime]
    """Each worker's awake and busy GPU-seconds (empty when the router meters none)."""
    kv_bytes_per_token: int = 0
    """The KV bytes per token of the model every worker serves (appliance/start/served_kv.py)."""


@dataclass(frozen=True, slots=True)
class SessionView:
    """One session now: its prefix by tier (the most any one worker has: GPU, of it held,
    host; and the least any lacks: gone) and its residency decision."""

    session: SessionState
    resident_tokens: dict[str, int]
    resident_bytes: dict[str, int]
    idle_s: float
    decision: str | None
    reason: str
    held_until: float | None


@dataclass(frozen=True, slots=True)
class CostView:
    currency: str
    groups: list[dict[str, Any]]
    """Cost per successful task by task class and tenant (`cost_groups`)."""
    series: list[dict[str, Any]] | None
    """The cost-per-success series, oldest first; None: the appliance keeps none."""
    overhead: dict[str, Any] | None = None
    """The overhead the groups share (`RecordedUsage.summary`); None: none recorded."""


@dataclass(frozen=True, slots=True)
class StateSnapshot:
    """The facts at one instant. Sessions and tasks are the live objects, so the snapshot is
    published at once, on the event loop, before anything changes them."""

    time: float
    fleet: Fleet
    sessions: list[SessionView]
    tasks: list[TaskState]
    task_kv: dict[TaskId, TaskKv]
    """Per task in `tasks`: what of its sessions' KV is inherited, its own, reclaimed."""
    costs: CostView
    events: list[dict[str, Any]] | None
    """Newest first; None: the appliance keeps no event feed."""
    admission: dict[str, Any]
    """Admission's counters (`AdmissionService.snapshot`); empty without admission control."""
    routing: dict[str, int]
    """Turns placed by the router, by reason."""


def snapshot(src: StateSources) -> StateSnapshot:
    now = src.clock_now()
    kv = src.kv or SessionKv(src.desk.placer.residency)
    sessions = [session_view(s, now, src.kv_bytes_per_token, kv.now(s)) for s in src.desk.sessions]
    tasks = list(src.tasks)
    parents = {t.key: t.parent for t in tasks}
    listed = {id(v.session) for v in sessions}
    ended = [s for s in kv.watched() if id(s) not in listed and s.task_id is not None]
    with_kv = [(v.session, v.resident_tokens) for v in sessions]
    with_kv += [(s, kv.now(s).most()) for s in ended]  # gone from the table, not from the GPU
    held = task_kv(with_kv, parents.get, kv.branch_end)
    return StateSnapshot(
        time=now,
        fleet=_fleet(src),
        sessions=sessions,
        tasks=tasks,
        task_kv={t.key: task_kv_of(held, t.key, kv.branch_end(t.key)) for t in tasks},
        costs=_costs(src, now),
        events=src.events.recent(EVENTS_SHOWN) if src.events is not None else None,
        admission=src.admission.snapshot() if src.admission is not None else {},
        routing={str(why): n for why, n in src.desk.records.routed_by_reason.items()},
    )


def _fleet(src: StateSources) -> Fleet:
    workers = list(src.workers())
    slowdown = {w.id: src.desk.queues.slowdown(w.id) for w in workers}
    residency = src.kv.status() if src.kv is not None else {}
    resident = src.kv_tokens
    kv_tokens = {w.id: resident(w.id) for w in workers} if resident is not None else {}
    meter = src.desk.records.meter
    gpu_time = {w.id: meter.reading(w.id) for w in workers} if meter is not None else {}
    per_token = src.kv_bytes_per_token
    return Fleet(workers, slowdown, src.gpus(), residency, kv_tokens, gpu_time, per_token)


def _costs(src: StateSources, now: float) -> CostView:
    """The cost report now, with the overhead the ledger acknowledged spread over it by the
    GPU-seconds of this run's attempts; observing it extends the series."""
    recorded = src.usage.recorded() if src.usage is not None else None
    meter = src.desk.records.meter
    basis = meter.charged_s if meter is not None and recorded is not None else 0.0
    groups = cost_groups(src.tasks, src.currency, recorded, basis_gpu_s=basis)
    overhead = recorded.summary() if recorded is not None else None
    if src.cost_series is None:
        return CostView(src.currency, groups, None, overhead)
    src.cost_series.observe(now, *overall(groups))
    return CostView(src.currency, groups, src.cost_series.points(), overhead)


def session_view(
    s: SessionState, now: float, kv_bytes_per_token: int, kv: SessionKvNow
) -> SessionView:
    """One session as the state shows it (and `GET /admin/v1/sessions/{id}`); `kv` is where
    its KV is now and what was decided (`SessionKv.now`)."""
    tokens = kv.most()
    return SessionView(
        session=s,
        resident_tokens=tokens,
        resident_bytes={tier: n * kv_bytes_per_token for tier, n in tokens.items()},
        idle_s=round(max(0.0, now - s.last_active_at), 3) if not s.in_flight else 0.0,
        decision=kv.decision,
        reason=kv.reason,
        held_until=kv.held_until,
    )


def metrics_text(src: StateSources) -> str:
    """Prometheus text of the appliance's own metrics (`appliance_*`)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_ApplianceCollector(src))
    return generate_latest(registry).decode()


class _ApplianceCollector(Collector):
    def __init__(self, src: StateSources) -> None:
        self._src = src

    def collect(self) -> Iterator[Metric]:
        src, records = self._src, self._src.desk.records
        routed = CounterMetricFamily(
            "appliance_routed_turns", "Turns placed by the router, by reason.", labels=["reason"]
        )
        for reason, n in sorted(records.routed_by_reason.items()):
            routed.add_metric([reason], n)
        yield routed
        yield CounterMetricFamily(
            "appliance_predicted_cached_tokens",
            "Cached tokens the KV index predicted.",
            records.predicted_cached_total,
        )
        yield CounterMetricFamily(
            "appliance_cached_tokens",
            "Cached tokens the workers reported.",
            records.actual_cached_total,
        )
        yield CounterMetricFamily(
            "appliance_queue_seconds",
            "Seconds turns waited for their first byte.",
            records.first_byte_s_total,
        )
        yield GaugeMetricFamily(
            "appliance_sessions", "Sessions the router holds.", len(src.desk.sessions)
        )
        yield CounterMetricFamily(
            "appliance_process_cpu_seconds",
            "CPU seconds the appliance's process has used, every thread (the router's own "
            "cost: parsing, tokenising, placing, relaying, KV events, the ledger).",
            time.process_time(),
        )
        yield records.forward_s.family(
            "appliance_forward_seconds",
            "The router's own time per model turn, from the whole request having arrived to "
            "its forwarding to a worker (parsing, admission, placement, the worker body).",
        )
        slowdown = GaugeMetricFamily(
            "appliance_worker_prefill_slowdown",
            "A worker's measured prefill seconds per second of the GPU profile's "
            "(1 until measured).",
            labels=["worker"],
        )
        workers = list(src.workers())
        for w in workers:
            slowdown.add_metric([w.id], src.desk.queues.slowdown(w.id))
        yield slowdown
        yield from _gpu_time_families(src, workers)
        yield GaugeMetricFamily(
            "appliance_workers_healthy",
            "Workers that accept requests.",
            sum(1 for w in workers if w.healthy),
        )
        yield _power_family(workers)
        if src.wakes is not None:
            what = "Measured wakes of workers the worker reaper put to rest."
            yield src.wakes.family("appliance_worker_wake_seconds", what)
        if src.admission is not None:
            yield from src.admission.metric_families()


def _power_family(workers: Sequence[WorkerStatus]) -> Metric:
    """`appliance_worker_state{worker, state}`: 1 for each worker's power state now, 0 for
    the other three, so that a query sums or filters without knowing the states."""
    family = GaugeMetricFamily(
        "appliance_worker_state",
        "A worker's power state: 1 for the one it is in (awake, asleep, stopped, waking), "
        "0 for the others.",
        labels=["worker", "state"],
    )
    for w in workers:
        for power in WorkerPowerState:
            family.add_metric([w.id, power.value], 1.0 if w.power == power else 0.0)
    return family


def _gpu_time_families(src: StateSources, workers: Sequence[WorkerStatus]) -> Iterator[Metric]:
    meter = src.desk.records.meter
    if meter is None:
        return
    busy = CounterMetricFamily(
        "appliance_worker_gpu_busy_seconds",
        "A worker's GPU-seconds with a turn in flight (what the turns' gpu_s add up to).",
        labels=["worker"],
    )
    idle = CounterMetricFamily(
        "appliance_worker_gpu_idle_seconds",
        "A worker's GPU-seconds awake with no turn in flight (overhead).",
        labels=["worker"],
    )
    energy = CounterMetricFamily(
        "appliance_worker_gpu_energy_joules",
        "Joules a worker's GPUs drew (the GPU probe's power readings; simulated under the "
        "sim engine), asleep or awake.",
        labels=["worker"],
    )
    for w in workers:
        reading = meter.reading(w.id)
        busy.add_metric([w.id], reading.busy_s)
        idle.add_metric([w.id], reading.idle_s)
        joules = src.usage.energy.joules(w.id) if src.usage is not None else None
        if joules is not None:
            energy.add_metric([w.id], joules)
    yield busy
    yield idle
    yield energy


def cost_groups(
    tasks: TaskBook,
    currency: str,
    recorded: RecordedUsage | None = None,
    *,
    basis_gpu_s: float = 0.0,
) -> list[dict[str, Any]]:
    """Cost per successful task by task class and tenant over the tasks this run has seen,
    by the same rules as the ledger's report (children roll up into their root; the
    overhead spread by GPU-seconds), from the costs the ledger priced each attempt at and
    the usage periods it acknowledged. `basis_gpu_s`: the GPU-seconds of all this run's
    attempts, so tasks the book forgot keep their share out of the others'."""
    rows = [
        TaskRow(t.key, t.tenant, t.created_at, t.parent, t.task_class, t.status, t.verified)
        for t in tasks
    ]
    attempts = [
        AttemptRow(t.key, t.tenant, t.created_at, t.cost, attempts=t.turns, gpu_s=t.gpu_s)
        for t in tasks
        if t.turns
    ]
    groups = cost_per_success(rows, attempts)
    if recorded is not None:
        groups = spread_overhead(groups, recorded.overhead, basis_gpu_s=basis_gpu_s)
    return [group_row(g, by=GROUP_KEYS, currency=currency) for g in groups]
