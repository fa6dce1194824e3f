"""The snapshot as the console holds it: a fast twin of `appliance.api.schemas.AdminStateView`.

The pydantic models in appliance/api/schemas.py are the contract the server and the console
share. Validating 10,000 sessions with them takes about 100 ms, twice a second; msgspec
decodes the same JSON into these frozen structs in under 20 ms, checking the same types. The
structs mirror the models field for field (names, types, defaults); tests/tui/test_schemas.py
fails when they drift apart. Change the models first, then these.
"""

from __future__ import annotations

import msgspec


class Tiers(msgspec.Struct, frozen=True):
    gpu: int = 0
    host: int = 0
    gpu_held: int = 0
    gone: int = 0


class WorkerState(msgspec.Struct, frozen=True):
    id: str
    healthy: bool
    engine: str | None = None
    url: str | None = None
    gpus: list[int] = []
    state: str = "awake"
    lifecycle: str | None = None
    sleep_level: int | None = None
    last_wake_s: float | None = None
    draining: bool = False
    restarts: int = 0
    running: int | None = None
    waiting: int | None = None
    kv_usage: float | None = None
    kv_tokens: int | None = None
    kv_capacity_tokens: int | None = None
    kv_bytes_per_token: int | None = None
    prefix_hit_rate: float | None = None
    prefill_slowdown: float = 1.0
    gpu_busy_s: float | None = None
    gpu_idle_s: float | None = None


class GpuState(msgspec.Struct, frozen=True):
    index: int
    name: str
    mem_total_bytes: int
    mem_used_bytes: int
    util: float | None = None
    temp_c: float | None = None
    power_w: float | None = None
    kv_bytes: int | None = None


class SessionState(msgspec.Struct, frozen=True):
    id: str
    tenant: str
    task_id: str | None = None
    worker: str | None = None
    resident_tokens: Tiers = Tiers()
    resident_bytes: Tiers = Tiers()
    idle_s: float = 0.0
    turns: int = 0
    tool_class: str | None = None
    expected_wait_s: float | None = None
    decision: str | None = None
    reason: str | None = None
    held_until: float | None = None


class TaskState(msgspec.Struct, frozen=True):
    id: str
    tenant: str
    status: str
    parent_id: str | None = None
    task_class: str | None = None
    deadline_at: float | None = None
    tokens: int = 0
    cost: float | None = None
    children: list[str] = []
    kv_inherited_tokens: int = 0
    kv_own_tokens: int = 0
    kv_own_kept_tokens: int = 0
    kv_reclaimed_tokens: int | None = None
    kv_reclaimed_at: float | None = None


class CostGroup(msgspec.Struct, frozen=True):
    task_class: str | None = None
    tenant: str | None = None
    tasks: int = 0
    succeeded: int = 0
    attempts: int = 0
    unpriced_attempts: int = 0
    gpu_s: float | None = None
    cost: float | None = None
    overhead: float | None = None
    overhead_idle: float | None = None
    overhead_energy: float | None = None
    overhead_box: float | None = None
    total_cost: float | None = None
    cost_per_success: float | None = None
    direct_cost_per_success: float | None = None
    currency: str | None = None


class CostOverhead(msgspec.Struct, frozen=True):
    through: float | None = None
    idle: float = 0.0
    energy: float = 0.0
    box: float = 0.0
    total: float = 0.0
    awake_gpu_s: float = 0.0
    idle_gpu_s: float = 0.0
    energy_kwh: float = 0.0
    box_hours: float = 0.0


class CostPoint(msgspec.Struct, frozen=True):
    window_start: float
    cost_per_success: float | None = None
    succeeded: int = 0


class Costs(msgspec.Struct, frozen=True):
    currency: str | None = None
    groups: list[CostGroup] | None = None
    series: list[CostPoint] | None = None
    overhead: CostOverhead | None = None


class TenantAdmission(msgspec.Struct, frozen=True):
    in_flight_turns: int = 0
    open_tasks: int = 0


class Admission(msgspec.Struct, frozen=True):
    accepted: int | None = None
    rejected: int | None = None
    accept_rate_per_s: float | None = None
    reject_rate_per_s: float | None = None
    by_reason: dict[str, int] = {}
    in_flight_turns: int | None = None
    open_tasks: int | None = None
    tenants: dict[str, TenantAdmission] = {}


class Event(msgspec.Struct, frozen=True):
    at: float
    kind: str
    subject: str
    detail: str = ""
    tenant: str | None = None


class Residency(msgspec.Struct, frozen=True):
    reaper: bool = False
    retention: bool = False
    note: str | None = None
    waiting: int | None = None
    held: int | None = None
    decisions: dict[str, int] = {}
    unsent: int | None = None


class AdminState(msgspec.Struct, frozen=True):
    time: float
    version: str | None = None
    workers: list[WorkerState] = []
    gpus: list[GpuState] = []
    gpu_driver: str | None = None
    sessions: list[SessionState] = []
    tasks: list[TaskState] = []
    costs: Costs = Costs()
    admission: Admission = Admission()
    routing: dict[str, int] = {}
    events: list[Event] | None = None
    residency: Residency = Residency()


_decoder = msgspec.json.Decoder(AdminState)


def decode_state(body: bytes) -> AdminState:
    """One `/admin/v1/state` body; raises msgspec.ValidationError / DecodeError."""
    return _decoder.decode(body)


def convert_state(data: object) -> AdminState:
    """The same from already-parsed JSON data (a dict)."""
    return msgspec.convert(data, AdminState)


MIRRORS = {
    "TiersView": Tiers,
    "WorkerStateView": WorkerState,
    "GpuStateView": GpuState,
    "SessionStateView": SessionState,
    "TaskStateView": TaskState,
    "CostGroupView": CostGroup,
    "CostPointView": CostPoint,
    "OverheadView": CostOverhead,
    "CostsView": Costs,
    "TenantAdmissionView": TenantAdmission,
    "AdmissionView": Admission,
    "EventView": Event,
    "ResidencyStateView": Residency,
    "AdminStateView": AdminState,
}
"""Struct by the name of the pydantic model it mirrors (for the drift test)."""
