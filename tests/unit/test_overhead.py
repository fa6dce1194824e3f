"""The box's overhead (policy/overhead.py) against numbers worked out by hand in the
comments, never by calling the code under test."""

from __future__ import annotations

import pytest

from appliance.domain.records import CostMode, Price, PriceId, TaskStatus, WorkerId
from appliance.domain.usage import PeriodCost, UsagePeriod, WorkerUsage
from appliance.policy.costs import AttemptRow, CostGroup, TaskRow, cost_per_success
from appliance.policy.overhead import (
    Overhead,
    UsageRow,
    overhead_in,
    price_period,
    spread_overhead,
    with_overhead,
)

# 0.001 per GPU-second, 0.30 per kWh, 3.60 per box-hour (0.001 per box-second).
GPU = Price(
    CostMode.GPU_SECONDS,
    effective_from=0.0,
    gpu_second=0.001,
    energy_per_kwh=0.3,
    box_per_hour=3.6,
    price_id=PriceId(7),
)
TOKENS = Price(CostMode.TOKENS, 0.0, gpu_second=0.001, energy_per_kwh=0.3, price_id=PriceId(8))
# 100 s; w0 awake 100 GPU-s, busy 40, 36,000 J (0.01 kWh); w1 (2 GPUs) awake 200, busy 0,
# no power reading.
PERIOD = UsagePeriod(
    1000.0,
    1100.0,
    (
        WorkerUsage(WorkerId("w0"), 1, awake_s=100.0, busy_s=40.0, energy_j=36_000.0),
        WorkerUsage(WorkerId("w1"), 2, awake_s=200.0, busy_s=0.0),
    ),
)


def test_a_period_in_gpu_seconds_mode_costs_its_idle_time_energy_and_box_hours() -> None:
    cost = price_period(GPU, PERIOD)
    # idle: (100 - 40) + 200 = 260 GPU-s * 0.001 = 0.26; energy 0.01 kWh * 0.3 = 0.003;
    # box: 100 s / 3600 * 3.6 = 0.1
    assert cost.idle == pytest.approx(0.26)
    assert cost.energy == pytest.approx(0.003)
    assert cost.box == pytest.approx(0.1)
    assert cost.total == pytest.approx(0.363)
    assert cost.price_id == 7
    assert cost.by_worker == (pytest.approx((0.06, 0.003)), pytest.approx((0.2, 0.0)))


def test_busy_time_is_the_turns_and_never_overhead() -> None:
    # Busy more than awake (a wake counted apart): no idle time, not a negative one.
    period = UsagePeriod(0.0, 10.0, (WorkerUsage(WorkerId("w0"), 1, 5.0, 8.0),))
    cost = price_period(GPU, period)
    assert cost.idle == 0.0
    assert cost.box == pytest.approx(0.01)  # 10 s at 0.001


@pytest.mark.parametrize("price", [TOKENS, None])
def test_tokens_mode_or_no_price_charges_no_overhead(price: Price | None) -> None:
    cost = price_period(price, PERIOD)
    assert (cost.idle, cost.energy, cost.box) == (0.0, 0.0, 0.0)
    assert cost.by_worker == ((0.0, 0.0), (0.0, 0.0))
    assert cost.price_id == (8 if price else None)


def test_a_period_that_ends_before_it_starts_is_refused() -> None:
    with pytest.raises(ValueError, match="end before it starts"):
        UsagePeriod(10.0, 9.0)
    with pytest.raises(ValueError, match="cannot be negative"):
        WorkerUsage(WorkerId("w0"), 1, awake_s=-1.0, busy_s=0.0)


# [0, 100): idle 1, energy 2, box 3; [100, 200): 10, 20, 30.
ROWS = [
    UsageRow(0.0, 100.0, Overhead(1.0, 2.0, 3.0)),
    UsageRow(100.0, 200.0, Overhead(10.0, 20.0, 30.0)),
]


@pytest.mark.parametrize(
    ("since", "until", "expected"),
    [
        (None, None, (11.0, 22.0, 33.0)),
        # half of the first, all of the second: 0.5 + 10, 1 + 20, 1.5 + 30
        (50.0, None, (10.5, 21.0, 31.5)),
        # all of the first, half of the second: 1 + 5, 2 + 10, 3 + 15
        (None, 150.0, (6.0, 12.0, 18.0)),
        # half and half
        (50.0, 150.0, (5.5, 11.0, 16.5)),
        # inside the first only: a fifth of it
        (20.0, 40.0, (0.2, 0.4, 0.6)),
        # before and after every period
        (-50.0, 0.0, (0.0, 0.0, 0.0)),
        (200.0, 300.0, (0.0, 0.0, 0.0)),
    ],
)
def test_a_ranges_overhead_counts_a_period_by_its_part_inside(
    since: float | None, until: float | None, expected: tuple[float, float, float]
) -> None:
    o = overhead_in(ROWS, since, until)
    assert (o.idle, o.energy, o.box) == pytest.approx(expected)
    assert o.total == pytest.approx(sum(expected))


