"""The state as the API publishes it: a services `StateSnapshot` as the `AdminStateView` of
appliance/api/admin/schemas.py, the structs the console decodes (`GET /admin/v1/state`).

Only names and shapes change here: every number is the snapshot's. Ids the ledger keys by
tenant ("tenant/id") are shown as the tenant's own; sections whose source already keeps
JSON-ready rows (costs, events, admission) are converted into their structs, checked as the
console checks them.
"""

from __future__ import annotations

from typing import Any, TypeVar

import msgspec

from appliance import __version__
from appliance.api.admin import schemas
from appliance.domain.gpu import GpuReading
from appliance.domain.worker import WorkerStatus
from appliance.services.operator.state import CostView, SessionView, StateSnapshot
from appliance.services.residency.branch_kv import TaskKv
from appliance.services.tasks.task_state import TaskState
from appliance.services.workers.gpu_meter import GpuTime


def admin_state(snap: StateSnapshot) -> schemas.AdminStateView:
    fleet, gpu = snap.fleet, snap.fleet.gpu
    return schemas.AdminStateView(
        time=snap.time,
        version=__version__,
        workers=[
            worker_document(
                w,
                fleet.prefill_slowdown[w.id],
                fleet.kv_tokens.get(w.id),
                fleet.gpu_time.get(w.id),
                fleet.kv_bytes_per_token or None,
            )
            for w in fleet.workers
        ],
        gpus=[gpu_document(g) for g in (gpu.gpus if gpu else ())],
        gpu_driver=gpu.driver if gpu else None,
        sessions=[session_document(v) for v in snap.sessions],
        tasks=[_task(t, snap.task_kv.get(t.key)) for t in snap.tasks],
        costs=_costs(snap.costs),
        admission=_rows(schemas.AdmissionView, snap.admission),
        routing=snap.routing,
        events=None if snap.events is None else [_rows(schemas.EventView, e) for e in snap.events],
        residency=_rows(schemas.ResidencyStateView, fleet.residency),
    )


def session_document(v: SessionView) -> schemas.SessionStateView:
    """One session as the state shows it (and `GET /admin/v1/sessions/{id}`)."""
    s = v.session
    return schemas.SessionStateView(
        id=s.session_id,
        tenant=s.tenant,
        task_id=_own_id(s.task_id) if s.task_id else None,
        worker=s.home,
        resident_tokens=schemas.TiersView(**v.resident_tokens),
        resident_bytes=schemas.TiersView(**v.resident_bytes),
        idle_s=v.idle_s,
        turns=s.turns,
        tool_class=s.tool_class,
        expected_wait_s=s.expected_wait_s,
        decision=v.decision,
        reason=v.reason,
        held_until=v.held_until,
    )


def worker_document(
    w: WorkerStatus,
    prefill_slowdown: float,
    kv_tokens: int | None,
    gpu_time: GpuTime | None,
    kv_bytes_per_token: int | None = None,
) -> schemas.WorkerStateView:
    load = w.load
    return schemas.WorkerStateView(
        id=w.id,
        engine=w.engine,
        url=w.url,
        gpus=list(w.gpus),
        restarts=w.restarts,
        healthy=w.healthy,
        state=w.power.value,
        lifecycle=w.state.value,
        sleep_level=w.sleep_level,
        last_wake_s=None if w.last_wake_s is None else round(w.last_wake_s, 3),
        draining=w.draining,
        running=load.running if load else None,
        waiting=load.waiting if load else None,
        kv_usage=load.kv_cache_usage_perc if load else None,
        kv_tokens=kv_tokens,
        kv_capacity_tokens=load.kv_capacity_tokens if load else None,
        kv_bytes_per_token=kv_bytes_per_token,
        prefix_hit_rate=load.prefix_hit_rate if load else None,
        prefill_slowdown=round(prefill_slowdown, 4),
        gpu_busy_s=round(gpu_time.busy_s, 3) if gpu_time else None,
        gpu_idle_s=round(gpu_time.idle_s, 3) if gpu_time else None,
    )


def gpu_document(g: GpuReading) -> schemas.GpuStateView:
    return schemas.GpuStateView(
        index=g.index,
        name=g.name,
        mem_total_bytes=g.mem_total_bytes,
        mem_used_bytes=g.mem_used_bytes,
        util=g.util,
        temp_c=g.temp_c,
        power_w=g.power_w,
        kv_bytes=g.kv_bytes,
    )


def _task(t: TaskState, kv: TaskKv | None) -> schemas.TaskStateView:
    kv = kv or TaskKv()
    end = kv.reclaimed
    return schemas.TaskStateView(
        id=t.client_id,
        parent_id=_own_id(t.parent) if t.parent else None,
        tenant=t.tenant,
        task_class=t.task_class,
        status=t.status.value,
        deadline_at=t.deadline_at,
        tokens=t.prompt_tokens + t.output_tokens,
        cost=t.cost,
        children=[_own_id(c) for c in t.children],
        kv_inherited_tokens=kv.inherited_tokens,
        kv_own_tokens=kv.own_tokens,
        kv_own_kept_tokens=kv.own_kept_tokens,
        kv_reclaimed_tokens=end.own_tokens if end else None,
        kv_reclaimed_at=end.at if end else None,
    )


def _costs(c: CostView) -> schemas.CostsView:
    return schemas.CostsView(
        currency=c.currency,
        groups=[_rows(schemas.CostGroupView, g) for g in c.groups],
        series=None if c.series is None else [_rows(schemas.CostPointView, p) for p in c.series],
        overhead=None if c.overhead is None else _rows(schemas.OverheadView, c.overhead),
    )


_View = TypeVar("_View", bound=msgspec.Struct)


def _rows(view: type[_View], row: Any) -> _View:
    """A JSON-ready row as its struct, numbers coerced to the field's type (3 -> 3.0)."""
    return msgspec.convert(row, view, strict=False)


def _own_id(key: str) -> str:
    """The tenant's own id of a ledger key "tenant/id"."""
    return key.split("/", 1)[-1]
