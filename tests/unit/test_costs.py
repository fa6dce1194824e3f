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
    group_row,
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
        # 150k output of which 50k reasoning, each token priced once:
        # 100k other output * 10.0/M = 1.0 ; 50k reasoning * 20.0/M = 1.0
        (P1, {"output_tokens": 150_000, "reasoning_tokens": 50_000}, 2.0),
        # a worker that says more reasoning than output: the output is all reasoning,
        # 10k * 20.0/M = 0.2
        (P1, {"output_tokens": 10_000, "reasoning_tokens": 50_000}, 0.2),
        # 2.0 + 1.0 + 1.0 + 1.0 + tool 0.25 = 5.25
        (
            P1,
            {
                "fresh_tokens": 1_000_000,
                "cached_tokens": 2_000_000,
                "output_tokens": 150_000,
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


def _turn(
    finished_at: float,
    *,
    prompt: int,
    cached: int,
    out: int,
    reasoning: int = 0,
    tool_cost: float = 0.0,
    gpu_s: float = 3.0,
) -> TurnRecord:
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
        reasoning_tokens=reasoning,
        outcome=TurnOutcome.OK,
        started_at=finished_at - 1.0,
        finished_at=finished_at,
        gpu_s=gpu_s,
        tool_cost=tool_cost,
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


def test_a_turn_cannot_say_more_reasoning_than_output() -> None:
    with pytest.raises(ValueError, match="reasoning_tokens exceeds output_tokens"):
        _turn(10.0, prompt=0, cached=0, out=10, reasoning=11)


def test_attempt_cost_of_no_usage_is_zero() -> None:
    # Every count defaults to zero: an attempt that used nothing costs nothing, in both modes.
    assert attempt_cost(P1) == 0.0
    assert attempt_cost(GPU) == 0.0


def test_turn_cost_counts_reasoning_tokens_and_tool_cost() -> None:
    # 50k output, all reasoning: 50k * 20.0/M = 1.0 (not also 50k * 10.0/M as output),
    # + tool 0.25 = 1.25 (no prompt tokens)
    turn = _turn(10.0, prompt=0, cached=0, out=50_000, reasoning=50_000, tool_cost=0.25, gpu_s=0)
    assert turn_cost(turn, P1) == pytest.approx(1.25)
    # gpu_seconds mode, no GPU time: only the tool, 0.25
    assert turn_cost(turn, GPU) == pytest.approx(0.25)


# From t=2000 every rate of P1 triples.
P3 = Price(
    CostMode.TOKENS,
    effective_from=2000.0,
    fresh_per_mtok=6.0,
    cached_per_mtok=1.5,
    output_per_mtok=30.0,
    reasoning_per_mtok=60.0,
    price_id=PriceId(3),
)


def test_an_empty_price_book_has_no_price() -> None:
    book = PriceBook()
    assert book.latest() is None
    assert book.at(0.0) is None


@pytest.mark.parametrize("order", [(P1, P2, P3), (P3, P1, P2), (P2, P3, P1), (P3, P2, P1)])
def test_price_book_latest_is_the_latest_start_whatever_the_order_added(
    order: tuple[Price, ...],
) -> None:
    book = PriceBook(order)
    assert book.latest() is P3
    assert [book.at(t) for t in (0.0, 1000.0, 1999.0, 2000.0)] == [P1, P2, P2, P3]


def test_price_book_on_a_tie_of_starts_takes_the_version_added_last() -> None:
    # P2 and its correction both start at t=1000; the correction was added later.
    fix = Price(CostMode.TOKENS, effective_from=1000.0, fresh_per_mtok=3.0, price_id=PriceId(9))
    book = PriceBook([P2, P1])
    book.add(fix)
    assert book.at(1000.0) is fix
    assert book.latest() is fix
    assert book.at(999.0) is P1


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


@pytest.mark.parametrize("window_s", [0.0, -20.0])
def test_a_window_length_that_is_not_positive_is_refused(window_s: float) -> None:
    with pytest.raises(ValueError, match=r"^window_s must be positive$"):
        cost_per_success(TASKS, ATTEMPTS, window_s=window_s)


def test_a_window_shorter_than_one_second_is_allowed() -> None:
    # created at 0.2 and 0.7: windows of 0.5 s from 0 -> [0, 0.5) and [0.5, 1.0)
    tasks = [TaskRow("A", "t", 0.2), TaskRow("B", "t", 0.7)]
    groups = cost_per_success(tasks, [], by=(), window_s=0.5)
    assert [(g.window_start, g.tasks) for g in groups] == [(0.0, 1), (0.5, 1)]


@pytest.mark.parametrize(
    ("since", "expected"),
    [
        # no `since`: windows of 10 from 0 -> 5 in [0, 10), 10 and 19 in [10, 20), 25 in [20, 30)
        (None, [(0.0, 1), (10.0, 2), (20.0, 1)]),
        # since 3: windows from 3 -> 5 and 10 in [3, 13), 19 in [13, 23), 25 in [23, 33)
        (3.0, [(3.0, 2), (13.0, 1), (23.0, 1)]),
    ],
)
def test_windows_start_at_since_or_at_zero_and_come_in_time_order(
    since: float | None, expected: list[tuple[float, int]]
) -> None:
    # the rows come latest first: the groups still come earliest window first
    tasks = [TaskRow(f"T{t}", "t", t) for t in (25.0, 19.0, 10.0, 5.0)]
    groups = cost_per_success(tasks, [], by=(), since=since, window_s=10.0)
    assert [(g.window_start, g.tasks) for g in groups] == expected


def test_since_is_inclusive_and_until_exclusive() -> None:
    # Costs 1, 2, 4, 8, 16 tell the roots apart; the rows outside the range come first.
    tasks = [
        TaskRow("before", "t", 9.0),
        TaskRow("at_until", "t", 20.0),
        TaskRow("at_since", "t", 10.0),
        TaskRow("inside", "t", 19.5),
        TaskRow("after", "t", 25.0),
    ]
    attempts = [
        AttemptRow(t.task_id, "t", t.created_at, cost)
        for t, cost in zip(tasks, (1.0, 2.0, 4.0, 8.0, 16.0), strict=True)
    ]
    (g,) = cost_per_success(tasks, attempts, by=(), since=10.0, until=20.0)
    # at_since and inside: 2 roots, 4 + 8 = 12
    assert (g.tasks, g.cost) == (2, 12.0)


def test_attempts_of_one_unknown_task_are_one_root_created_at_the_earliest() -> None:
    # "ghost" has no task row; its attempts come out of time order: 15, 5, 25.
    attempts = [
        AttemptRow("ghost", "acme", 15.0, 1.0),
        AttemptRow("ghost", "acme", 5.0, 2.0),
        AttemptRow("ghost", "acme", 25.0, 4.0),
    ]
    # one root, created at 5 -> window [0, 10); 3 attempts, 1 + 2 + 4 = 7
    (g,) = cost_per_success([], attempts, window_s=10.0)
    assert (g.task_class, g.tenant, g.window_start) == (None, "acme", 0.0)
    assert (g.tasks, g.attempts, g.cost) == (1, 3, 7.0)
    # created at 5, so a range from 10 on holds none of it, though two attempts are later
    assert cost_per_success([], attempts, since=10.0) == []


def test_attempts_without_a_task_are_each_a_root_of_their_own() -> None:
    attempts = [AttemptRow(None, "acme", 1.0, 0.5), AttemptRow(None, "acme", 2.0, 0.25)]
    (g,) = cost_per_success([], attempts)
    # two roots, two attempts, 0.5 + 0.25 = 0.75, no success
    assert (g.tasks, g.attempts, g.cost, g.cost_per_success) == (2, 2, 0.75, None)


def test_unpriced_attempts_add_up_over_rows() -> None:
    tasks = [
        TaskRow("A", "t", 1.0, task_class="c", status=S, verified=True),
        TaskRow("B", "t", 2.0, task_class="c", status=F),
    ]
    attempts = [
        AttemptRow("A", "t", 1.5, None, attempts=2),
        AttemptRow("A", "t", 1.6, 1.0),
        AttemptRow("B", "t", 2.5, None, attempts=3),
    ]
    (g,) = cost_per_success(tasks, attempts)
    # attempts 2 + 1 + 3 = 6, of which 2 + 3 = 5 unpriced; cost 1.0 for the one success
    assert (g.attempts, g.unpriced_attempts, g.cost, g.cost_per_success) == (6, 5, 1.0, 1.0)


def test_groups_come_in_string_order_of_class_then_tenant_with_no_class_first() -> None:
    tasks = [
        TaskRow("1", "Beta", 1.0, task_class="Code"),
        TaskRow("2", "Alpha", 1.0, task_class="Code"),
        TaskRow("3", "Beta", 1.0, task_class="Build"),
        TaskRow("4", "", 1.0, task_class="Build"),  # an empty tenant name sorts first
    ]
    attempts = [AttemptRow(None, "Zed", 1.0, 0.5)]  # no task: no class
    groups = cost_per_success(tasks, attempts)
    assert [(g.task_class, g.tenant) for g in groups] == [
        (None, "Zed"),
        ("Build", ""),
        ("Build", "Beta"),
        ("Code", "Alpha"),
        ("Code", "Beta"),
    ]


# A group as policy/overhead.py leaves it: code/acme, the window from t=100, 6.5 direct and
# 0.5 + 0.25 + 1.25 = 2.0 overhead, so 8.5 in all over 2 successes: 4.25 (3.25 direct).
GROUP = CostGroup("code", "acme", 100.0, 5, 2, 9, 1, 6.5, 4.25, 40.0, 0.5, 0.25, 1.25)
FIGURES = [
    ("tasks", 5),
    ("succeeded", 2),
    ("attempts", 9),
    ("unpriced_attempts", 1),
    ("gpu_s", 40.0),
    ("cost", 6.5),
    ("overhead", 2.0),
    ("overhead_idle", 0.5),
    ("overhead_energy", 0.25),
    ("overhead_box", 1.25),
    ("total_cost", 8.5),
    ("cost_per_success", 4.25),
    ("direct_cost_per_success", 3.25),
]


@pytest.mark.parametrize(
    ("by", "windowed", "currency", "expected"),
    [
        (
            ("task_class", "tenant"),
            False,
            "USD",
            [("task_class", "code"), ("tenant", "acme"), *FIGURES, ("currency", "USD")],
        ),
        (("tenant",), False, None, [("tenant", "acme"), *FIGURES, ("currency", None)]),
        (
            ("task_class",),
            True,
            "EUR",
            [("task_class", "code"), ("window_start", 100.0), *FIGURES, ("currency", "EUR")],
        ),
        ((), True, "USD", [("window_start", 100.0), *FIGURES, ("currency", "USD")]),
    ],
)
def test_group_row_columns_are_the_by_keys_then_the_window_then_the_figures(
    by: tuple[str, ...], windowed: bool, currency: str | None, expected: list[tuple[str, object]]
) -> None:
    row = group_row(GROUP, by=by, currency=currency, windowed=windowed)
    assert list(row.items()) == expected


def test_group_row_has_no_window_column_unless_asked() -> None:
    row = group_row(GROUP, by=("tenant",), currency="USD")
    assert list(row) == ["tenant", *(name for name, _ in FIGURES), "currency"]


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


def test_a_task_less_attempt_never_merges_with_an_unknown_task_named_like_its_position() -> None:
    """Attempt 0 has no task; the unknown task "0" is another one: two roots, two tenants."""
    rows = cost_per_success(
        [], [AttemptRow(None, "beta", 2.0, 5.0), AttemptRow("0", "acme", 1.0, 1.0)], by=("tenant",)
    )
    assert {(r.tenant, r.tasks, r.attempts, r.cost) for r in rows} == {
        ("acme", 1, 1, 1.0),
        ("beta", 1, 1, 5.0),
    }
