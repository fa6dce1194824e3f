"""The admission controller: the policy's decision over the box's load, and its records.

The policy (appliance/policy/admission.py) states the model of the world and every
threshold. What it judges is read here: the tasks' load (turns in flight and open tasks per
tenant, and a new task's parent: its depth, cap and open children) from the task book
through `TaskView`, which alone keeps the tasks and lets go of those idle too long
(services/tasks/tasks.py); and each healthy worker's queue and a turn's prefill there from
`WorkerEstimator`. Admission decides; the caller then opens the task or starts the turn in
the task book.

Queue estimates are the router's (queued prefill seconds per worker) and the prefill of a
turn comes from the same cost model the router uses. The turn desk places a turn before
admission judges it and names the worker placement chose (`placed`) with the prefix the KV
index holds there, so a deadline is judged on the worker the turn will go to, with the
numbers placement ranked it by; with no worker chosen (every one resting), on the fastest,
over the prefix its session likely left resident (`resident_hint`). Every refusal is
written to the ledger's `admission_events` (decision "deny", reason "code: why",
queue_depth = turns in flight on the box) and acknowledged before the client hears no, and
goes to the operator event feed; accepts and rejects are counted for `/admin/v1/state` and
`/metrics`.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from appliance.domain.block_hash import cacheable_tokens
from appliance.domain.errors import ApplianceError
from appliance.domain.records import AdmissionEvent, TaskId, TenantId, WorkerId
from appliance.policy.admission import (
    AdmissionLimits,
    AdmitCode,
    AdmitDecision,
    AdmitRequest,
    BoxLoad,
    ParentLoad,
    TenantLoad,
    Work,
    admit,
)
from appliance.policy.deadline_share import WorkerEstimate, effective_deadline
from appliance.policy.routing import PrefillCost
from appliance.ports import Clock, Ledger, WorkerEndpoint
from appliance.services.operator.events import EventFeed, EventKind
from appliance.services.sessions.sessions import SessionState

log = logging.getLogger(__name__)
RATE_WINDOW_S = 60.0


class AdmissionRefused(ApplianceError):
    """Admission said no: `code` and `http_status` (429 or 503) are the decision's; the API
    sends `retry_after_s` as Retry-After."""

    code = "admission_refused"
    http_status = 429

    def __init__(self, decision: AdmitDecision) -> None:
        super().__init__(decision.reason, code=decision.code, http_status=decision.http_status)
        self.decision = decision
        self.retry_after_s = decision.retry_after_s


class KnownTask(Protocol):
    """A task of the book, as admission reads it."""

    @property
    def parent(self) -> TaskId | None: ...
    @property
    def deadline_at(self) -> float | None: ...
    @property
    def unseen(self) -> bool:
        """Taken back after a restart and named by no turn since: its next turn is judged
        as opening it."""
        ...


class TaskView(Protocol):
    """What admission reads of the tasks; the task book (services/tasks/tasks.py) answers."""

    def find(self, key: TaskId) -> KnownTask | None: ...
    def budget_left(self, key: TaskId) -> float | None:
        """The least budget left over the task and its ancestors; None: no budget."""
        ...

    def parent_load(self, key: TaskId) -> ParentLoad | None:
        """The task as the parent of a new one; None when there is no such task."""
        ...

    def tenant_loads(self, now: float) -> Mapping[str, TenantLoad]:
        """Turns in flight and open tasks per tenant as of `now`."""
        ...


def _same_speed(worker: WorkerId) -> float:
    return 1.0


@dataclass(frozen=True, slots=True)
class WorkerEstimator:
    """Each healthy worker's queue and a turn's prefill there: the router's queue estimate,
    and its cost model at the worker's measured speed."""

    workers: Callable[[], Sequence[WorkerEndpoint]]
    queue_s: Callable[[WorkerEndpoint], float]
    cost: PrefillCost
    slowdown: Callable[[WorkerId], float] = _same_speed
    """Each worker's prefill seconds per second of the cost model's (WorkerSpeeds)."""
    wake_s: Callable[[WorkerId], float | None] = lambda worker: None
    """Seconds until a worker put to rest serves (WorkerReaper.wake_s; None: not resting)."""

    def estimates(
        self,
        resident: Mapping[WorkerId, int],
        prompt_tokens: int,
        queues: Mapping[WorkerId, float] | None = None,
    ) -> list[WorkerEstimate]:
        """`queues`: each worker's queue estimate now, when the caller has them."""
        estimates = []
        for w in self.workers():
            wake = 0.0 if w.healthy else self.wake_s(w.id)
            if wake is None or w.draining:
                continue
            reused = min(resident.get(w.id, 0), max(0, prompt_tokens - 1)) if not wake else 0
            fresh = prompt_tokens - reused
            prefill = (
                self.cost.prefill_s(fresh, reused) * self.slowdown(w.id) if prompt_tokens else 0.0
            )
            queue = queues.get(w.id, 0.0) if queues is not None else self.queue_s(w)
            estimates.append(WorkerEstimate(queue, prefill, wake, w.id))
        return estimates


