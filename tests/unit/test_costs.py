"""The cost formulas against numbers worked out by hand (in the comments), never by calling
the code under test."""

from __future__ import annotations

import pytest

from appliance.domain.records import (
    CostMode,
    Price,
    PriceId,
    TaskId,
    TaskStatus,
    TenantId,
    TurnId,
    TurnOutcome,
    TurnRecord,
    can_transition,
)
from appliance.policy.costs import (
    AttemptRow,
    CostGroup,
    PriceBook,
    TaskRow,
    attempt_cost,
    cost_per_success,
    turn_cost,
)

# Per million tokens: fresh 2.0, cached 0.5, output 10.0, reasoning 20.0.
P1 = Price(
    CostMode.TOKENS,
    effective_from=0.0,
    fresh_per_mtok=2.0,
    cached_per_mtok=0.5,
    output_per_mtok=10.0,
    reasoning_per_mtok=20.0,
    price_id=PriceId(1),
)
# From t=1000 every rate doubles.
P2 = Price(
    CostMode.TOKENS,
    effective_from=1000.0,
    fresh_per_mtok=4.0,
    cached_per_mtok=1.0,
    output_per_mtok=20.0,
    reasoning_per_mtok=40.0,
    price_id=PriceId(2),
)
GPU = Price(CostMode.GPU_SECONDS, effective_from=0.0, gpu_second=0.001, fresh_per_mtok=99.0)


@pytest.mark.parametrize(
    ("price", "usage", "expected"),
    [
        # 1M fresh * 2.0 = 2.0
        (P1, {"fresh_tokens": 1_000_000}, 2.0),
        # 2M cached * 0.5 = 1.0
        (P1, {"cached_tokens": 2_000_000}, 1.0),
        # 100k output * 10.0/M = 1.0 ; 50k reasoning * 20.0/M = 1.0
        (P1, {"output_tokens": 100_000, "reasoning_tokens": 50_000}, 2.0),
        # 2.0 + 1.0 + 1.0 + 1.0 + tool 0.25 = 5.25
        (
            P1,
            {
                "fresh_tokens": 1_000_000,
                "cached_tokens": 2_000_000,
                "output_tokens": 100_000,
                "reasoning_tokens": 50_000,
                "tool_cost": 0.25,
            },
            5.25,
        ),
        # 600 fresh*2 + 400 cached*0.5 + 100 out*10 = 1200 + 200 + 1000 = 2400 /1M = 0.0024
        (P1, {"fresh_tokens": 600, "cached_tokens": 400, "output_tokens": 100}, 0.0024),
        # the same usage at the doubled price: 0.0048
        (P2, {"fresh_tokens": 600, "cached_tokens": 400, "output_tokens": 100}, 0.0048),
        # gpu_seconds: 1000 s * 0.001 + tool 0.5 = 1.5; token counts do not matter
        (GPU, {"gpu_s": 1000.0, "tool_cost": 0.5, "fresh_tokens": 10**9}, 1.5),
        # gpu_seconds with no GPU time: only the tool
        (GPU, {"tool_cost": 0.2}, 0.2),
    ],
)
def test_attempt_cost(price: Price, usage: dict[str, float], expected: float) -> None:
    assert attempt_cost(price, **usage) == pytest.approx(expected)  # type: ignore[arg-type]


def _turn(finished_at: float, *, prompt: int, cached: int, out: int) -> TurnRecord:
    return TurnRecord(
        turn_id=TurnId("u"),
        tenant=TenantId("acme"),
        task_id=TaskId("t"),
        session_id=None,
        worker=None,
        model="m",
        prompt_tokens=prompt,
        cached_tokens=cached,
        output_tokens=out,
        outcome=TurnOutcome.OK,
        started_at=finished_at - 1.0,
        finished_at=finished_at,
        gpu_s=3.0,
    )


def test_turn_cost_prices_fresh_tokens_as_prompt_minus_cached() -> None:
    # prompt 1000, cached 400 -> fresh 600: 600*2 + 400*0.5 + 100*10 = 2400 / 1M
    assert turn_cost(_turn(10.0, prompt=1000, cached=400, out=100), P1) == pytest.approx(0.0024)
    # gpu_s 3.0 * 0.001 = 0.003
    assert turn_cost(_turn(10.0, prompt=1000, cached=400, out=100), GPU) == pytest.approx(0.003)


