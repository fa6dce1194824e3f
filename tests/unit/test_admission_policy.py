"""The admission policy: table-driven decisions and the invariants (caps never exceeded, a
tenant under its share never refused for fairness)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from appliance.policy.admission import (
    AdmissionLimits,
    AdmitRequest,
    BoxLoad,
    ParentLoad,
    TenantLoad,
    Verdict,
    Work,
    admit,
    fair_share,
)
from appliance.policy.deadline_share import WorkerEstimate, effective_deadline

NOW = 1000.0
LIMITS = AdmissionLimits(
    turns_per_worker=4,
    max_open_tasks=6,
    tenant_weights={"big": 3.0},
    max_children_per_task=3,
    max_depth=2,
    max_queue_s=10.0,
    queue_s_per_priority=5.0,
    default_priority_ceiling=1,
    priority_ceilings={"batch": -1},
    retry_after_s=2.0,
)
IDLE = (WorkerEstimate(0.0, 0.05), WorkerEstimate(0.5, 0.05))


def box(*workers: WorkerEstimate, **tenants: tuple[int, int]) -> BoxLoad:
    return BoxLoad({t: TenantLoad(*load) for t, load in tenants.items()}, workers or IDLE)


def parent(open_children: int, max_children: int | None = None, depth: int = 0) -> ParentLoad:
    return ParentLoad("p", open_children, max_children, depth)


CASES = [
    # (description, request, box, code, status, reason fragment)
    (
        "an idle box admits a turn",
        AdmitRequest("a", Work.TURN),
        box(),
        "admitted",
        200,
        "fastest first token in 0.050 s",
    ),
    (
        "a deadline already behind now is refused",
        AdmitRequest("a", Work.TURN, deadline_at=NOW - 1.5),
        box(),
        "deadline_passed",
        429,
        "passed 1.500 s ago",
    ),
    (
        "a deadline exactly at now is past",
        AdmitRequest("a", Work.TASK, deadline_at=NOW),
        box(),
        "deadline_passed",
        429,
        "passed 0.000 s ago",
    ),
    (
        "a turn whose task tree has spent its budget is refused",
        AdmitRequest("a", Work.TURN, budget_left=-0.25),
        box(),
        "budget_exhausted",
        429,
        "spent its budget (0.25 over)",
    ),
    (
        "a budget spent to the last cent is spent",
        AdmitRequest("a", Work.TASK, budget_left=0.0),
        box(),
        "budget_exhausted",
        429,
        "(0 over)",
    ),
    (
        "a budget with a little left admits the turn",
        AdmitRequest("a", Work.TURN, budget_left=1e-9),
        box(),
        "admitted",
        200,
        "admitted",
    ),
    (
        "a passed deadline is said before a spent budget",
        AdmitRequest("a", Work.TURN, deadline_at=NOW - 1.0, budget_left=-1.0),
        box(),
        "deadline_passed",
        429,
        "passed",
    ),
    (
        "queue plus prefill beyond the deadline is infeasible",
        AdmitRequest("a", Work.TURN, deadline_at=NOW + 0.04),
        box(),
        "deadline_infeasible",
        429,
        "queue 0.000 s + prefill 0.050 s",
    ),
    (
        "the fastest worker decides feasibility",
        AdmitRequest("a", Work.TURN, deadline_at=NOW + 1.0),
        box(WorkerEstimate(5.0, 0.0), WorkerEstimate(0.2, 0.7)),
        "admitted",
        200,
        "0.900 s",
    ),
    (
        "a task alone counts the queue, not a prefill",
        AdmitRequest("a", Work.TASK, deadline_at=NOW + 0.01),
        box(WorkerEstimate(0.0, 0.0)),
        "admitted",
        200,
        "admitted",
    ),
    (
        "a child within the parent's own cap is admitted",
        AdmitRequest("a", Work.TASK, parent=parent(1, max_children=2)),
        box(),
        "admitted",
        200,
        "admitted",
    ),
    (
        "a child beyond the parent's max_children is refused, naming that cap",
        AdmitRequest("a", Work.TASK, parent=parent(2, max_children=2)),
        box(),
        "children_cap",
        429,
        "its max_children is 2",
    ),
    (
        "a parent's max_children above the global cap is clipped to it",
        AdmitRequest("a", Work.TASK_TURN, parent=parent(3, max_children=50)),
        box(),
        "children_cap",
        429,
        "admission.max_children_per_task is 3",
    ),
    (
        "without its own cap a parent gets the global one",
        AdmitRequest("a", Work.TASK, parent=parent(3)),
        box(),
        "children_cap",
        429,
        "admission.max_children_per_task is 3",
    ),
    (
        "max_children 0 forbids children",
        AdmitRequest("a", Work.TASK, parent=parent(0, max_children=0)),
        box(),
        "children_cap",
        429,
        "its max_children is 0",
    ),
    (
        "a turn of a known task is never judged by its parent's cap",
        AdmitRequest("a", Work.TURN, parent=parent(9, max_children=1)),
        box(),
        "admitted",
        200,
        "admitted",
    ),
    (
        "a child deeper than max_depth is refused",
        AdmitRequest("a", Work.TASK, parent=parent(0, depth=2)),
        box(),
        "depth_cap",
        429,
        "depth 3; admission.max_depth is 2",
    ),
    (
        "every queue above the bound is an overload (503)",
        AdmitRequest("a", Work.TURN),
        box(WorkerEstimate(12.0), WorkerEstimate(14.0)),
        "overloaded",
        503,
        "exceeds 10.000 s",
    ),
    (
        "one short queue is enough to admit",
        AdmitRequest("a", Work.TURN),
        box(WorkerEstimate(12.0), WorkerEstimate(9.0)),
        "admitted",
        200,
        "admitted",
    ),
    (
        "higher priority tolerates a longer queue",
        AdmitRequest("a", Work.TURN, priority=1),
        box(WorkerEstimate(12.0), WorkerEstimate(14.0)),
        "admitted",
        200,
        "priority 1",
    ),
    (
        "priority is clipped by the tenant's ceiling",
        AdmitRequest("a", Work.TURN, priority=5),
        box(WorkerEstimate(16.0)),
        "overloaded",
        503,
        "bound at priority 1",
    ),
    (
        "a tenant with a low ceiling tolerates less queue even when asking for more",
        AdmitRequest("batch", Work.TURN, priority=3),
        box(WorkerEstimate(6.0)),
        "overloaded",
        503,
        "exceeds 5.000 s",
    ),
    (
        "no healthy worker: the queue checks pass and the router answers",
        AdmitRequest("a", Work.TURN, deadline_at=NOW + 0.001),
        BoxLoad({}, ()),
        "admitted",
        200,
        "admitted",
    ),
    (
        "a tenant alone may use the whole box",
        AdmitRequest("a", Work.TURN),
        box(a=(7, 0)),
        "admitted",
        200,
        "admitted",
    ),
    (
        "a saturated box refuses a tenant at its share",
        AdmitRequest("a", Work.TURN),
        box(a=(4, 0), b=(4, 0)),
        "tenant_over_share",
        429,
        "holds 4, at or above its share of 4.00",
    ),
    (
        "a saturated box still admits a tenant under its share",
        AdmitRequest("c", Work.TURN),
        box(a=(6, 0), b=(2, 0)),
        "admitted",
        200,
        "admitted",
    ),
    (
        "weights shape the share: weight 3 of 4 holds 6 of 8",
        AdmitRequest("big", Work.TURN),
        box(big=(5, 0), b=(3, 0)),
        "admitted",
        200,
        "admitted",
    ),
    (
        "open tasks are shared the same way",
        AdmitRequest("a", Work.TASK),
        box(a=(0, 4), b=(0, 2)),
        "tenant_over_share",
        429,
        "open tasks",
    ),
    (
        "a turn of a known task does not count open tasks",
        AdmitRequest("a", Work.TURN),
        box(a=(0, 4), b=(0, 2)),
        "admitted",
        200,
        "admitted",
    ),
    # --- boundaries: a limit exactly reached ----------------------------------------------
    (
        "a child exactly at max_depth is admitted",
        AdmitRequest("a", Work.TASK, parent=parent(0, depth=1)),
        box(),
        "admitted",
        200,
        "admitted",
    ),
    (
        "a parent's own cap equal to the global one is reported as the global cap",
        AdmitRequest("a", Work.TASK, parent=parent(3, max_children=3)),
        box(),
        "children_cap",
        429,
        "task p has 3 open children; admission.max_children_per_task is 3",
    ),
    (
        "a queue exactly at the bound is admitted",
        AdmitRequest("a", Work.TURN),
        box(WorkerEstimate(10.0)),
        "admitted",
        200,
        "admitted",
    ),
    (
        "a first token exactly at the deadline is feasible",
        AdmitRequest("a", Work.TURN, deadline_at=NOW + 0.5),
        box(WorkerEstimate(0.25, 0.25)),
        "admitted",
        200,
        "fastest first token in 0.500 s",
    ),
    (
        "a low priority's queue bound stops at zero: any queue is too long",
        AdmitRequest("a", Work.TURN, priority=-3),
        box(WorkerEstimate(0.5)),
        "overloaded",
        503,
        "exceeds 0.000 s (the bound at priority -3); the shortest is 0.500 s",
    ),
    (
        "an empty queue meets a bound of zero",
        AdmitRequest("a", Work.TURN, priority=-3),
        box(WorkerEstimate(0.0)),
        "admitted",
        200,
        "admitted at priority -3",
    ),
    # --- fair share: what counts as company and as capacity --------------------------------
    (
        "a tenant with no turns in flight is no company for turns",
        AdmitRequest("a", Work.TURN),
        box(a=(8, 0), b=(0, 3)),
        "admitted",
        200,
        "admitted",
    ),
    (
        "a tenant new to the box holds nothing, even with a share under one turn",
        AdmitRequest("new", Work.TURN),
        box(WorkerEstimate(0.0), b=(1, 0), c=(1, 0), d=(1, 0), e=(1, 0)),
        "admitted",
        200,
        "admitted",
    ),
    (
        "a box of one worker saturates at one worker's turns",
        AdmitRequest("a", Work.TURN),
        box(WorkerEstimate(0.0), a=(2, 0), b=(2, 0)),
        "tenant_over_share",
        429,
        "saturated (4 in-flight turns, capacity 4) and tenant a holds 2",
    ),
    (
        "a box with no healthy worker counts one worker's turns as its capacity",
        AdmitRequest("a", Work.TURN),
        BoxLoad({"a": TenantLoad(2, 0), "b": TenantLoad(2, 0)}, ()),
        "tenant_over_share",
        429,
        "saturated (4 in-flight turns, capacity 4)",
    ),
    (
        "a task-opening turn on an unsaturated box is still judged by open tasks",
        AdmitRequest("a", Work.TASK_TURN),
        box(a=(0, 4), b=(0, 2)),
        "tenant_over_share",
        429,
        "saturated (6 open tasks, capacity 6) and tenant a holds 4, at or above its share of 3.00",
    ),
    (
        "a task-opening turn alone in turns is still judged by shared open tasks",
        AdmitRequest("a", Work.TASK_TURN),
        box(a=(8, 4), b=(0, 2)),
        "tenant_over_share",
        429,
        "saturated (6 open tasks, capacity 6)",
    ),
    (
        "a task-opening turn under its turn share is still judged by open tasks",
        AdmitRequest("a", Work.TASK_TURN),
        box(a=(2, 4), b=(6, 2)),
        "tenant_over_share",
        429,
        "saturated (6 open tasks, capacity 6)",
    ),
]


@pytest.mark.parametrize(
    ("request_", "load", "code", "status", "fragment"),
    [c[1:] for c in CASES],
    ids=[c[0] for c in CASES],
)
def test_decisions(
    request_: AdmitRequest, load: BoxLoad, code: str, status: int, fragment: str
) -> None:
    decision = admit(request_, load, LIMITS, NOW)
    assert (decision.code, decision.http_status) == (code, status), decision.reason
    assert fragment in decision.reason
    if code == "admitted":
        assert decision.verdict is Verdict.ADMIT and decision.retry_after_s is None
    else:
        assert decision.verdict is Verdict.DENY
        assert decision.retry_after_s is not None and decision.retry_after_s >= 2.0


def test_overload_retry_after_is_the_queue_excess() -> None:
    decision = admit(AdmitRequest("a", Work.TURN), box(WorkerEstimate(17.5)), LIMITS, NOW)
    assert decision.code == "overloaded"
    assert decision.retry_after_s == pytest.approx(7.5)


@pytest.mark.parametrize(
    ("request_", "load", "code"),
    [
        (AdmitRequest("a", Work.TURN, priority=5, deadline_at=NOW - 1.0), box(), "deadline_passed"),
        (AdmitRequest("a", Work.TASK, priority=5, parent=parent(0, depth=2)), box(), "depth_cap"),
        (AdmitRequest("a", Work.TASK, priority=5, parent=parent(3)), box(), "children_cap"),
        (AdmitRequest("a", Work.TURN, priority=5), box(WorkerEstimate(20.0)), "overloaded"),
        (
            AdmitRequest("a", Work.TURN, priority=5, deadline_at=NOW + 0.04),
            box(),
            "deadline_infeasible",
        ),
        (AdmitRequest("a", Work.TURN, priority=5), box(a=(4, 0), b=(4, 0)), "tenant_over_share"),
    ],
    ids=[
        "deadline_passed",
        "depth_cap",
        "children_cap",
        "overloaded",
        "deadline_infeasible",
        "tenant_over_share",
    ],
)
def test_every_refusal_carries_the_clipped_priority(
    request_: AdmitRequest, load: BoxLoad, code: str
) -> None:
    decision = admit(request_, load, LIMITS, NOW)
    assert decision.code == code
    assert decision.priority == 1  # X-Priority 5 clipped to the default ceiling 1


@pytest.mark.parametrize(
    ("load", "reason"),
    [
        (box(), "admitted at priority 0; fastest first token in 0.050 s"),
        (BoxLoad({}, ()), "admitted at priority 0"),
    ],
    ids=["with workers: the fastest first token", "no worker: no wait to quote"],
)
def test_the_admission_reason(load: BoxLoad, reason: str) -> None:
    assert admit(AdmitRequest("a", Work.TURN), load, LIMITS, NOW).reason == reason


@pytest.mark.parametrize(
    ("request_", "load", "code", "retry_after_s"),
    [
        (AdmitRequest("a", Work.TURN, deadline_at=NOW - 1.0), box(), "deadline_passed", 0.25),
        (AdmitRequest("a", Work.TURN), box(WorkerEstimate(10.1)), "overloaded", 0.25),
        (AdmitRequest("a", Work.TURN), box(WorkerEstimate(10.75)), "overloaded", 0.75),
    ],
    ids=["a refusal: the setting", "a small overload: the setting", "an overload: its excess"],
)
def test_retry_after_is_the_setting_even_below_a_second(
    request_: AdmitRequest, load: BoxLoad, code: str, retry_after_s: float
) -> None:
    limits = AdmissionLimits(max_queue_s=10.0, retry_after_s=0.25)
    decision = admit(request_, load, limits, NOW)
    assert decision.code == code
    assert decision.retry_after_s == pytest.approx(retry_after_s)


def test_effective_priority_defaults_to_zero_and_respects_a_negative_ceiling() -> None:
    assert admit(AdmitRequest("a", Work.TURN), box(), LIMITS, NOW).priority == 0
    assert admit(AdmitRequest("a", Work.TURN, priority=-3), box(), LIMITS, NOW).priority == -3
    assert admit(AdmitRequest("batch", Work.TURN), box(), LIMITS, NOW).priority == -1


# --- invariants --------------------------------------------------------------------------

TENANTS = ["a", "b", "big", "batch"]
loads = st.dictionaries(
    st.sampled_from(TENANTS),
    st.tuples(st.integers(0, 12), st.integers(0, 12)),
    max_size=4,
)
workers = st.lists(
    st.builds(WorkerEstimate, st.floats(0, 30), st.floats(0, 2)), min_size=0, max_size=4
)
works = st.sampled_from(list(Work))


@given(st.sampled_from(TENANTS), works, loads, workers)
def test_a_tenant_under_its_share_is_never_refused_for_fairness(
    tenant: str, work: Work, tenant_loads: dict[str, tuple[int, int]], ws: list[WorkerEstimate]
) -> None:
    load = BoxLoad({t: TenantLoad(*n) for t, n in tenant_loads.items()}, ws)
    decision = admit(AdmitRequest(tenant, work), load, LIMITS, NOW)
    if decision.code != "tenant_over_share":
        return
    # Refused for fairness: the box is saturated in some measure and the tenant holds at
    # least its weighted share of it (computed here from the definition).
    turns = {t: n[0] for t, n in tenant_loads.items()}
    tasks = {t: n[1] for t, n in tenant_loads.items()}
    saturated = []
    if work.runs_turn:
        saturated.append((turns, LIMITS.turns_per_worker * max(1, len(ws))))
    if work.opens_task:
        saturated.append((tasks, LIMITS.max_open_tasks))
    assert any(
        sum(held.values()) >= cap
        and held.get(tenant, 0)
        >= cap
        * LIMITS.weight(tenant)
        / sum(LIMITS.weight(t) for t in {t for t, n in held.items() if n} | {tenant})
        for held, cap in saturated
    )


@given(st.sampled_from(TENANTS), st.integers(0, 50))
def test_a_tenant_alone_is_never_refused_for_fairness(tenant: str, held: int) -> None:
    """Beyond the box's turn capacity too: with nobody to be fair to, only the queue bound
    (`overloaded`) can say no."""
    load = BoxLoad({tenant: TenantLoad(held, 0)}, IDLE)
    decision = admit(AdmitRequest(tenant, Work.TURN), load, LIMITS, NOW)
    assert decision.code != "tenant_over_share"
    crowded = BoxLoad({tenant: TenantLoad(held, 0), "other": TenantLoad(1, 0)}, IDLE)
    decision = admit(AdmitRequest(tenant, Work.TURN), crowded, LIMITS, NOW)
    capacity = LIMITS.turns_per_worker * len(IDLE)
    share = capacity * LIMITS.weight(tenant) / (LIMITS.weight(tenant) + LIMITS.weight("other"))
    saturated = held + 1 >= capacity
    assert (decision.code == "tenant_over_share") == (saturated and held >= share)


@given(
    st.lists(
        st.tuples(st.sampled_from(["open", "close"]), st.integers(0, 7), st.integers(0, 5)),
        max_size=120,
    ),
    st.lists(st.one_of(st.none(), st.integers(0, 6)), min_size=8, max_size=8),
)
def test_caps_are_never_exceeded(
    steps: list[tuple[str, int, int]], own_caps: list[int | None]
) -> None:
    """Tasks 0..7 open and close children through the policy; every parent's open children
    stay within its cap and no task sits deeper than max_depth."""
    depth = {i: 0 for i in range(8)}
    open_children: dict[int, list[int]] = {i: [] for i in range(8)}
    next_id = 8
    for action, p, k in steps:
        if action == "close":
            if open_children[p]:
                open_children[p].pop(min(k, len(open_children[p]) - 1))
            continue
        request = AdmitRequest(
            "a",
            Work.TASK,
            parent=ParentLoad(str(p), len(open_children[p]), own_caps[p % 8], depth[p]),
        )
        if admit(request, box(), LIMITS, NOW).admitted:
            child = next_id
            next_id += 1
            depth[child] = depth[p] + 1
            open_children[child] = []
            open_children[p].append(child)
        cap = LIMITS.max_children_per_task
        own = own_caps[p % 8]
        if own is not None:
            cap = min(cap, own)
        assert len(open_children[p]) <= cap
        assert all(d <= LIMITS.max_depth for d in depth.values())


@given(st.sampled_from(TENANTS), works, loads, workers, st.floats(-5, 5) | st.none())
def test_every_decision_has_a_reason_and_a_refusal_a_retry(
    tenant: str,
    work: Work,
    tenant_loads: dict[str, tuple[int, int]],
    ws: list[WorkerEstimate],
    deadline_in_s: float | None,
) -> None:
    load = BoxLoad({t: TenantLoad(*n) for t, n in tenant_loads.items()}, ws)
    deadline = NOW + deadline_in_s if deadline_in_s is not None else None
    decision = admit(AdmitRequest(tenant, work, deadline_at=deadline), load, LIMITS, NOW)
    assert decision.reason
    if decision.admitted:
        assert decision.http_status == 200
    else:
        assert decision.http_status in (429, 503)
        assert decision.retry_after_s is not None and math.isfinite(decision.retry_after_s)
        assert decision.retry_after_s >= LIMITS.retry_after_s


def test_fair_share_counts_only_tenants_with_load_and_the_asker() -> None:
    assert fair_share("a", {"a": 0, "b": 0}, 8, LIMITS) == 8
    assert fair_share("a", {"b": 3, "c": 0}, 8, LIMITS) == 4
    assert fair_share("b", {"big": 1, "b": 1}, 8, LIMITS) == 2


@pytest.mark.parametrize(
    ("deadline_s", "parent_at", "expected"),
    [
        (None, None, None),
        (5.0, None, NOW + 5.0),
        (None, NOW + 2.0, NOW + 2.0),
        (5.0, NOW + 2.0, NOW + 2.0),  # the parent's is earlier: it binds the child
        (1.0, NOW + 2.0, NOW + 1.0),  # the child's own is earlier
    ],
)
def test_a_tasks_deadline_is_the_earlier_of_its_own_and_its_parents(
    deadline_s: float | None, parent_at: float | None, expected: float | None
) -> None:
    assert effective_deadline(NOW, deadline_s, parent_at) == expected


def test_a_wake_counts_against_the_deadline_and_is_named_in_the_refusal() -> None:
    """A worker put to rest serves after its wake: a deadline shorter than the wake plus
    the prefill is refused before any worker starts, and the message says so."""
    resting = WorkerEstimate(0.0, 0.5, wake_s=40.0)
    assert resting.first_token_s == 40.5
    late = admit(AdmitRequest("a", Work.TURN, deadline_at=NOW + 40.0), box(resting), LIMITS, NOW)
    assert late.code == "deadline_infeasible"
    assert "(wake 40.000 s + queue 0.000 s + prefill 0.500 s)" in late.reason
    fits = admit(AdmitRequest("a", Work.TURN, deadline_at=NOW + 41.0), box(resting), LIMITS, NOW)
    assert fits.code == "admitted"
    awake = admit(
        AdmitRequest("a", Work.TURN, deadline_at=NOW + 0.1),
        box(WorkerEstimate(0.0, 0.5)),
        LIMITS,
        NOW,
    )
    assert "wake" not in awake.reason and "(queue 0.000 s + prefill 0.500 s)" in awake.reason