class _Rate:
    """Events per second over the last RATE_WINDOW_S, counted in one-second buckets."""

    def __init__(self) -> None:
        self._buckets: deque[list[int]] = deque()

    def add(self, now: float) -> None:
        second = math.floor(now)
        if self._buckets and self._buckets[-1][0] == second:
            self._buckets[-1][1] += 1
        else:
            self._buckets.append([second, 1])
        self._prune(now)

    def per_s(self, now: float) -> float:
        self._prune(now)
        return sum(n for _, n in self._buckets) / RATE_WINDOW_S

    def _prune(self, now: float) -> None:
        while self._buckets and self._buckets[0][0] <= now - RATE_WINDOW_S:
            self._buckets.popleft()


def resident_hint(session: SessionState | None, prompt_tokens: int) -> dict[WorkerId, int]:
    """Leading prompt tokens likely resident per worker: the previous turn's prompt where it
    ran, the KV index's last view elsewhere. Optimistic on purpose, so that a deadline is
    refused only when even the best case misses it."""
    if session is None:
        return {}
    chain = session.chain
    bs = chain.block_size if chain is not None else 1
    cap = cacheable_tokens(prompt_tokens, bs)
    resident = {w: min(n, cap) for w, n in session.resident_tokens.items()}
    if session.home is not None and chain is not None:
        previous = min(len(chain.hashes) * chain.block_size, cap)
        resident[session.home] = max(resident.get(session.home, 0), previous)
    return resident


