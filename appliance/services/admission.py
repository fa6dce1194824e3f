"""The admission controller: the box's counters, the policy's decision, and its records.

It holds what the policy judges (appliance/policy/admission.py states the model of the
world and every threshold): turns in flight per tenant, open tasks per tenant, and per task
its parent, depth, cap and open children. A task opens when admission admits it (POST
/v1/tasks, or the first model turn that names it; a turn without a task id is a one-turn
task that closes when its turn ends) and closes at its terminal event or cancel. An open
task with no turn in flight, no new turn and no new child for `task_idle_s` is forgotten:
it stops counting toward its tenant's open tasks and its parent's children, so a client
that never closes its tasks cannot lock itself out.

Queue estimates are the router's (queued prefill seconds per worker) and the prefill of a
turn comes from the same cost model the router uses, over the prefix its session likely
left resident. Every refusal is written to the ledger's `admission_events` (decision
"deny", reason "code: why", queue_depth = turns in flight on the box) and acknowledged
before the client hears no, and goes to the operator event feed; accepts and rejects are
counted for `/admin/v1/state` and `/metrics`.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

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
    WorkerEstimate,
    admit,
)
from appliance.policy.routing import PrefillCost
from appliance.ports import Clock, Ledger, WorkerEndpoint
from appliance.services.events import EventFeed, EventKind
from appliance.services.sessions import SessionState

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


@dataclass(eq=False)
class _Task:
    tenant: TenantId
    parent: TaskId | None
    depth: int
    max_children: int | None
    deadline_at: float | None
    last_active_at: float
    one_turn: bool = False
    open: bool = True
    open_children: int = 0
    in_flight: int = 0


class TurnTicket:
    """One admitted turn. Release it when the turn ends; releasing twice counts once."""

    def __init__(self, service: AdmissionService, task_id: TaskId) -> None:
        self._service = service
        self._task_id = task_id
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._service._release(self._task_id)


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

    def estimates(
        self,
        resident: Mapping[WorkerId, int],
        prompt_tokens: int,
        queues: Mapping[WorkerId, float] | None = None,
    ) -> list[WorkerEstimate]:
        """`queues`: each worker's queue estimate now, when the caller has them."""
        estimates = []
        for w in self.workers():
            if not w.healthy or w.draining:
                continue
            reused = min(resident.get(w.id, 0), max(0, prompt_tokens - 1))
            fresh = prompt_tokens - reused
            prefill = (
                self.cost.prefill_s(fresh, reused) * self.slowdown(w.id) if prompt_tokens else 0.0
            )
            queue = queues[w.id] if queues is not None else self.queue_s(w)
            estimates.append(WorkerEstimate(queue, prefill))
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
        estimator: WorkerEstimator,
        ledger: Ledger,
        clock: Clock,
        task_idle_s: float = 600.0,
        events: EventFeed | None = None,
    ) -> None:
        self.limits = limits
        self._estimator = estimator
        self._ledger = ledger
        self._clock = clock
        self._task_idle_s = task_idle_s
        self._events = events
        self._tasks: dict[TaskId, _Task] = {}
        self._idle: OrderedDict[TaskId, None] = OrderedDict()
        """Open tasks with no turn in flight, least recently active first."""
        self._turns: dict[TenantId, int] = {}
        self._open: dict[TenantId, int] = {}
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
        max_children: int | None = None,
        deadline_s: float | None = None,
        priority: int | None = None,
    ) -> AdmitDecision | None:
        """Admits a new task (POST /v1/tasks) or raises AdmissionRefused. A task it already
        knows is not judged again (None): the task book answers that it exists."""
        if task_id in self._tasks:
            return None
        now = self._clock.now()
        self._forget_idle(now)
        deadline_at = now + deadline_s if deadline_s is not None else None
        request = AdmitRequest(tenant, Work.TASK, priority, deadline_at, self._parent_load(parent))
        decision = admit(request, self._box(now, {}, 0), self.limits, now)
        await self._count(decision, request, task_id, now)
        self._open_task(tenant, task_id, now, parent, max_children, deadline_at, one_turn=False)
        return decision

    async def admit_turn(
        self,
        tenant: TenantId,
        task_id: TaskId,
        *,
        parent: TaskId | None = None,
        one_turn: bool = False,
        deadline_s: float | None = None,
        priority: int | None = None,
        prompt_tokens: int = 0,
        resident_tokens: Mapping[WorkerId, int] | None = None,
        queues: Mapping[WorkerId, float] | None = None,
    ) -> TurnTicket:
        """Admits one model turn of `task_id` (opening the task when it is new; `one_turn`:
        it closes with this turn) or raises AdmissionRefused. Release the ticket when the
        turn ends. `queues`: each worker's queue estimate now, when the caller has them."""
        now = self._clock.now()
        self._forget_idle(now)
        known = self._tasks.get(task_id)
        deadline_at = now + deadline_s if deadline_s is not None else None
        if known is not None and known.deadline_at is not None:
            deadline_at = min(known.deadline_at, deadline_at or known.deadline_at)
        work = Work.TURN if known is not None else Work.TASK_TURN
        request = AdmitRequest(
            tenant,
            work,
            priority,
            deadline_at,
            self._parent_load(parent) if work is Work.TASK_TURN else None,
        )
        box = self._box(now, resident_tokens or {}, prompt_tokens, queues)
        decision = admit(request, box, self.limits, now)
        await self._count(decision, request, task_id, now)
        if known is None:
            self._open_task(tenant, task_id, now, parent, None, deadline_at, one_turn=one_turn)
        task = self._tasks[task_id]
        task.in_flight += 1
        task.last_active_at = now
        self._idle.pop(task_id, None)
        self._turns[tenant] = self._turns.get(tenant, 0) + 1
        return TurnTicket(self, task_id)

    def task_closed(self, task_id: TaskId) -> None:
        """The task reached a terminal status (succeeded, failed, cancelled)."""
        task = self._tasks.get(task_id)
        if task is not None and task.open:
            self._close(task_id, task)

    # --- the counters ----------------------------------------------------------------

    def _box(
        self,
        now: float,
        resident: Mapping[WorkerId, int],
        prompt_tokens: int,
        queues: Mapping[WorkerId, float] | None = None,
    ) -> BoxLoad:
        estimates = self._estimator.estimates(resident, prompt_tokens, queues)
        tenants: dict[str, TenantLoad] = {
            t: TenantLoad(self._turns.get(t, 0), self._open.get(t, 0))
            for t in self._turns.keys() | self._open.keys()
        }
        return BoxLoad(tenants, estimates)

    def _parent_load(self, parent: TaskId | None) -> ParentLoad | None:
        if parent is None:
            return None
        client_id = parent.split("/", 1)[-1]
        known = self._tasks.get(parent)
        if known is None:  # the task book opens an unknown parent as a root
            return ParentLoad(client_id, 0, None, 0)
        return ParentLoad(client_id, known.open_children, known.max_children, known.depth)

    def _open_task(
        self,
        tenant: TenantId,
        task_id: TaskId,
        now: float,
        parent: TaskId | None,
        max_children: int | None,
        deadline_at: float | None,
        *,
        one_turn: bool,
    ) -> None:
        depth = 0
        if parent is not None:
            if parent not in self._tasks:
                self._open_task(tenant, parent, now, None, None, None, one_turn=False)
            above = self._tasks[parent]
            depth = above.depth + 1
            above.open_children += 1
            above.last_active_at = now
            if parent in self._idle:
                self._idle.move_to_end(parent)
        self._tasks[task_id] = _Task(
            tenant, parent, depth, max_children, deadline_at, now, one_turn=one_turn
        )
        self._idle[task_id] = None
        self._open[tenant] = self._open.get(tenant, 0) + 1

    def _close(self, task_id: TaskId, task: _Task) -> None:
        task.open = False
        self._idle.pop(task_id, None)
        _decrement(self._open, task.tenant)
        above = self._tasks.get(task.parent) if task.parent is not None else None
        if above is not None:
            above.open_children -= 1

    def _release(self, task_id: TaskId) -> None:
        task = self._tasks[task_id]
        task.in_flight -= 1
        task.last_active_at = self._clock.now()
        _decrement(self._turns, task.tenant)
        if task.one_turn and task.in_flight == 0:
            self.task_closed(task_id)
        elif task.open and task.in_flight == 0:
            self._idle[task_id] = None
            self._idle.move_to_end(task_id)

    def _forget_idle(self, now: float) -> None:
        horizon = now - self._task_idle_s
        while self._idle:
            task_id = next(iter(self._idle))
            task = self._tasks[task_id]
            if task.last_active_at > horizon:
                return
            self._close(task_id, task)

    # --- accounting ------------------------------------------------------------------

    async def _count(
        self, decision: AdmitDecision, request: AdmitRequest, task_id: TaskId, now: float
    ) -> None:
        """Counts the decision; a refusal is recorded and raised."""
        if decision.admitted:
            self.accepted += 1
            self._accept_rate.add(now)
            return
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
            queue_depth=sum(self._turns.values()),
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
        self._forget_idle(now)
        return {
            "accepted": self.accepted,
            "rejected": self.rejected,
            "accept_rate_per_s": round(self._accept_rate.per_s(now), 6),
            "reject_rate_per_s": round(self._reject_rate.per_s(now), 6),
            "by_reason": dict(self.rejected_by_code),
            "in_flight_turns": sum(self._turns.values()),
            "open_tasks": sum(self._open.values()),
            "tenants": {
                t: {"in_flight_turns": self._turns.get(t, 0), "open_tasks": self._open.get(t, 0)}
                for t in sorted(self._turns.keys() | self._open.keys())
            },
        }

    def metric_families(self) -> Iterator[Metric]:
        """Its Prometheus metrics (`appliance_admission_*`)."""
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
            sum(self._turns.values()),
        )
        yield GaugeMetricFamily(
            "appliance_admission_open_tasks",
            "Open tasks admission counts.",
            sum(self._open.values()),
        )


def _decrement(counts: dict[TenantId, int], tenant: TenantId) -> None:
    left = counts.get(tenant, 0) - 1
    if left > 0:
        counts[tenant] = left
    else:
        counts.pop(tenant, None)
