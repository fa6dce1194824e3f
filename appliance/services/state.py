"""One snapshot of the running appliance for `/admin/v1/state`, the console and `/metrics`.

Every number comes from a source of truth the appliance holds: worker readings (health,
/metrics), the GPU probe's latest tick, the router's sessions (resident tokens from the KV
index), the task book, and the router's own counters. Nothing is estimated here. Beside
them: the operator's event feed (newest first), each session's release by an operator
(shown as its residency decision until its next turn), and the cost-per-success series,
which every snapshot extends. Under the simulated engine the GPU probe is the simulator's
model, and `gpu_driver` says so.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from appliance.domain.gpu import GpuSnapshot
from appliance.domain.records import WorkerId
from appliance.policy.costs import (
    GROUP_KEYS,
    AttemptRow,
    TaskRow,
    cost_per_success,
    group_row,
)
from appliance.ports import WorkerEndpoint
from appliance.services.admission import AdmissionService
from appliance.services.cost_series import CostSeries, overall
from appliance.services.events import EventFeed
from appliance.services.session_admin import RELEASE_REASON, RELEASED, Release, SessionReleases
from appliance.services.sessions import SessionState
from appliance.services.tasks import TaskBook
from appliance.services.turn_desk import TurnDesk

EVENTS_SHOWN = 100
NO_REAPER_REASON = "residency decisions arrive with the idle reaper"


@dataclass
class StateSources:
    workers: Callable[[], Sequence[WorkerEndpoint]]
    desk: TurnDesk
    tasks: TaskBook
    gpus: Callable[[], GpuSnapshot | None]
    clock_now: Callable[[], float]
    kv_bytes_per_token: int
    worker_info: Callable[[WorkerEndpoint], dict[str, Any]]
    """engine, url, gpus, restarts of a worker (they live on the concrete handle)."""
    currency: str
    events: EventFeed | None = None
    releases: SessionReleases | None = None
    cost_series: CostSeries | None = None
    admission: AdmissionService | None = None


def snapshot(src: StateSources) -> dict[str, Any]:
    now = src.clock_now()
    workers = []
    for w in src.workers():
        load = w.load
        workers.append(
            {
                "id": w.id,
                **src.worker_info(w),
                "healthy": w.healthy,
                "draining": w.draining,
                "running": load.running if load else None,
                "waiting": load.waiting if load else None,
                "kv_usage": load.kv_cache_usage_perc if load else None,
                "prefix_hit_rate": load.prefix_hit_rate if load else None,
                "prefill_slowdown": round(src.desk.queues.slowdown(w.id), 4),
            }
        )
    gpu = src.gpus()
    gpus = [
        {
            "index": g.index,
            "name": g.name,
            "mem_total_bytes": g.mem_total_bytes,
            "mem_used_bytes": g.mem_used_bytes,
            "util": g.util,
            "temp_c": g.temp_c,
            "power_w": g.power_w,
            "kv_bytes": g.kv_bytes,
        }
        for g in (gpu.gpus if gpu else ())
    ]
    releases = src.releases
    sessions = [
        session_row(
            s,
            now,
            src.kv_bytes_per_token,
            src.desk.placer.residency(s),
            releases.in_effect(s) if releases else None,
        )
        for s in src.desk.sessions
    ]
    tasks = [
        {
            "id": t.client_id,
            "parent_id": t.parent.split("/", 1)[-1] if t.parent else None,
            "tenant": t.tenant,
            "task_class": t.task_class,
            "status": t.status.value,
            "deadline_at": t.deadline_at,
            "tokens": t.prompt_tokens + t.output_tokens,
            "cost": t.cost,
            "children": [c.split("/", 1)[-1] for c in t.children],
        }
        for t in src.tasks
    ]
    groups = cost_groups(src.tasks, src.currency)
    costs: dict[str, Any] = {"currency": src.currency, "groups": groups}
    if src.cost_series is not None:
        src.cost_series.observe(now, *overall(groups))
        costs["series"] = src.cost_series.points()
    return {
        "time": now,
        "workers": workers,
        "gpus": gpus,
        "gpu_driver": gpu.driver if gpu else None,
        "sessions": sessions,
        "tasks": tasks,
        "costs": costs,
        "events": src.events.recent(EVENTS_SHOWN) if src.events is not None else None,
        "admission": src.admission.snapshot() if src.admission is not None else {},
        "routing": dict(src.desk.records.routed_by_reason),
    }


def session_row(
    s: SessionState,
    now: float,
    kv_bytes_per_token: int,
    residency: Mapping[str, Mapping[WorkerId, int]],
    release: Release | None = None,
) -> dict[str, Any]:
    """One session as the state shows it (and `GET /admin/v1/sessions/{id}`); `residency` is
    the KV index's view now (`Router.residency`): the most any one worker holds, per tier."""
    tokens = {tier: max(residency.get(tier, {}).values(), default=0) for tier in ("gpu", "host")}
    return {
        "id": s.session_id,
        "tenant": s.tenant,
        "task_id": s.task_id.split("/", 1)[-1] if s.task_id else None,
        "worker": s.home,
        "resident_tokens": tokens,
        "resident_bytes": {tier: n * kv_bytes_per_token for tier, n in tokens.items()},
        "idle_s": round(max(0.0, now - s.last_active_at), 3) if not s.in_flight else 0.0,
        "turns": s.turns,
        "tool_class": s.tool_class,
        "expected_wait_s": s.expected_wait_s,
        "decision": RELEASED if release is not None else None,
        "reason": RELEASE_REASON if release is not None else NO_REAPER_REASON,
    }


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
        yield CounterMetricFamily("appliance_predicted_cached_tokens",
                                  "Cached tokens the KV index predicted.",
                                  records.predicted_cached_total)  # fmt: skip
        yield CounterMetricFamily("appliance_cached_tokens", "Cached tokens the workers reported.",
                                  records.actual_cached_total)  # fmt: skip
        yield CounterMetricFamily("appliance_queue_seconds",
                                  "Seconds turns waited for their first byte.",
                                  records.first_byte_s_total)  # fmt: skip
        yield GaugeMetricFamily("appliance_sessions", "Sessions the router holds.",
                                len(src.desk.sessions))  # fmt: skip
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
        yield GaugeMetricFamily("appliance_workers_healthy", "Workers that accept requests.",
                                sum(1 for w in workers if w.healthy))  # fmt: skip
        if src.admission is not None:
            yield from src.admission.metric_families()


def cost_groups(tasks: TaskBook, currency: str) -> list[dict[str, Any]]:
    """Cost per successful task by task class and tenant over the tasks this run has seen,
    by the same rule as the ledger's report (children roll up into their root), from the
    costs the ledger priced each attempt at."""
    rows = [
        TaskRow(t.key, t.tenant, t.created_at, t.parent, t.task_class, t.status, t.verified)
        for t in tasks
    ]
    attempts = [
        AttemptRow(t.key, t.tenant, t.created_at, t.cost, attempts=t.turns)
        for t in tasks
        if t.turns
    ]
    return [
        group_row(g, by=GROUP_KEYS, currency=currency) for g in cost_per_success(rows, attempts)
    ]
