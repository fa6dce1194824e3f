"""Whether a new task or a model turn may enter the box now: admit, or deny with a reason.

Model of the world. The box is a few engine workers, each with a queue of prefill work the
router has sent and not yet seen start. Work arrives in two shapes: a task (created by
`POST /v1/tasks`, or implicitly by the first model turn that names it) and a model turn of a
task. The appliance holds no queue of its own: an admitted turn goes straight to a worker
and waits in that worker's queue, so admission is the one place that can say no early,
before any worker spends time on work that will be refused or fail late. It says no, in
this order, when:

  deadline_passed      the task's deadline (the earlier of its own and its parent's)
                       is already behind `now`                                       (429)
  budget_exhausted     the task, or an ancestor, has a budget and its subtree has
                       spent it (a turn that would start past it; a new task under it) (429)
  depth_cap            a new task would sit deeper than `max_depth` below its root    (429)
  children_cap         its parent already has its cap of open children: the parent's
                       own `max_children`, clipped to `max_children_per_task` (also the
                       cap of a parent that set none)                                 (429)
  overloaded           every healthy worker's estimated queue exceeds the queue bound
                       of the work's priority: `max_queue_s + priority *
                       queue_s_per_priority` (never below 0), so higher priority
                       tolerates a longer queue                                       (503)
  deadline_infeasible  the estimated wait for the turn's first token (queue, wake, and
                       this turn's prefill) at the worker placement chose for it (with
                       none chosen: the fastest) ends after the deadline; a task
                       without a turn yet counts the fastest queue alone             (429)
  tenant_over_share    the box is saturated (in-flight turns >= `turns_per_worker` per
                       healthy worker, or open tasks >= `max_open_tasks`), another
                       tenant has work on it, and the tenant already holds its weighted
                       share of that capacity: capacity * its weight / the summed
                       weights of the tenants with work on the box (the tenant asking
                       always counts). A tenant alone may use everything, beyond the
                       capacity too (then only the queue bound says no); one under its
                       share is never refused for fairness                            (429)

Priority is the client's `X-Priority` (0 when absent) clipped to the tenant's ceiling.
Every refusal carries the seconds after which a retry may succeed: the queue excess for
an overload, `retry_after_s` for the rest. With no healthy worker the queue checks have
nothing to judge and pass; the router then answers 503 itself. Estimates are the router's
(queued prefill seconds per worker, the prefill model of the GPU profile); this module
receives numbers, never the router. Pure: no clock, no I/O; the caller passes `now`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from appliance.policy.deadline_share import WorkerEstimate, judged_worker


class Work(StrEnum):
    TASK = "task"
    """A new task with no turn yet (POST /v1/tasks)."""
    TURN = "turn"
    """A model turn of a task the box already has."""
    TASK_TURN = "task_turn"
    """A model turn that creates its task (the first turn of an implicit task)."""

    @property
    def opens_task(self) -> bool:
        return self is not Work.TURN

    @property
    def runs_turn(self) -> bool:
        return self is not Work.TASK


class Verdict(StrEnum):
    ADMIT = "admit"
    DENY = "deny"


class AdmitCode(StrEnum):
    """A decision's stable code: "admitted", or why not (the error code the client sees)."""

    ADMITTED = "admitted"
    DEADLINE_PASSED = "deadline_passed"
    BUDGET_EXHAUSTED = "budget_exhausted"
    DEPTH_CAP = "depth_cap"
    CHILDREN_CAP = "children_cap"
    OVERLOADED = "overloaded"
    DEADLINE_INFEASIBLE = "deadline_infeasible"
    TENANT_OVER_SHARE = "tenant_over_share"


@dataclass(frozen=True, slots=True)
class AdmissionLimits:
    """The thresholds of the model of the world above (from the `admission` settings)."""

    turns_per_worker: int = 64
    max_open_tasks: int = 1024
    default_weight: float = 1.0
    tenant_weights: Mapping[str, float] = field(default_factory=dict)
    max_children_per_task: int = 64
    max_depth: int = 8
    max_queue_s: float = 30.0
    queue_s_per_priority: float = 10.0
    default_priority_ceiling: int = 0
    priority_ceilings: Mapping[str, int] = field(default_factory=dict)
    retry_after_s: float = 1.0

    def weight(self, tenant: str) -> float:
        return self.tenant_weights.get(tenant, self.default_weight)

    def ceiling(self, tenant: str) -> int:
        return self.priority_ceilings.get(tenant, self.default_priority_ceiling)

    def queue_bound_s(self, priority: int) -> float:
        return max(0.0, self.max_queue_s + priority * self.queue_s_per_priority)