class AdmissionService:
    def __init__(
        self,
        *,
        limits: AdmissionLimits,
        tasks: TaskView,
        estimator: WorkerEstimator,
        ledger: Ledger,
        clock: Clock,
        events: EventFeed | None = None,
    ) -> None:
        self.limits = limits
        self._tasks = tasks
        self._estimator = estimator
        self._ledger = ledger
        self._clock = clock
        self._events = events
        self.accepted = 0
        self.rejected = 0
        self.rejected_by_code: dict[AdmitCode, int] = {}
        self._accept_rate = _Rate()
        self._reject_rate = _Rate()

    # --- decisions -------------------------------------------------------------------

    async def admit_task(
        self,
        tenant: TenantId,
        task_id: TaskId,
        *,
        parent: TaskId | None = None,
        deadline_s: float | None = None,
        priority: int | None = None,
    ) -> AdmitDecision | None:
        """Judges a new task (POST /v1/tasks): the decision, or AdmissionRefused. A task the
        book has already is not judged again (None): the book answers that it exists. The
        caller opens the task in the book."""
        if self._tasks.find(task_id) is not None:
            return None
        now = self._clock.now()
        box = BoxLoad(self._tasks.tenant_loads(now), self._estimator.estimates({}, 0))
        request = AdmitRequest(
            tenant,
            Work.TASK,
            priority,
            effective_deadline(now, deadline_s, self._deadline_of(parent)),
            self._budget_of(parent),
            self._parent_load(parent),
        )
        return await self._judged(request, box, task_id, now)

    async def admit_turn(
        self,
        tenant: TenantId,
        task_id: TaskId,
        *,
        parent: TaskId | None = None,
        deadline_s: float | None = None,
        priority: int | None = None,
        prompt_tokens: int = 0,
        resident_tokens: Mapping[WorkerId, int] | None = None,
        queues: Mapping[WorkerId, float] | None = None,
        placed: WorkerId | None = None,
    ) -> AdmitDecision:
        """Judges one model turn of `task_id` (opening the task when it is new, under
        `parent`): the decision, or AdmissionRefused. The caller opens the task and starts
        the turn in the book. `queues`: each worker's queue estimate now, when the caller
        has them; `placed`: the worker placement chose for the turn, whose estimate its
        deadline is judged on (None: the fastest's)."""
        now = self._clock.now()
        tenants = self._tasks.tenant_loads(now)  # first: it lets go of idle tasks
        known = self._tasks.find(task_id)
        if known is not None:
            parent = known.parent  # taken back after a restart: its own parent
            deadline_at = effective_deadline(now, deadline_s, known.deadline_at)
            budget_left = self._tasks.budget_left(task_id)
        else:  # opened by this turn, under its parent's deadline and budget
            deadline_at = effective_deadline(now, deadline_s, self._deadline_of(parent))
            budget_left = self._budget_of(parent)
        opens = known is None or known.unseen
        request = AdmitRequest(
            tenant,
            Work.TASK_TURN if opens else Work.TURN,
            priority,
            deadline_at,
            budget_left,
            self._parent_load(parent) if opens else None,
        )
        estimates = self._estimator.estimates(resident_tokens or {}, prompt_tokens, queues)
        return await self._judged(request, BoxLoad(tenants, estimates, placed), task_id, now)

    def _deadline_of(self, task: TaskId | None) -> float | None:
        known = self._tasks.find(task) if task is not None else None
        return known.deadline_at if known is not None else None

    def _budget_of(self, task: TaskId | None) -> float | None:
        return self._tasks.budget_left(task) if task is not None else None

    def _parent_load(self, parent: TaskId | None) -> ParentLoad | None:
        if parent is None:
            return None
        # The task book opens an unknown parent as a root.
        return self._tasks.parent_load(parent) or ParentLoad(parent.split("/", 1)[-1], 0, None, 0)

    # --- accounting ------------------------------------------------------------------

    async def _judged(
        self, request: AdmitRequest, box: BoxLoad, task_id: TaskId, now: float
    ) -> AdmitDecision:
        """The policy's decision, counted; a refusal is recorded and raised."""
        decision = admit(request, box, self.limits, now)
        if decision.admitted:
            self.accepted += 1
            self._accept_rate.add(now)
            if log.isEnabledFor(logging.DEBUG):  # the hot path: no formatting at INFO
                log.debug("admission admitted %s of tenant %s", task_id, request.tenant)
            return decision
        self.rejected += 1
        self._reject_rate.add(now)
        self.rejected_by_code[decision.code] = self.rejected_by_code.get(decision.code, 0) + 1
        detail = f"{decision.code}: {decision.reason}"
        log.info("admission refused %s of tenant %s: %s", task_id, request.tenant, detail)
        if self._events is not None:
            subject = task_id.split("/", 1)[-1]
            self._events.record(now, EventKind.REJECTION, subject, detail, tenant=request.tenant)
        event = AdmissionEvent(
            now,
            TenantId(request.tenant),
            decision.verdict.value,
            detail,
            task_id,
            queue_depth=box.in_flight_turns,
        )
        try:  # acknowledged before the client hears no
            await asyncio.wrap_future(self._ledger.record_admission_event(event))
        except ApplianceError as exc:
            log.error("ledger refused an admission event: %s", exc.message)
        raise AdmissionRefused(decision)

    def snapshot(self) -> dict[str, Any]:
        """state["admission"]: totals, rates over the last minute, refusals by code, and
        what each tenant holds now."""
        now = self._clock.now()
        tenants = self._tasks.tenant_loads(now)
        return {
            "accepted": self.accepted,
            "rejected": self.rejected,
            "accept_rate_per_s": round(self._accept_rate.per_s(now), 6),
            "reject_rate_per_s": round(self._reject_rate.per_s(now), 6),
            "by_reason": dict(self.rejected_by_code),
            "in_flight_turns": sum(t.in_flight_turns for t in tenants.values()),
            "open_tasks": sum(t.open_tasks for t in tenants.values()),
            "tenants": {
                t: {"in_flight_turns": load.in_flight_turns, "open_tasks": load.open_tasks}
                for t, load in sorted(tenants.items())
            },
        }

    def metric_families(self) -> Iterator[Metric]:
        """Its Prometheus metrics (`appliance_admission_*`)."""
        box = BoxLoad(self._tasks.tenant_loads(self._clock.now()), ())
        yield CounterMetricFamily(
            "appliance_admission_accepted", "Tasks and turns admission let in.", self.accepted
        )
        rejected = CounterMetricFamily(
            "appliance_admission_rejected",
            "Tasks and turns admission refused, by reason.",
            labels=["reason"],
        )
        for code, n in sorted(self.rejected_by_code.items()):
            rejected.add_metric([code], n)
        yield rejected
        yield GaugeMetricFamily(
            "appliance_admission_in_flight_turns",
            "Admitted turns not finished yet.",
            box.in_flight_turns,
        )
        yield GaugeMetricFamily(
            "appliance_admission_open_tasks",
            "Open tasks admission counts.",
            box.open_tasks,
        )
