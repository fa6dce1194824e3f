"""The console's schema is the server's: the document `/admin/v1/state` publishes is the
`AdminStateView` of appliance/api/admin/schemas.py built from a services snapshot
(appliance/api/admin/state_document.py), the very structs the console decodes; every key of the
rows it converts from its sources is a field the schema knows (nothing silently dropped)."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import msgspec

from appliance.api.admin import schemas
from appliance.api.admin.schemas import AdminStateView, convert_state, decode_state, encode
from appliance.api.admin.state_document import admin_state
from appliance.domain.gpu import GpuReading, GpuSnapshot
from appliance.domain.records import SessionId, TenantId, WorkerId
from appliance.domain.worker import LoadSnapshot, WorkerState, WorkerStatus
from appliance.policy.overhead import Overhead
from appliance.policy.routing import RouteKind
from appliance.services.operator.cost_series import CostSeries
from appliance.services.operator.events import EventFeed, EventKind
from appliance.services.operator.state import StateSnapshot, StateSources, snapshot
from appliance.services.sessions.sessions import SessionState
from appliance.services.tasks.tasks import TaskBook
from appliance.services.workers.box_usage import RecordedUsage
from appliance.services.workers.gpu_meter import GpuTime
from tests.fakes import AckLedger


class _Ledger(AckLedger):
    """Acknowledges every write at once, as the ledger does when the disk takes it."""


def _sources(with_gpu: bool) -> StateSources:
    now = 1000.0
    load = LoadSnapshot(
        time=now,
        running=2,
        waiting=1,
        kv_cache_usage_perc=0.25,
        prefix_cache_queries_tokens=100,
        prefix_cache_hits_tokens=40,
    )
    workers = [
        WorkerStatus(
            WorkerId("w0"), "sim", "http://x", (), WorkerState.HEALTHY, False, 0, load=load
        ),
        WorkerStatus(WorkerId("w1"), "sim", "http://x", (), WorkerState.UNHEALTHY, True, 0),
        WorkerStatus(
            WorkerId("w2"),
            "sim",
            "http://x",
            (),
            WorkerState.ASLEEP,
            False,
            0,
            sleep_level=2,
            last_wake_s=1.23456,
        ),
        WorkerStatus(WorkerId("w3"), "sim", "http://x", (), WorkerState.STOPPED, False, 0),
        WorkerStatus(WorkerId("w4"), "sim", "http://x", (), WorkerState.WAKING, False, 0),
    ]
    sessions = [
        SessionState(
            tenant=TenantId("alice"),
            session_id=SessionId("s1"),
            created_at=now - 50,
            task_id=None,
            home=WorkerId("w0"),
            turns=3,
            last_active_at=now - 5,
            tool_class="shell",
            expected_wait_s=2.0,
            resident_tokens={WorkerId("w0"): 1024},
        )
    ]
    tasks = TaskBook(_Ledger())  # type: ignore[arg-type]
    tasks.create(TenantId("alice"), "root", now - 10, task_class="code", deadline_s=60)
    tasks.create(TenantId("alice"), "child", now - 9, parent_id="root")
    sessions[0].task_id = tasks.key(TenantId("alice"), "child")
    gpus = GpuSnapshot(
        time=now,
        driver="560" if with_gpu else None,
        gpus=(
            GpuReading(0, "NVIDIA H200", "GPU-0", 141 << 30, 80 << 30, 61 << 30, 0.5, 55.0, 400.0),
            GpuReading(
                1,
                "H200 sim",
                "SIM-w1",
                140 << 30,
                20 << 30,
                120 << 30,
                0.0,
                40.0,
                100.0,
                kv_bytes=5 << 30,
            ),
        )
        if with_gpu
        else (),
        host=None,
    )
    desk = SimpleNamespace(
        sessions=sessions,
        placer=SimpleNamespace(
            residency=lambda s: {"gpu": {s.home: 4096}, "host": {WorkerId("w1"): 1024}}
        ),
        records=SimpleNamespace(
            routed_by_reason={RouteKind.PREFIX_RESIDENT: 3},
            meter=SimpleNamespace(
                reading=lambda w: GpuTime(awake_s=100.0, busy_s=40.0), charged_s=40.0
            ),
        ),
        queues=SimpleNamespace(slowdown=lambda w: 1.25 if w == "w0" else 1.0),
    )
    events = EventFeed()
    events.record(now - 1, EventKind.WORKER_RESTART, "w1", "restarted")
    events.record(now, EventKind.RELEASE, "s1", "released by operator", tenant="alice")
    return StateSources(
        workers=lambda: workers,
        desk=desk,  # type: ignore[arg-type]
        tasks=tasks,
        gpus=lambda: gpus,
        clock_now=lambda: now,
        kv_bytes_per_token=131072,
        currency="USD",
        events=events,
        cost_series=CostSeries(),
        usage=SimpleNamespace(recorded=lambda: RECORDED) if with_gpu else None,  # type: ignore[arg-type]
    )


# The overhead the ledger acknowledged: 60 idle GPU-seconds, 0.5 kWh, half an hour.
RECORDED = RecordedUsage(
    through=990.0,
    overhead=Overhead(idle=0.066, energy=0.15, box=2.0),
    awake_s=100.0,
    idle_s=60.0,
    energy_j=1_800_000.0,
    box_s=1800.0,
)


def published(snap: StateSnapshot) -> dict[str, Any]:
    """The document as `/admin/v1/state` sends it, parsed back."""
    parsed: dict[str, Any] = json.loads(encode(admin_state(snap)))
    return parsed


def validated_rows(snap: StateSnapshot) -> list[tuple[type[msgspec.Struct], Any]]:
    """The rows the document converts from its sources as they keep them (extra keys there
    would be dropped without a word), each with the model it becomes."""
    rows: list[tuple[type[msgspec.Struct], Any]] = [(schemas.AdmissionView, snap.admission)]
    rows += [(schemas.CostGroupView, g) for g in snap.costs.groups]
    rows += [(schemas.CostPointView, p) for p in snap.costs.series or ()]
    rows += [(schemas.EventView, e) for e in snap.events or ()]
    return rows


def unknown_keys(model: type[msgspec.Struct], data: Any, where: str = "") -> list[str]:
    """Keys of `data` the struct has no field for, recursively through nested structs."""
    fields = {f.encode_name: f for f in msgspec.structs.fields(model)}
    out = []
    for key, value in data.items():
        field = fields.get(key)
        if field is None:
            out.append(f"{where}{key}")
            continue
        nested = _model_of(field.type)
        if nested is None:
            continue
        items = value if isinstance(value, list) else [value]
        for i, item in enumerate(items):
            if isinstance(item, dict):
                out += unknown_keys(nested, item, f"{where}{key}[{i}].")
    return out


def _model_of(annotation: Any) -> type[msgspec.Struct] | None:
    if isinstance(annotation, type) and issubclass(annotation, msgspec.Struct):
        return annotation
    for arg in getattr(annotation, "__args__", ()):
        found = _model_of(arg)
        if found is not None:
            return found
    return None


def test_the_servers_snapshot_is_the_schemas() -> None:
    for with_gpu in (True, False):
        snap = snapshot(_sources(with_gpu))
        for model, row in validated_rows(snap):
            assert unknown_keys(model, row) == [], model.__name__
        payload = published(snap)
        state = convert_state(payload)
        assert unknown_keys(AdminStateView, payload) == []
        assert state.admission == schemas.AdmissionView()
        assert len(state.gpus) == (2 if with_gpu else 0)
        assert [g.kv_bytes for g in state.gpus] == ([None, 5 << 30] if with_gpu else [])
        assert state.gpu_driver == ("560" if with_gpu else None)
        assert state.events is not None
        assert [(e.kind, e.subject, e.tenant) for e in state.events] == [
            ("release", "s1", "alice"),
            ("worker_restart", "w1", None),
        ]
        assert state.costs.series is not None and len(state.costs.series) == 1
        if with_gpu:
            assert state.costs.overhead == schemas.OverheadView(
                through=990.0,
                idle=0.066,
                energy=0.15,
                box=2.0,
                total=2.216,
                awake_gpu_s=100.0,
                idle_gpu_s=60.0,
                energy_kwh=0.5,
                box_hours=0.5,
            )
        else:
            assert state.costs.overhead is None
        # The KV index's view now (the router's `residency`), not the placement's prediction.
        assert state.sessions[0].resident_tokens.gpu == 4096
        assert state.sessions[0].resident_tokens.host == 1024
        assert state.sessions[0].resident_bytes.gpu == 4096 * 131072
        assert state.sessions[0].task_id == "child"
        assert {t.id: t.parent_id for t in state.tasks} == {"root": None, "child": "root"}
        assert state.tasks[0].children == ["child"]
        assert state.workers[0].prefix_hit_rate == 0.4
        assert state.workers[1].running is None
        assert [(w.state, w.healthy, w.sleep_level, w.last_wake_s) for w in state.workers] == [
            ("awake", True, None, None),
            ("awake", False, None, None),
            ("asleep", False, 2, 1.235),
            ("stopped", False, None, None),
            ("waking", False, None, None),
        ]


def test_the_unknown_key_check_can_fail() -> None:
    payload = published(snapshot(_sources(True)))
    payload["sessions"][0]["pinned"] = True
    payload["spare"] = 1
    assert unknown_keys(AdminStateView, payload) == ["sessions[0].pinned", "spare"]


def test_the_console_reads_what_the_server_sends() -> None:
    from tests.tui.test_snapshots import snapshot_state

    body = json.dumps(snapshot_state()).encode()
    read = decode_state(body)
    assert read == convert_state(json.loads(body))
    assert decode_state(encode(read)) == read
    for with_gpu in (True, False):
        snap = snapshot(_sources(with_gpu))
        sent = encode(admin_state(snap))
        assert decode_state(sent) == admin_state(snap)