@dataclass(frozen=True, slots=True)
class ParentLoad:
    """The parent of a new task."""

    task_id: str
    open_children: int
    """Its children that are still open (closed and forgotten ones do not count)."""
    max_children: int | None
    """The cap the parent asked for when it was created; None: none."""
    depth: int
    """0 for a root task."""


@dataclass(frozen=True, slots=True)
class TenantLoad:
    in_flight_turns: int = 0
    open_tasks: int = 0


@dataclass(frozen=True, slots=True)
class AdmitRequest:
    tenant: str
    work: Work
    priority: int | None = None
    """X-Priority as sent; None: not sent."""
    deadline_at: float | None = None
    """When the task must be done (Unix seconds); None: no deadline."""
    budget_left: float | None = None
    """The least budget left over the task and its ancestors; None: no budget."""
    parent: ParentLoad | None = None
    """Only for work that opens a task with a parent."""


@dataclass(frozen=True, slots=True)
class BoxLoad:
    tenants: Mapping[str, TenantLoad]
    """Every tenant with work on the box (others count as idle)."""
    workers: Sequence[WorkerEstimate]
    """Healthy workers that take new work (not draining)."""
    placed: str | None = None
    """The worker placement chose for the turn; None: none (a task alone, all resting)."""

    @property
    def judged(self) -> WorkerEstimate | None:
        """The worker a turn's deadline is judged on (`judged_worker`)."""
        return judged_worker(self.workers, self.placed)

    @property
    def in_flight_turns(self) -> int:
        return sum(t.in_flight_turns for t in self.tenants.values())

    @property
    def open_tasks(self) -> int:
        return sum(t.open_tasks for t in self.tenants.values())


@dataclass(frozen=True, slots=True)
class AdmitDecision:
    verdict: Verdict
    code: AdmitCode
    reason: str
    """One line with the numbers behind the decision."""
    priority: int
    """The priority the work runs at (X-Priority clipped to the tenant's ceiling)."""
    http_status: int = 200
    retry_after_s: float | None = None
    first_token_s: float | None = None
    """An admitted turn's estimated first token at the judged worker (`BoxLoad.judged`)."""

    @property
    def admitted(self) -> bool:
        return self.verdict is Verdict.ADMIT


def effective_priority(request: AdmitRequest, limits: AdmissionLimits) -> int:
    asked = request.priority if request.priority is not None else 0
    return min(asked, limits.ceiling(request.tenant))


def turn_capacity(box: BoxLoad, limits: AdmissionLimits) -> int:
    """In-flight turns at which the box counts as saturated."""
    return limits.turns_per_worker * max(1, len(box.workers))


def fair_share(
    tenant: str, loads: Mapping[str, int], capacity: float, limits: AdmissionLimits
) -> float:
    """`tenant`'s weighted share of `capacity` among the tenants with load and itself."""
    active = {t for t, n in loads.items() if n > 0} | {tenant}
    total = sum(limits.weight(t) for t in active)
    return capacity * limits.weight(tenant) / total


def admit(
    request: AdmitRequest, box: BoxLoad, limits: AdmissionLimits, now: float
) -> AdmitDecision:
    """The decision for `request` on a box loaded as `box`, at time `now`."""
    priority = effective_priority(request, limits)
    for check in _CHECKS:
        refusal = check(request, box, limits, now, priority)
        if refusal is not None:
            return refusal
    best = box.judged
    first = best.first_token_s if best is not None else None
    wait = f"; {_quoted(box, best, 'fastest')} in {first:.3f} s" if best is not None else ""
    reason = f"admitted at priority {priority}{wait}"
    return AdmitDecision(Verdict.ADMIT, AdmitCode.ADMITTED, reason, priority, first_token_s=first)


def _deny(
    code: AdmitCode,
    reason: str,
    priority: int,
    limits: AdmissionLimits,
    *,
    status: int = 429,
    retry_after_s: float | None = None,
) -> AdmitDecision:
    retry = max(limits.retry_after_s, retry_after_s or 0.0)
    return AdmitDecision(Verdict.DENY, code, reason, priority, status, retry)


def _deadline_passed(
    request: AdmitRequest, box: BoxLoad, limits: AdmissionLimits, now: float, priority: int
) -> AdmitDecision | None:
    if request.deadline_at is None or now < request.deadline_at:
        return None
    late = now - request.deadline_at
    return _deny(
        AdmitCode.DEADLINE_PASSED, f"the task's deadline passed {late:.3f} s ago", priority, limits
    )


def _budget_exhausted(
    request: AdmitRequest, box: BoxLoad, limits: AdmissionLimits, now: float, priority: int
) -> AdmitDecision | None:
    if request.budget_left is None or request.budget_left > 0:
        return None
    over = max(0.0, -request.budget_left)  # no "-0"
    return _deny(
        AdmitCode.BUDGET_EXHAUSTED,
        f"the task tree has spent its budget ({over:.6g} over)",
        priority,
        limits,
    )