def test_price_book_picks_the_version_in_effect_at_the_turns_end() -> None:
    book = PriceBook([P2, P1])  # any insertion order
    assert book.at(-1.0) is None  # before any price: unpriced
    assert book.at(0.0) is P1
    assert book.at(999.9) is P1
    assert book.at(1000.0) is P2
    assert book.latest() is P2
    # A turn before the change keeps P1's cost (0.0024), one after gets P2's (0.0048).
    old, new = (
        _turn(500.0, prompt=1000, cached=400, out=100),
        _turn(1500.0, prompt=1000, cached=400, out=100),
    )
    assert turn_cost(old, book.at(old.finished_at) or P2) == pytest.approx(0.0024)
    assert turn_cost(new, book.at(new.finished_at) or P1) == pytest.approx(0.0048)


S, F, C, OPEN = TaskStatus.SUCCEEDED, TaskStatus.FAILED, TaskStatus.CANCELLED, TaskStatus.OPEN

# The hand-checked ledger. Costs are what the writer stored per attempt.
TASKS = [
    # A: succeeded, verified; one failed attempt then a retry.
    TaskRow("A", "acme", 100.0, task_class="code", status=S, verified=True),
    # B: failed.
    TaskRow("B", "acme", 110.0, task_class="code", status=F),
    # C: succeeded but nobody verified it: its cost counts, it is no success.
    TaskRow("C", "acme", 120.0, task_class="code", status=S, verified=False),
    # D: an orchestrator that fanned out D1 (which has a child D1a) and D2 (discarded);
    # the children have another class and are created after `until`, yet roll up into D.
    TaskRow("D", "acme", 130.0, task_class="code", status=S, verified=True),
    TaskRow("D1", "acme", 200.0, parent_task_id="D", task_class="sub", status=S, verified=True),
    TaskRow("D1a", "acme", 210.0, parent_task_id="D1", task_class="sub", status=S),
    TaskRow("D2", "acme", 205.0, parent_task_id="D", task_class="sub", status=C),
    # E: cancelled.
    TaskRow("E", "acme", 140.0, task_class="code", status=C),
    # F: another class, failed: zero successes in its group.
    TaskRow("F", "acme", 150.0, task_class="review", status=F),
    # G: another tenant, succeeded and verified.
    TaskRow("G", "beta", 145.0, task_class="code", status=S, verified=True),
    # H: still open, no attempts yet.
    TaskRow("H", "beta", 146.0, task_class="code", status=OPEN),
]
ATTEMPTS = [
    AttemptRow("A", "acme", 101.0, 0.5),  # failed attempt
    AttemptRow("A", "acme", 102.0, 1.0),  # retry that succeeded          A = 1.5
    AttemptRow("B", "acme", 111.0, 2.0),  #                               B = 2.0
    AttemptRow("C", "acme", 121.0, 0.25),  #                              C = 0.25
    AttemptRow("D", "acme", 131.0, 0.5),
    AttemptRow("D1", "acme", 201.0, 1.0),
    AttemptRow("D1a", "acme", 211.0, 0.25),
    AttemptRow("D2", "acme", 206.0, 0.75),  # discarded branch     D tree = 2.5
    AttemptRow("E", "acme", 141.0, 0.3),  #                               E = 0.3
    AttemptRow("F", "acme", 151.0, 0.4),  #                               F = 0.4
    AttemptRow("G", "beta", 146.0, 0.8),  #                               G = 0.8
]


def test_cost_per_success_by_class_and_tenant() -> None:
    groups = cost_per_success(TASKS, ATTEMPTS)
    assert groups == [
        # code/acme: roots A B C D E = 5; successes A, D = 2;
        # cost 1.5 + 2.0 + 0.25 + 2.5 + 0.3 = 6.55; per success 6.55 / 2 = 3.275;
        # attempts 2 + 1 + 1 + 4 + 1 = 9
        CostGroup("code", "acme", None, 5, 2, 9, 0, pytest.approx(6.55), pytest.approx(3.275)),
        # code/beta: G (0.8, verified) and H (open, nothing spent): 0.8 / 1
        CostGroup("code", "beta", None, 2, 1, 1, 0, pytest.approx(0.8), pytest.approx(0.8)),
        # review/acme: F failed: cost 0.4, no success -> None (not inf, not 0)
        CostGroup("review", "acme", None, 1, 0, 1, 0, pytest.approx(0.4), None),
    ]


def test_cost_per_success_by_tenant_only() -> None:
    groups = cost_per_success(TASKS, ATTEMPTS, by=("tenant",))
    assert [(g.task_class, g.tenant, g.tasks, g.succeeded) for g in groups] == [
        (None, "acme", 6, 2),
        (None, "beta", 2, 1),
    ]
    # acme: 6.55 + 0.4 = 6.95, / 2 = 3.475
    assert groups[0].cost == pytest.approx(6.95)
    assert groups[0].cost_per_success == pytest.approx(3.475)