@pytest.mark.parametrize(
    ("since", "until", "inside"), [(100.0, 101.0, True), (99.0, 100.0, False), (None, None, True)]
)
def test_an_instant_period_counts_whole_where_it_lies(
    since: float | None, until: float | None, inside: bool
) -> None:
    row = UsageRow(100.0, 100.0, Overhead(box=4.0))
    assert overhead_in([row], since, until).box == (4.0 if inside else 0.0)


def _group(name: str, gpu_s: float, *, cost: float, succeeded: int, tasks: int = 1) -> CostGroup:
    per_success = cost / succeeded if succeeded else None
    return CostGroup(name, "t", None, tasks, succeeded, tasks, 0, cost, per_success, gpu_s)


def test_the_overhead_is_spread_by_gpu_seconds() -> None:
    a = _group("a", 30.0, cost=1.0, succeeded=2)
    b = _group("b", 10.0, cost=0.5, succeeded=0)
    ga, gb = spread_overhead([a, b], Overhead(idle=4.0, energy=0.4, box=8.0))
    # a used 30 of 40 GPU-s: 3/4 of each part; b 1/4.
    assert (ga.overhead_idle, ga.overhead_energy, ga.overhead_box) == pytest.approx((3, 0.3, 6))
    assert (gb.overhead_idle, gb.overhead_energy, gb.overhead_box) == pytest.approx((1, 0.1, 2))
    # a: 1.0 direct + 9.3 overhead = 10.3, over 2 successes 5.15 (0.5 direct)
    assert ga.overhead == pytest.approx(9.3)
    assert ga.total_cost == pytest.approx(10.3)
    assert ga.cost_per_success == pytest.approx(5.15)
    assert ga.direct_cost_per_success == pytest.approx(0.5)
    # b: no success, no figure, its cost still counted
    assert gb.total_cost == pytest.approx(0.5 + 3.1)
    assert gb.cost_per_success is None and gb.direct_cost_per_success is None
    assert (ga.cost, ga.gpu_s, ga.tasks) == (1.0, 30.0, 1)  # the rest as it was


def test_a_larger_basis_leaves_the_share_of_work_not_shown_out() -> None:
    # The work used 80 GPU-s, the groups shown 30 + 10: they bear 30/80 and 10/80 of 8.
    a = _group("a", 30.0, cost=0.0, succeeded=1)
    b = _group("b", 10.0, cost=0.0, succeeded=1)
    ga, gb = spread_overhead([a, b], Overhead(idle=8.0), basis_gpu_s=80.0)
    assert (ga.overhead, gb.overhead) == pytest.approx((3.0, 1.0))
    # A smaller basis than the groups' own does not inflate their shares.
    ga, gb = spread_overhead([a, b], Overhead(idle=8.0), basis_gpu_s=20.0)
    assert (ga.overhead, gb.overhead) == pytest.approx((6.0, 2.0))


def test_a_fraction_of_a_gpu_second_is_gpu_time_too() -> None:
    # 0.25 and 0.5 GPU-s: 1/3 and 2/3, not by their tasks (3 and 1).
    a = _group("a", 0.25, cost=0.0, succeeded=1, tasks=3)
    b = _group("b", 0.5, cost=0.0, succeeded=1, tasks=1)
    ga, gb = spread_overhead([a, b], Overhead(idle=3.0))
    assert (ga.overhead, gb.overhead) == pytest.approx((1.0, 2.0))


def test_without_gpu_time_each_root_task_bears_an_equal_share() -> None:
    a = _group("a", 0.0, cost=0.0, succeeded=1, tasks=3)
    b = _group("b", 0.0, cost=0.0, succeeded=1, tasks=1)
    ga, gb = spread_overhead([a, b], Overhead(box=8.0))
    assert (ga.overhead_box, gb.overhead_box) == (6.0, 2.0)
    # Other work used the GPUs: these groups, none of it, bear nothing.
    ga, gb = spread_overhead([a, b], Overhead(box=8.0), basis_gpu_s=5.0)
    assert (ga.overhead, gb.overhead) == (0.0, 0.0)
    # A group of no task (never made by cost_per_success) bears nothing, and no group at all
    # leaves the overhead in none.
    (g,) = spread_overhead([_group("c", 0.0, cost=0.0, succeeded=0, tasks=0)], Overhead(box=1))
    assert g.overhead == 0.0
    assert spread_overhead([], Overhead(box=1.0)) == []


def test_no_overhead_leaves_cost_per_success_the_direct_one() -> None:
    (g,) = spread_overhead([_group("a", 5.0, cost=3.0, succeeded=2)], Overhead())
    assert (g.overhead, g.total_cost, g.cost_per_success) == (0.0, 3.0, 1.5)


