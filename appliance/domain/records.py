"""What the ledger stores: tasks, sessions, generation attempts (turns), cache receipts,
task events, residency and admission decisions, and versioned prices.

Plain frozen values, stdlib only. Times are Unix seconds (float), durations end in `_s`,
token counts in `_tokens`. Money is a float in the price's currency.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import NewType

TaskId = NewType("TaskId", str)
SessionId = NewType("SessionId", str)
TurnId = NewType("TurnId", str)
TenantId = NewType("TenantId", str)
WorkerId = NewType("WorkerId", str)
PriceId = NewType("PriceId", int)


class TaskStatus(StrEnum):
    OPEN = "open"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    DONE = "done"
    """A one-turn task (its turn named no X-Task-ID) whose turn ended: its outcome is
    unknown, so it is never a success, nor a failure."""

    @property
    def is_terminal(self) -> bool:
        return not TASK_TRANSITIONS[self]

    @property
    def ends_sessions(self) -> bool:
        """Whether reaching it ends the sessions bound to the task: every close does but
        `done` (a session the client named binds a new one-turn task each turn)."""
        return self.is_terminal and self is not TaskStatus.DONE


# The whole task lifecycle: a task is open until one terminal event; terminal states are final.
TASK_TRANSITIONS: Mapping[TaskStatus, frozenset[TaskStatus]] = {
    TaskStatus.OPEN: frozenset(
        {TaskStatus.SUCCEEDED, TaskStatus.FAILED, TaskStatus.CANCELLED, TaskStatus.DONE}
    ),
    TaskStatus.SUCCEEDED: frozenset(),
    TaskStatus.FAILED: frozenset(),
    TaskStatus.CANCELLED: frozenset(),
    TaskStatus.DONE: frozenset(),
}


def can_transition(current: TaskStatus, new: TaskStatus) -> bool:
    return new in TASK_TRANSITIONS[current]


class TaskEventType(StrEnum):
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    TOOL_STARTED = "tool_started"
    TOOL_FINISHED = "tool_finished"
    DONE = "done"
    """The appliance's own: a one-turn task's turn ended (a client never sends it)."""

    @property
    def terminal_status(self) -> TaskStatus | None:
        """The status this event moves a task to, or None for an event that changes none."""
        return _EVENT_STATUS.get(self)

    @property
    def is_tool_event(self) -> bool:
        """A tool's start or finish (the task stays open)."""
        return self in (TaskEventType.TOOL_STARTED, TaskEventType.TOOL_FINISHED)

    @property
    def from_client(self) -> bool:
        """Whether a client may report it (`POST /v1/tasks/{id}/events`)."""
        return self is not TaskEventType.DONE


_EVENT_STATUS: Mapping[TaskEventType, TaskStatus] = {
    TaskEventType.SUCCEEDED: TaskStatus.SUCCEEDED,
    TaskEventType.FAILED: TaskStatus.FAILED,
    TaskEventType.CANCELLED: TaskStatus.CANCELLED,
    TaskEventType.DONE: TaskStatus.DONE,
}


class TurnOutcome(StrEnum):
    OK = "ok"
    FAILED = "failed"
    CANCELLED = "cancelled"
    DISCARDED = "discarded"
    """The attempt finished but its result was thrown away (e.g. a losing fan-out branch)."""


class CostMode(StrEnum):
    TOKENS = "tokens"
    GPU_SECONDS = "gpu_seconds"


class CacheTier(StrEnum):
    GPU = "gpu"
    HOST = "host"
    DISK = "disk"


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


@dataclass(frozen=True, slots=True)
class TaskRecord:
    """A logical task as created; its status changes only through TaskEvents."""

    task_id: TaskId
    tenant: TenantId
    created_at: float
    parent_task_id: TaskId | None = None
    task_class: str | None = None
    deadline_at: float | None = None
    budget: float | None = None
    max_children: int | None = None

    def __post_init__(self) -> None:
        _require(self.parent_task_id != self.task_id, f"task {self.task_id} is its own parent")


