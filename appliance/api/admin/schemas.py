"""The admin API's payloads as frozen msgspec structs: the one definition the server encodes
and the console decodes (it imports this module and nothing else of the appliance).

`AdminStateView` is the document `GET /admin/v1/state` publishes: one snapshot of the
appliance (appliance/services/operator/state.py gathers it,
appliance/api/admin/state_document.py builds this struct). Its parts are named `...View` too: the
API's view of what the services hold under the plain name
(`services.sessions.sessions.SessionState` is shown as `SessionStateView`). msgspec decodes
and checks 10,000 sessions in under 20 ms, so the console reads the document twice a second
with these very types. Each struct is frozen and names its fields (`kw_only`), so required
ones may follow defaulted ones and the JSON keeps their order.

Every number here is one the appliance read from a source of truth; a reading it does not
have is `None`, never a guess, and the console shows it as "-". Sections the server does not
report yet (`events`, parts of `costs` and `admission`) are `None` or empty so that an older
server still decodes; unknown keys are ignored so that a newer one does too. Under the
simulated engine the GPUs are modelled, not measured, and `gpu_driver` says so.
"""

from __future__ import annotations

from typing import Any

import msgspec


class TiersView(msgspec.Struct, frozen=True, kw_only=True):
    """A quantity of a session's prefix by cache tier: the most any one worker has on its GPU
    (`gpu`, held or not), held there by its retention connector (`gpu_held`, part of `gpu`),
    in its host tier (`host`), and the least any one worker lacks (`gone`)."""

    gpu: int = 0
    host: int = 0
    gpu_held: int = 0
    gone: int = 0