def test_each_window_shares_its_own_overhead() -> None:
    # Roots at t=1 (w0: 2 GPU-s, success) and t=2 (w0: 6 GPU-s), t=12 (w1: 4 GPU-s, success).
    tasks = [
        TaskRow("A", "t", 1.0, status=TaskStatus.SUCCEEDED, verified=True),
        TaskRow("B", "u", 2.0),
        TaskRow("C", "t", 12.0, status=TaskStatus.SUCCEEDED, verified=True),
    ]
    attempts = [
        AttemptRow("A", "t", 1.5, 0.2, gpu_s=2.0),
        AttemptRow("B", "u", 2.5, 0.6, gpu_s=6.0),
        AttemptRow("C", "t", 12.5, 0.4, gpu_s=4.0),
    ]
    # [0, 10): 8 of idle; [10, 20): 2 of box; [20, 30): 5 that no root of its window used.
    rows = [
        UsageRow(0.0, 10.0, Overhead(idle=8.0)),
        UsageRow(10.0, 20.0, Overhead(box=2.0)),
        UsageRow(20.0, 30.0, Overhead(idle=5.0)),
    ]
    groups = cost_per_success(tasks, attempts, by=("tenant",), window_s=10.0)
    charged = with_overhead(groups, rows, window_s=10.0)
    assert [(g.tenant, g.window_start) for g in charged] == [("t", 0.0), ("t", 10.0), ("u", 0.0)]
    # window 0: t used 2 of 8 GPU-s -> 2 of the 8; u 6 -> 6. Window 10: t all 2 of box.
    assert [g.overhead_idle for g in charged] == pytest.approx([2.0, 0.0, 6.0])
    assert [g.overhead_box for g in charged] == pytest.approx([0.0, 2.0, 0.0])
    # t in window 0: (0.2 + 2) / 1; in window 10: (0.4 + 2) / 1; u: no success
    assert [g.cost_per_success for g in charged] == [pytest.approx(2.2), pytest.approx(2.4), None]
    # since and until cut the windows: [5, 10) holds half of the first period's 8, and
    # [10, 15) half of the second's 2.
    groups = cost_per_success(tasks, attempts, by=(), since=5.0, until=15.0, window_s=5.0)
    assert [g.window_start for g in groups] == [10.0]  # only C's root is in the range
    (g,) = with_overhead(groups, rows, since=5.0, until=15.0, window_s=5.0)
    assert (g.overhead_idle, g.overhead_box) == pytest.approx((0.0, 1.0))
    groups = cost_per_success(tasks, attempts, by=(), since=0.0, until=15.0, window_s=10.0)
    g0, g10 = with_overhead(groups, rows, since=0.0, until=15.0, window_s=10.0)
    assert (g0.overhead_idle, g10.overhead_box) == pytest.approx((8.0, 1.0))


def test_without_windows_the_ranges_overhead_goes_to_all_its_groups() -> None:
    tasks = [TaskRow("A", "t", 1.0), TaskRow("B", "u", 12.0)]
    attempts = [
        AttemptRow("A", "t", 1.5, 0.1, gpu_s=1.0),
        AttemptRow("B", "u", 12.5, 0.1, gpu_s=3.0),
    ]
    rows = [UsageRow(0.0, 10.0, Overhead(idle=8.0)), UsageRow(10.0, 20.0, Overhead(idle=4.0))]
    groups = cost_per_success(tasks, attempts, by=("tenant",))
    # All 12 by 1 : 3
    assert [g.overhead for g in with_overhead(groups, rows)] == pytest.approx([3.0, 9.0])
    # From t=10: B alone, and the second period's 4 alone
    groups = cost_per_success(tasks, attempts, by=("tenant",), since=10.0)
    assert [g.overhead for g in with_overhead(groups, rows, since=10.0)] == [pytest.approx(4.0)]
    # Until t=5: A alone, and half the first period
    groups = cost_per_success(tasks, attempts, by=("tenant",), until=5.0)
    assert [g.overhead for g in with_overhead(groups, rows, until=5.0)] == [pytest.approx(4.0)]


def test_a_groups_gpu_seconds_are_its_trees_attempts() -> None:
    tasks = [TaskRow("R", "t", 1.0), TaskRow("K", "t", 2.0, parent_task_id="R")]
    attempts = [
        AttemptRow("R", "t", 1.5, 0.1, gpu_s=1.25),
        AttemptRow("K", "t", 2.5, None, gpu_s=0.5),  # unpriced: its GPU time still counts
        AttemptRow(None, "t", 3.0, 0.1, gpu_s=2.0),  # a root alone
    ]
    (g,) = cost_per_success(tasks, attempts, by=("tenant",))
    assert g.gpu_s == pytest.approx(3.75)
    (r, alone) = cost_per_success(tasks, attempts, by=("task_class", "tenant"), window_s=2.0)
    assert (r.gpu_s, alone.gpu_s) == (1.75, 2.0)


def test_period_costs_add_up_in_parts() -> None:
    cost = PeriodCost(idle=1.0, energy=2.0, box=4.0)
    assert cost.total == 7.0
    assert Overhead(1.0, 2.0, 4.0) + Overhead(0.5, 0.25, 0.125) == Overhead(1.5, 2.25, 4.125)
    assert Overhead(1.0, 2.0, 4.0).scaled(0.5) == Overhead(0.5, 1.0, 2.0)