@dataclass(frozen=True, slots=True)
class TaskEvent:
    """Something that happened to a task; the terminal types also set its status."""

    task_id: TaskId
    type: TaskEventType
    at: float
    verified: bool | None = None
    """For `succeeded`: whether the outcome was checked (tests passed, a grader agreed)."""
    evidence: str | None = None
    """A short pointer to what verified it (a test run id, a URL); never the whole output."""
    tool_class: str | None = None
    expected_s: float | None = None
    cost: float = 0.0
    """What the tool cost (`tool_finished`), in the ledger's currency: part of the task's
    attempted cost, like its turns'."""

    def __post_init__(self) -> None:
        _require(math.isfinite(self.cost) and self.cost >= 0, f"task {self.task_id}: bad cost")


@dataclass(frozen=True, slots=True)
class SessionRecord:
    session_id: SessionId
    tenant: TenantId
    created_at: float
    task_id: TaskId | None = None
    worker: WorkerId | None = None
    last_active_at: float | None = None


@dataclass(frozen=True, slots=True)
class TurnRecord:
    """One generation attempt. Retries and fan-out branches are separate turns."""

    turn_id: TurnId
    tenant: TenantId
    task_id: TaskId | None
    session_id: SessionId | None
    worker: WorkerId | None
    model: str
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    outcome: TurnOutcome
    started_at: float
    finished_at: float
    parent_task_id: TaskId | None = None
    reasoning_tokens: int = 0
    queue_s: float = 0.0
    ttft_s: float | None = None
    e2e_s: float = 0.0
    gpu_s: float = 0.0
    """GPU-seconds this attempt used (its share of the worker's GPUs), for gpu_seconds pricing."""
    predicted_cached_tokens: int | None = None
    """What the router expected to hit in the cache, to audit its predictions."""
    tool_cost: float = 0.0
    """Money spent on tools attributed to this attempt, in the price's currency."""
    error: str | None = None
    endpoint: str | None = None
    """The outside endpoint it went to (escalation); None: the local box."""
    route_reason: str | None = None
    """Why it went to its side (the escalation rule), when a rule spoke."""
    priced_cost: float | None = None
    """Its cost priced already (an outside endpoint's, at its prices); None: the ledger's
    price row prices it."""

    @property
    def fresh_tokens(self) -> int:
        """Prompt tokens that were prefilled, not read from the prefix cache."""
        return self.prompt_tokens - self.cached_tokens

    def __post_init__(self) -> None:
        for name in ("prompt_tokens", "cached_tokens", "output_tokens", "reasoning_tokens"):
            _require(getattr(self, name) >= 0, f"turn {self.turn_id}: {name} is negative")
        _require(
            self.cached_tokens <= self.prompt_tokens,
            f"turn {self.turn_id}: cached_tokens exceeds prompt_tokens",
        )
        _require(
            self.reasoning_tokens <= self.output_tokens,
            f"turn {self.turn_id}: reasoning_tokens exceeds output_tokens (they are a part of it)",
        )
        _require(self.finished_at >= self.started_at, f"turn {self.turn_id}: ends before start")
        _require(self.gpu_s >= 0 and self.tool_cost >= 0, f"turn {self.turn_id}: negative cost")


@dataclass(frozen=True, slots=True)
class CacheReceipt:
    """Proof that a prefix was cached: what, for whom, where, and under which runtime."""

    prefix_digest: str
    token_count: int
    model: str
    runtime_identity: str
    """Engine build, model revision, block size and hash algorithm: a receipt is valid only
    against the same identity."""
    tenant_domain: str
    """The isolation domain allowed to reuse the prefix (a tenant, or a shared domain)."""
    worker: WorkerId
    tier: CacheTier
    created_at: float
    last_used_at: float
    generation: int = 0
    """The worker's cache generation (`KvIndex.generation`) when the attempt that left the
    prefix was placed: a receipt of a generation older than the worker's now is stale (a
    reset or restart since has dropped the prefix, whatever the receipt says)."""


@dataclass(frozen=True, slots=True)
class CacheEviction:
    """A cached prefix (a receipt's) that left a worker's GPU tier, and why."""

    prefix_digest: str
    model: str
    runtime_identity: str
    tenant_domain: str
    worker: WorkerId
    at: float
    cause: str
    """How it went: `lru` (released, then evicted by the engine for room), `reaper_evict`,
    `pressure`, `capped`, `expired` (its hold given back), `worker_lost`, `operator`."""