class WorkerStateView(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    engine: str | None = None
    url: str | None = None
    gpus: list[int] = []
    """NVML indices of the GPUs this worker runs on (empty for a simulated worker)."""
    healthy: bool
    """It accepts requests now. False for one asleep or stopped on purpose: `state` says so."""
    state: str = "awake"
    """Its power state (appliance.domain.worker.WorkerPowerState): awake (serving, or failing
    its /health: `healthy`), asleep (vLLM's sleep mode), stopped (no process: stopped idle,
    or exited) or waking (on its way up). A string, not an enum, so that a console reads a
    newer server's states too."""
    lifecycle: str | None = None
    """The supervisor's state behind `state`: starting, healthy, unhealthy, exited (crashed;
    a restart is scheduled), draining, stopped, failed (it gave up after repeated exits: the
    operator's turn), asleep or waking. A stopped worker at rest and one given up on are both
    `state` stopped; this tells them apart."""
    sleep_level: int | None = None
    """1 (weights in host memory) or 2 (weights discarded) while asleep, else None."""
    last_wake_s: float | None = None
    """Its latest wake's measured seconds (None: never woken)."""
    draining: bool = False
    restarts: int = 0
    running: int | None = None
    waiting: int | None = None
    kv_usage: float | None = None
    """Fraction 0..1 of the worker's KV pool that running requests (and holds) use: vLLM's
    kv_cache_usage_perc, which counts blocks only cached as free, so it reads 0 between
    turns however much is cached (`kv_tokens` of `kv_capacity_tokens` is what is there)."""
    kv_tokens: int | None = None
    """Tokens of KV on the worker's GPU now: the full blocks the KV index holds there, held,
    in use or only cached (what the sessions' resident GPU tokens add up to)."""
    kv_capacity_tokens: int | None = None
    """Tokens the worker's KV pool holds (vLLM's cache_config_info: its GPU blocks, the null
    block excluded, times the block size); None when the worker does not say."""
    kv_bytes_per_token: int | None = None
    """Bytes of KV one token of its model takes (the served model's config at
    engine.kv_cache_dtype; simulated workers: the GPU profile's model): what every byte
    figure of the state, the reaper and the releases is priced at."""
    prefix_hit_rate: float | None = None
    """Fraction 0..1 of prompt tokens served from the prefix cache."""
    prefill_slowdown: float = 1.0
    """The worker's measured prefill seconds per second of the GPU profile's (1 until
    measured; see appliance/services/workers/worker_speed.py)."""
    gpu_busy_s: float | None = None
    """GPU-seconds since the appliance started with a turn in flight here: what the turns'
    `gpu_s` add up to (None: not metered)."""
    gpu_idle_s: float | None = None
    """GPU-seconds awake with no turn in flight: the box's overhead, charged to the tasks
    as the ledger records it period by period (`costs.overhead`)."""


class GpuStateView(msgspec.Struct, frozen=True, kw_only=True):
    index: int
    name: str
    mem_total_bytes: int
    mem_used_bytes: int
    util: float | None = None
    """Fraction 0..1 of time a kernel ran over the last sample period."""
    temp_c: float | None = None
    power_w: float | None = None
    kv_bytes: int | None = None
    """Bytes of `mem_used_bytes` that hold KV cache in use; None where the probe cannot tell
    (NVML)."""


class SessionStateView(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    tenant: str
    task_id: str | None = None
    worker: str | None = None
    resident_tokens: TiersView = TiersView()
    resident_bytes: TiersView = TiersView()
    idle_s: float = 0.0
    turns: int = 0
    tool_class: str | None = None
    expected_wait_s: float | None = None
    decision: str | None = None
    """The residency decision standing for this session: the idle reaper's (hold, release,
    evict) or an operator's (released); None while a turn is in flight."""
    reason: str | None = None
    held_until: float | None = None
    """When the hold on its KV lapses on its own (unix time); None: not held."""


class TaskStateView(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    parent_id: str | None = None
    tenant: str
    task_class: str | None = None
    status: str
    deadline_at: float | None = None
    tokens: int = 0
    cost: float | None = None
    children: list[str] = []
    kv_inherited_tokens: int = 0
    """Of its sessions' KV now, what they share with its parent task's (the parent's)."""
    kv_own_tokens: int = 0
    """Of its sessions' KV now, what is branch-local (cached on some tier)."""
    kv_own_kept_tokens: int = 0
    """Of `kv_own_tokens`, what is held on a GPU or kept on a host tier: reclaimed at its
    end, on every tier."""
    kv_reclaimed_tokens: int | None = None
    """What its end reclaimed (None: it has not ended, or the appliance has forgotten)."""
    kv_reclaimed_at: float | None = None


class CostGroupView(msgspec.Struct, frozen=True, kw_only=True):
    """One row of the cost-per-successful-task report (the ledger's `cost_report`): the
    direct cost, the group's share of the box's overhead (spread by GPU-seconds), their
    total, and cost per success with the overhead."""

    task_class: str | None = None
    tenant: str | None = None
    tasks: int = 0
    succeeded: int = 0
    attempts: int = 0
    unpriced_attempts: int = 0
    gpu_s: float | None = None
    cost: float | None = None
    """Direct: what the attempts and tools were priced at."""
    overhead: float | None = None
    overhead_idle: float | None = None
    overhead_energy: float | None = None
    overhead_box: float | None = None
    total_cost: float | None = None
    cost_per_success: float | None = None
    """total_cost / succeeded."""
    direct_cost_per_success: float | None = None
    currency: str | None = None


class OverheadView(msgspec.Struct, frozen=True, kw_only=True):
    """The box's overhead the groups share: the usage periods the ledger acknowledged this
    run, priced (gpu_seconds mode; 0 in tokens mode)."""

    through: float | None = None
    """The end of the last period counted."""
    idle: float = 0.0
    """Idle awake GPU-seconds at the GPU-second price."""
    energy: float = 0.0
    box: float = 0.0
    """The box's hours at its price per hour."""
    total: float = 0.0
    awake_gpu_s: float = 0.0
    idle_gpu_s: float = 0.0
    energy_kwh: float = 0.0
    box_hours: float = 0.0


class CostPointView(msgspec.Struct, frozen=True, kw_only=True):
    window_start: float
    cost_per_success: float | None = None
    succeeded: int = 0


class CostsView(msgspec.Struct, frozen=True, kw_only=True):
    currency: str | None = None
    groups: list[CostGroupView] | None = None
    """None: the server does not report costs yet."""
    series: list[CostPointView] | None = None
    """Cost per successful task over time, oldest first; None: not reported."""
    overhead: OverheadView | None = None
    """None: the server records no overhead (or does not report it yet)."""


class TenantAdmissionView(msgspec.Struct, frozen=True, kw_only=True):
    """What one tenant holds now, as admission counts it."""

    in_flight_turns: int = 0
    open_tasks: int = 0


class AdmissionView(msgspec.Struct, frozen=True, kw_only=True):
    """Admission's counters; empty ({}) where the appliance has no admission control."""

    accepted: int | None = None
    rejected: int | None = None
    accept_rate_per_s: float | None = None
    reject_rate_per_s: float | None = None
    by_reason: dict[str, int] = {}
    """Rejections by reason."""
    in_flight_turns: int | None = None
    open_tasks: int | None = None
    tenants: dict[str, TenantAdmissionView] = {}


class EventView(msgspec.Struct, frozen=True, kw_only=True):
    """Something an operator should know happened: a worker restart, outage, sleep, stop or
    wake, a rejection, an eviction, a release, a cancelled task
    (appliance/services/operator/events.py)."""

    at: float
    kind: str
    """worker_restart, worker_down, worker_up, worker_slept, worker_stopped, worker_waking,
    worker_woken, worker_wake_failed, task_cancelled, release, rejection, eviction."""
    subject: str
    """What it happened to: a worker id, a session id, a task id."""
    detail: str = ""
    tenant: str | None = None


class ResidencyStateView(msgspec.Struct, frozen=True, kw_only=True):
    """The idle reaper (appliance/services/residency/reaper_loop.py): whether it runs, whether its
    decisions reach the workers (a retention channel), and what it has decided."""

    reaper: bool = False
    retention: bool = False
    note: str | None = None
    """What its decisions do, or why they do nothing in the workers."""
    waiting: int | None = None
    """Sessions between turns it follows."""
    held: int | None = None
    """Sessions it holds now."""
    decisions: dict[str, int] = {}
    """Decisions since start, by action."""
    unsent: int | None = None
    """Directives no worker took (its connector not connected)."""


class AdminStateView(msgspec.Struct, frozen=True, kw_only=True):
    """One snapshot of the running appliance (`GET /admin/v1/state`)."""

    time: float
    version: str | None = None
    """The appliance's version (`appliance --version`); None from one that does not say."""
    workers: list[WorkerStateView] = []
    gpus: list[GpuStateView] = []
    """Empty on a host without NVIDIA GPUs: a normal state."""
    gpu_driver: str | None = None
    """The NVIDIA driver's version as NVML reports it; under the simulated engine a text
    starting with "simulated": the GPUs are the simulator's model, not measured."""
    sessions: list[SessionStateView] = []
    tasks: list[TaskStateView] = []
    costs: CostsView = CostsView()
    admission: AdmissionView = AdmissionView()
    routing: dict[str, int] = {}
    """Turns placed by the router, by reason."""
    events: list[EventView] | None = None
    """Newest first; None: the server does not report events yet."""
    residency: ResidencyStateView = ResidencyStateView()
    """The idle reaper; its defaults where the server does not report it."""


class SessionTurn(msgspec.Struct, frozen=True, kw_only=True):
    """One generation attempt of a session (a ledger `turns` row)."""

    turn_id: str
    started_at: float
    worker: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    ttft_s: float | None = None
    e2e_s: float | None = None
    cost: float | None = None
    outcome: str | None = None


class SessionResidency(msgspec.Struct, frozen=True, kw_only=True):
    """Where a session's prefix is: tokens of it on one worker, in one tier: `gpu_held` (held
    by the worker's retention connector until `held_until`), `gpu` (cached, not held: the
    engine evicts it when it needs the room), `host`, `gone` (on neither)."""

    worker: str
    tier: str = "gpu"
    tokens: int = 0
    bytes: int = 0
    held_until: float | None = None


class SessionDetail(msgspec.Struct, frozen=True, kw_only=True):
    """`GET /admin/v1/sessions/{id}?tenant=T`: one session as the state shows it, its
    residency per worker, and its newest turns from the ledger, oldest first."""

    session: SessionStateView | None = None
    residency: list[SessionResidency] = []
    turns: list[SessionTurn] = []


class ReleaseResult(msgspec.Struct, frozen=True, kw_only=True):
    """`POST /admin/v1/sessions/{id}/release?tenant=T`."""

    session_id: str | None = None
    tenant: str | None = None
    released_tokens: int | None = None
    """Tokens the session held on the GPU when it was released."""
    released_bytes: int | None = None
    decision: str | None = None
    reason: str | None = None


class ErrorDetail(msgspec.Struct, frozen=True, kw_only=True):
    message: str
    type: str | None = None
    code: str | None = None


class ErrorBody(msgspec.Struct, frozen=True, kw_only=True):
    """OpenAI-style error JSON, as every route of the appliance renders it."""

    error: ErrorDetail


_state_decoder = msgspec.json.Decoder(AdminStateView)


def decode_state(body: bytes) -> AdminStateView:
    """One `/admin/v1/state` body; raises msgspec.ValidationError / DecodeError."""
    return _state_decoder.decode(body)


def convert_state(data: object) -> AdminStateView:
    """The same from already-parsed JSON data (a dict)."""
    return msgspec.convert(data, AdminStateView)


def encode(view: msgspec.Struct) -> bytes:
    """A payload as the API sends it."""
    return msgspec.json.encode(view)


def plain(view: msgspec.Struct) -> dict[str, Any]:
    """A payload as JSON-ready data (to place inside a larger reply)."""
    data: dict[str, Any] = msgspec.to_builtins(view)
    return data


__all__ = [
    "AdminStateView",
    "AdmissionView",
    "CostGroupView",
    "CostPointView",
    "CostsView",
    "ErrorBody",
    "ErrorDetail",
    "EventView",
    "GpuStateView",
    "ReleaseResult",
    "ResidencyStateView",
    "SessionDetail",
    "SessionResidency",
    "SessionStateView",
    "SessionTurn",
    "TaskStateView",
    "TenantAdmissionView",
    "TiersView",
    "WorkerStateView",
    "convert_state",
    "decode_state",
    "encode",
    "plain",
]