def test_window_is_the_roots_creation_time() -> None:
    # [100, 135): roots A B C D; D's children (created 200..210) still count.
    (g,) = cost_per_success(TASKS, ATTEMPTS, by=("tenant",), since=100.0, until=135.0)
    # 1.5 + 2.0 + 0.25 + 2.5 = 6.25; successes A, D -> 3.125
    assert (g.tenant, g.tasks, g.succeeded) == ("acme", 4, 2)
    assert g.cost == pytest.approx(6.25)
    assert g.cost_per_success == pytest.approx(3.125)
    # A window that holds only the children's creation times holds no root at all.
    assert cost_per_success(TASKS, ATTEMPTS, since=190.0, until=220.0) == []


def test_windows_of_fixed_length() -> None:
    groups = cost_per_success(TASKS, ATTEMPTS, by=(), since=100.0, window_s=20.0)
    assert [(g.window_start, g.tasks, g.succeeded) for g in groups] == [
        (100.0, 2, 1),  # A B: 1.5 + 2.0 = 3.5 / 1
        (120.0, 2, 1),  # C D: 0.25 + 2.5 = 2.75 / 1
        (140.0, 4, 1),  # E F G H: 0.3 + 0.4 + 0.8 = 1.5 / 1
    ]
    assert [g.cost_per_success for g in groups] == [
        pytest.approx(3.5),
        pytest.approx(2.75),
        pytest.approx(1.5),
    ]


def test_zero_successes_is_none_even_with_no_cost() -> None:
    tasks = [
        TaskRow("X", "t", 1.0, task_class="c", status=F),
        TaskRow("Y", "t", 2.0, task_class="c"),
    ]
    (g,) = cost_per_success(tasks, [AttemptRow("X", "t", 1.5, 0.0)])
    assert (g.tasks, g.succeeded, g.cost, g.cost_per_success) == (2, 0, 0.0, None)


def test_unpriced_and_taskless_attempts_are_counted_not_dropped() -> None:
    tasks = [TaskRow("A", "acme", 10.0, task_class="code", status=S, verified=True)]
    attempts = [
        AttemptRow("A", "acme", 11.0, 1.0),
        AttemptRow("A", "acme", 12.0, None, attempts=3),  # three turns with no price
        AttemptRow("ghost", "acme", 13.0, 0.5),  # its task row is missing
        AttemptRow(None, "acme", 14.0, 0.25),  # a turn without a task
    ]
    groups = cost_per_success(tasks, attempts)
    assert [
        (g.task_class, g.tenant, g.tasks, g.attempts, g.unpriced_attempts, g.cost) for g in groups
    ] == [
        # the two orphans: their own roots with no class; 0.5 + 0.25 = 0.75
        (None, "acme", 2, 2, 0, pytest.approx(0.75)),
        # A: 1 priced + 3 unpriced attempts, cost 1.0
        ("code", "acme", 1, 4, 3, pytest.approx(1.0)),
    ]


def test_a_parent_cycle_or_missing_parent_loses_no_cost() -> None:
    tasks = [
        TaskRow("P", "t", 1.0, parent_task_id="Q"),
        TaskRow("Q", "t", 2.0, parent_task_id="P"),
        TaskRow("K", "t", 3.0, parent_task_id="gone"),  # its parent was never recorded
    ]
    attempts = [AttemptRow("P", "t", 1.0, 1.0), AttemptRow("K", "t", 3.0, 2.0)]
    (g,) = cost_per_success(tasks, attempts)
    assert (g.tasks, g.cost) == (2, pytest.approx(3.0))


def test_unknown_group_is_refused() -> None:
    with pytest.raises(ValueError, match="worker"):
        cost_per_success(TASKS, ATTEMPTS, by=("worker",))


@pytest.mark.parametrize(
    ("current", "new", "allowed"),
    [
        (OPEN, S, True),
        (OPEN, F, True),
        (OPEN, C, True),
        (OPEN, OPEN, False),
        (S, F, False),
        (F, S, False),
        (C, S, False),
        (S, OPEN, False),
    ],
)
def test_task_transitions_terminal_states_are_final(
    current: TaskStatus, new: TaskStatus, allowed: bool
) -> None:
    # The cost rule counts a root's final status; only an open task may still change.
    assert can_transition(current, new) is allowed
    assert current.is_terminal is (current is not OPEN)


def test_a_turn_with_more_cached_than_prompt_tokens_is_refused() -> None:
    with pytest.raises(ValueError, match="cached_tokens exceeds prompt_tokens"):
        _turn(1.0, prompt=100, cached=101, out=0)
