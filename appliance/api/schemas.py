"""The admin API's payloads as pydantic models, shared by the server and the console.

`AdminState` is one `GET /admin/v1/state` snapshot (appliance/services/state.py builds it).
Every number here is one the appliance read from a source of truth; a reading it does not
have is `None`, never a guess, and the console shows it as "-". Sections the server does not
report yet (`events`, parts of `costs` and `admission`) are `None` or empty so that an older
server still validates; unknown keys are ignored so that a newer one does too.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


class Tiers(_Model):
    """A quantity split by cache tier."""

    gpu: int = 0
    host: int = 0


class WorkerState(_Model):
    id: str
    engine: str | None = None
    url: str | None = None
    gpus: list[int] = Field(default_factory=list)
    """NVML indices of the GPUs this worker runs on (empty for a simulated worker)."""
    healthy: bool
    draining: bool = False
    restarts: int = 0
    running: int | None = None
    waiting: int | None = None
    kv_usage: float | None = None
    """Fraction 0..1 of the worker's KV cache in use (vLLM's kv_cache_usage_perc)."""
    prefix_hit_rate: float | None = None
    """Fraction 0..1 of prompt tokens served from the prefix cache."""


class GpuState(_Model):
    index: int
    name: str
    mem_total_bytes: int
    mem_used_bytes: int
    util: float | None = None
    """Fraction 0..1 of time a kernel ran over the last sample period."""
    temp_c: float | None = None
    power_w: float | None = None
    kv_bytes: int | None = None
    """Bytes of `mem_used_bytes` that hold KV cache; None while the server does not say."""


class SessionState(_Model):
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
    """The reaper's last residency decision for this session (hold / demote / evict)."""
    reason: str | None = None


class TaskState(_Model):
    id: str
    parent_id: str | None = None
    tenant: str
    task_class: str | None = None
    status: str
    deadline_at: float | None = None
    tokens: int = 0
    cost: float | None = None
    children: list[str] = Field(default_factory=list)


class CostGroup(_Model):
    """One row of the cost-per-successful-task report (the ledger's `cost_report`)."""

    task_class: str | None = None
    tenant: str | None = None
    tasks: int = 0
    succeeded: int = 0
    attempts: int = 0
    unpriced_attempts: int = 0
    cost: float | None = None
    cost_per_success: float | None = None
    currency: str | None = None


class CostPoint(_Model):
    window_start: float
    cost_per_success: float | None = None
    succeeded: int = 0


class Costs(_Model):
    currency: str | None = None
    groups: list[CostGroup] | None = None
    """None: the server does not report costs yet."""
    series: list[CostPoint] | None = None
    """Cost per successful task over time, oldest first; None: not reported."""


class Admission(_Model):
    accepted: int | None = None
    rejected: int | None = None
    accept_rate_per_s: float | None = None
    reject_rate_per_s: float | None = None
    reasons: dict[str, int] = Field(default_factory=dict)
    """Rejections by reason."""


class Event(_Model):
    """Something an operator should know happened: a restart, rejection, eviction, release."""

    time: float
    kind: str
    worker: str | None = None
    session_id: str | None = None
    task_id: str | None = None
    tenant: str | None = None
    detail: str = ""


class AdminState(_Model):
    """One snapshot of the running appliance (`GET /admin/v1/state`)."""

    time: float
    workers: list[WorkerState] = Field(default_factory=list)
    gpus: list[GpuState] = Field(default_factory=list)
    """Empty on a host without NVIDIA GPUs: a normal state."""
    sessions: list[SessionState] = Field(default_factory=list)
    tasks: list[TaskState] = Field(default_factory=list)
    costs: Costs = Costs()
    admission: Admission = Admission()
    routing: dict[str, int] = Field(default_factory=dict)
    """Turns placed by the router, by reason."""
    events: list[Event] | None = None
    """Newest first; None: the server does not report events yet."""


class SessionTurn(_Model):
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


class SessionDetail(_Model):
    """`GET /admin/v1/sessions/{id}`: one session and its turns, oldest first."""

    session: SessionState | None = None
    turns: list[SessionTurn] = Field(default_factory=list)


class ReleaseResult(_Model):
    """`POST /admin/v1/sessions/{id}/release`."""

    session_id: str | None = None
    released_tokens: int | None = None
    released_bytes: int | None = None


class ErrorDetail(_Model):
    message: str
    type: str | None = None
    code: str | None = None


class ErrorBody(_Model):
    """OpenAI-style error JSON, as every route of the appliance renders it."""

    error: ErrorDetail


__all__ = [
    "AdminState",
    "Admission",
    "CostGroup",
    "CostPoint",
    "Costs",
    "ErrorBody",
    "ErrorDetail",
    "Event",
    "GpuState",
    "ReleaseResult",
    "SessionDetail",
    "SessionState",
    "SessionTurn",
    "TaskState",
    "Tiers",
    "WorkerState",
]