@dataclass(frozen=True, slots=True)
class ResidencyEvent:
    """A residency decision about a session's KV (hold, demote, evict, release, with why),
    or what became of it (given back by its worker, evicted)."""

    at: float
    session_id: SessionId
    worker: WorkerId | None
    action: str
    reason: str
    tokens: int = 0
    tier: CacheTier | None = None
    figures_json: str | None = None
    """The numbers behind it as JSON: the decision's kind, hold end, inputs and costs."""


@dataclass(frozen=True, slots=True)
class WorkerPowerEvent:
    """A worker put to sleep, stopped or woken by the worker reaper: the state it left
    (and how long it was in it: `state_s` times `gpus` is that state's GPU-seconds), the
    state it reached, and how long the change took, measured."""

    at: float
    worker: WorkerId
    action: str
    """sleep, stop or wake."""
    from_state: str
    to_state: str
    duration_s: float
    state_s: float
    gpus: int
    reason: str


@dataclass(frozen=True, slots=True)
class AdmissionEvent:
    """An admission decision: admit, queue or deny, with its reason."""

    at: float
    tenant: TenantId
    decision: str
    reason: str
    task_id: TaskId | None = None
    queue_depth: int | None = None


@dataclass(frozen=True, slots=True)
class RouteDecisionRecord:
    """Where one attempt was placed and why: every candidate with its scores."""

    turn_id: TurnId
    at: float
    worker: WorkerId | None
    reason: str
    candidates_json: str
    """[{"worker", "score", "scores": {...}, "resident_tokens", "ttft_estimate_s"}, ...]"""


@dataclass(frozen=True, slots=True)
class Price:
    """One version of the price list. Prices per million tokens (tokens mode) or per
    GPU-second (gpu_seconds mode), and in gpu_seconds mode the box's overhead: energy per
    kWh and the box per hour (policy/overhead.py). A turn is costed with the version in
    effect at its `finished_at`, a usage period at its end, and keeps that cost when a later
    version arrives."""

    mode: CostMode
    effective_from: float
    currency: str = "USD"
    fresh_per_mtok: float = 0.0
    cached_per_mtok: float = 0.0
    output_per_mtok: float = 0.0
    reasoning_per_mtok: float = 0.0
    gpu_second: float = 0.0
    price_id: PriceId | None = None
    """Assigned by the ledger when the version is stored."""
    energy_per_kwh: float = 0.0
    box_per_hour: float = 0.0

    def __post_init__(self) -> None:
        _require(all(r >= 0 for r in self._rates()), "a price cannot be negative")

    def _rates(self) -> tuple[float, ...]:
        return (
            self.fresh_per_mtok,
            self.cached_per_mtok,
            self.output_per_mtok,
            self.reasoning_per_mtok,
            self.gpu_second,
            self.energy_per_kwh,
            self.box_per_hour,
        )

    def same_rates(self, other: Price) -> bool:
        """Equal in everything a cost depends on (not the id or the start time)."""
        return (self.mode, self.currency, self._rates()) == (
            other.mode,
            other.currency,
            other._rates(),
        )


@dataclass(frozen=True, slots=True)
class OpenTask:
    """An open task as a restarted appliance reads it back from its ledger."""

    task_id: str
    """The ledger's id: tenant/client id."""
    tenant: str
    parent_task_id: str | None
    task_class: str | None
    created_at: float
    deadline_at: float | None
    turns: int
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    cost: float


@dataclass(frozen=True, slots=True)
class ArchivedTask(OpenTask):
    """A task as its ledger keeps it, open or closed: one the task book no longer holds (it
    forgot it, or it closed before a restart)."""

    status: TaskStatus = TaskStatus.OPEN
    verified: bool | None = None


@dataclass(frozen=True, slots=True)
class RecentSession:
    """A recent session as a restarted appliance reads it back from its ledger."""

    session_id: str
    """The session's own id (the ledger keys it tenant/id)."""
    tenant: str
    task_id: str | None
    worker: str | None
    created_at: float
    last_active_at: float | None