def _depth_cap(
    request: AdmitRequest, box: BoxLoad, limits: AdmissionLimits, now: float, priority: int
) -> AdmitDecision | None:
    parent = request.parent
    if parent is None or not request.work.opens_task or parent.depth + 1 <= limits.max_depth:
        return None
    return _deny(
        AdmitCode.DEPTH_CAP,
        f"a child of {parent.task_id} would sit at depth {parent.depth + 1}; "
        f"admission.max_depth is {limits.max_depth}",
        priority,
        limits,
    )


def _children_cap(
    request: AdmitRequest, box: BoxLoad, limits: AdmissionLimits, now: float, priority: int
) -> AdmitDecision | None:
    parent = request.parent
    if parent is None or not request.work.opens_task:
        return None
    cap, named = limits.max_children_per_task, "admission.max_children_per_task"
    if parent.max_children is not None and parent.max_children < cap:
        cap, named = parent.max_children, "its max_children"
    if parent.open_children < cap:
        return None
    return _deny(
        AdmitCode.CHILDREN_CAP,
        f"task {parent.task_id} has {parent.open_children} open children; {named} is {cap}",
        priority,
        limits,
    )


def _overloaded(
    request: AdmitRequest, box: BoxLoad, limits: AdmissionLimits, now: float, priority: int
) -> AdmitDecision | None:
    if not box.workers:
        return None
    bound = limits.queue_bound_s(priority)
    shortest = min(w.queue_s for w in box.workers)
    if shortest <= bound:
        return None
    return _deny(
        AdmitCode.OVERLOADED,
        f"every healthy worker's queue exceeds {bound:.3f} s (the bound at priority "
        f"{priority}); the shortest is {shortest:.3f} s",
        priority,
        limits,
        status=503,
        retry_after_s=shortest - bound,
    )


def _deadline_infeasible(
    request: AdmitRequest, box: BoxLoad, limits: AdmissionLimits, now: float, priority: int
) -> AdmitDecision | None:
    if request.deadline_at is None or not box.workers:
        return None
    left = request.deadline_at - now
    w = box.judged
    if w is None or w.first_token_s <= left:
        return None
    waking = f"wake {w.wake_s:.3f} s + " if w.wake_s > 0 else ""
    whose = _quoted(box, w, "fastest worker's")
    return _deny(
        AdmitCode.DEADLINE_INFEASIBLE,
        f"the deadline is {left:.3f} s away, but the {whose} is {w.first_token_s:.3f} s away "
        f"({waking}queue {w.queue_s:.3f} s + prefill {w.prefill_s:.3f} s)",
        priority,
        limits,
    )


def _quoted(box: BoxLoad, w: WorkerEstimate, fastest: str) -> str:
    """The first token a decision quotes: at placement's choice, else the fastest's."""
    placed = f"first token at {w.worker}, placement's choice,"
    return placed if w.worker == box.placed else f"{fastest} first token"


def _fair_share(
    request: AdmitRequest, box: BoxLoad, limits: AdmissionLimits, now: float, priority: int
) -> AdmitDecision | None:
    measures: list[tuple[str, Callable[[TenantLoad], int], float]] = []
    if request.work.runs_turn:
        measures.append(("in-flight turns", _turns, turn_capacity(box, limits)))
    if request.work.opens_task:
        measures.append(("open tasks", _tasks, limits.max_open_tasks))
    for what, measure, capacity in measures:
        loads = {t: measure(load) for t, load in box.tenants.items()}
        if sum(loads.values()) < capacity:
            continue  # not saturated: anyone may use the room
        if not any(n > 0 for t, n in loads.items() if t != request.tenant):
            continue  # alone on the box: nobody to be fair to (the queue bound still holds)
        share = fair_share(request.tenant, loads, capacity, limits)
        held = loads.get(request.tenant, 0)
        if held < share:
            continue
        return _deny(
            AdmitCode.TENANT_OVER_SHARE,
            f"the box is saturated ({sum(loads.values())} {what}, capacity {capacity:g}) and "
            f"tenant {request.tenant} holds {held}, at or above its share of {share:.2f}",
            priority,
            limits,
        )
    return None


def _turns(load: TenantLoad) -> int:
    return load.in_flight_turns


def _tasks(load: TenantLoad) -> int:
    return load.open_tasks


_Check = Callable[[AdmitRequest, BoxLoad, AdmissionLimits, float, int], AdmitDecision | None]
_CHECKS: tuple[_Check, ...] = (
    _deadline_passed,
    _budget_exhausted,
    _depth_cap,
    _children_cap,
    _overloaded,
    _deadline_infeasible,
    _fair_share,
)
