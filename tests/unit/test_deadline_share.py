"""A turn's share of its task's deadline (appliance/policy/deadline_share.py): the reserve a
task class's history asks for after a task's k-th turn, the share that leaves the turn
(never below its own need, never past the deadline), and the worker a deadline is judged on
(placement's choice, else the fastest)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from appliance.policy.admission import AdmissionLimits, AdmitRequest, BoxLoad, Work, admit
from appliance.policy.deadline_share import (
    MIN_RUNS,
    Reserve,
    TaskRun,
    WorkerEstimate,
    judged_worker,
    reserve_after,
    turn_share,
)

NOW = 100.0
LIMITS = AdmissionLimits()
# Twelve turns of 2 s each, nine gaps of 2 s each, a 2 s tail on average.
HISTORY = (
    TaskRun(turns=3, turn_s=6.0, between_s=4.0, tail_s=1.0),
    TaskRun(turns=5, turn_s=10.0, between_s=8.0, tail_s=2.0),
    TaskRun(turns=4, turn_s=8.0, between_s=6.0, tail_s=3.0),
)


@pytest.mark.parametrize(
    ("turns_done", "more", "seconds"),
    [
        (1, 3.0, 14.0),  # (2 + 4 + 3) / 3 more turns of 2 s + 2 s, then the 2 s tail
        (3, 1.0, 6.0),  # (0 + 2 + 1) / 3
        (4, 0.5, 4.0),  # only the tasks of 4 turns or more: (1 + 0) / 2
        (5, 0.0, 2.0),  # the longest ran 5: none more, the tail alone
        (6, 0.0, 2.0),  # longer than any: near its end, the tail alone
    ],
)
def test_the_reserve_is_the_expected_work_after_this_turn(
    turns_done: int, more: float, seconds: float
) -> None:
    reserve = reserve_after(HISTORY, turns_done)
    assert reserve == Reserve(seconds, more, 2.0, 2.0, 2.0, 3)


def test_a_class_with_too_little_history_keeps_nothing() -> None:
    assert MIN_RUNS == 3
    assert reserve_after(HISTORY[:2], 1) is None
    assert reserve_after((), 1) is None
    assert reserve_after(HISTORY[:2], 1, min_runs=2) == Reserve(13.5, 3.0, 2.0, 2.0, 1.5, 2)
    assert reserve_after(HISTORY[:1], 1, min_runs=1) == Reserve(9.0, 2.0, 2.0, 2.0, 1.0, 1)


def test_tasks_of_one_turn_have_no_gaps_and_tasks_of_none_no_turn_time() -> None:
    one = TaskRun(turns=1, turn_s=3.0, between_s=0.0, tail_s=0.5)
    assert reserve_after((one, one, one), 1) == Reserve(0.5, 0.0, 3.0, 0.0, 0.5, 3)
    none = TaskRun(turns=0, turn_s=0.0, between_s=0.0, tail_s=4.0)
    assert reserve_after((none, none, none), 0) == Reserve(4.0, 0.0, 0.0, 0.0, 4.0, 3)
    # A task of no turns adds no gap: one task of 3 turns has 2 gaps of 3 s each, and it
    # alone ran a first turn.
    three = TaskRun(turns=3, turn_s=3.0, between_s=6.0, tail_s=0.0)
    tail = 8 / 3
    assert reserve_after((three, none, none), 1) == Reserve(2 * 4.0 + tail, 2.0, 1.0, 3.0, tail, 3)


def test_the_reserve_says_what_it_expects() -> None:
    reserve = reserve_after(HISTORY, 1)
    assert reserve is not None
    assert reserve.describe() == (
        "about 3.0 more turns of 2.000 s with 2.000 s between, then 2.000 s to close, "
        "learned from 3 tasks of its class"
    )


@pytest.mark.parametrize(
    ("reserve_s", "need_s", "given", "kept", "cut"),
    [
        (14.0, 0.5, 16.0, 14.0, False),  # the deadline less the reserve
        (14.0, 16.0, 16.0, 14.0, False),  # a need that just fits its share
        (14.0, 20.0, 20.0, 10.0, True),  # never below the turn's own need: into the reserve
        (14.0, 40.0, 30.0, 0.0, True),  # ... nor past the deadline
        (29.8, 0.5, 0.5, 29.5, True),  # a share shorter than the need
        (29.8, -1.0, 0.2, 29.8, False),  # a need below zero counts as none
        (40.0, -1.0, 0.0, 30.0, True),  # a reserve beyond the deadline: nothing but the need
        (0.0, 0.5, 30.0, 0.0, False),  # a class expecting nothing more
    ],
)
def test_a_turns_share_is_the_deadline_less_the_reserve_never_below_its_need(
    reserve_s: float, need_s: float, given: float, kept: float, cut: bool
) -> None:
    reserve = Reserve(reserve_s, 1.0, 1.0, 1.0, 1.0, 3)
    share = turn_share(NOW, NOW + 30.0, reserve, need_s)
    assert share.given_s == pytest.approx(given)
    assert share.deadline_at == pytest.approx(NOW + given)
    assert share.kept_s == pytest.approx(kept)
    assert (share.reserve, share.cut) == (reserve, cut)


def test_without_a_reserve_the_turn_has_the_whole_deadline() -> None:
    share = turn_share(NOW, NOW + 30.0, None, 0.5)
    assert (share.deadline_at, share.given_s, share.kept_s, share.cut) == (NOW + 30.0, 30, 0, False)
    late = turn_share(NOW, NOW - 1.0, None, 0.5)  # passed already: due now, nothing kept
    assert (late.deadline_at, late.given_s, late.kept_s, late.cut) == (NOW - 1.0, -1, 0, False)


@given(
    left=st.floats(0.0, 1e4),
    reserve_s=st.floats(0.0, 1e4),
    need_s=st.floats(-10.0, 1e4),
)
def test_a_share_lies_between_the_need_and_the_deadline(
    left: float, reserve_s: float, need_s: float
) -> None:
    share = turn_share(NOW, NOW + left, Reserve(reserve_s, 0.0, 0.0, 0.0, reserve_s, 3), need_s)
    assert NOW - 1e-9 <= share.deadline_at <= NOW + left + 1e-9
    assert share.deadline_at >= NOW + min(max(need_s, 0.0), left) - 1e-9
    assert share.kept_s == pytest.approx(left - share.given_s)
    assert share.kept_s <= max(reserve_s, 0.0) + 1e-9


FAST = WorkerEstimate(0.0, 1.6, worker="w1")
SLOW = WorkerEstimate(1.5, 0.2, worker="w0")  # holds the prefix, behind a queue
WAKING = WorkerEstimate(0.0, 0.3, wake_s=2.0, worker="w2")


def test_a_deadline_is_judged_on_placements_choice_else_on_the_fastest() -> None:
    assert SLOW.first_token_s == pytest.approx(1.7)
    assert WAKING.first_token_s == pytest.approx(2.3)
    assert judged_worker([FAST, SLOW], "w0") is SLOW
    assert judged_worker([SLOW, FAST], "w1") is FAST
    assert judged_worker([SLOW, FAST, WAKING], None) is FAST  # none chosen: the fastest
    assert judged_worker([SLOW, WAKING], "w9") is SLOW  # chosen, but not among them
    assert judged_worker([], "w0") is None


def test_admission_judges_a_deadline_on_placements_choice_not_on_the_fastest() -> None:
    """Placement passed the fastest worker over (cold for the prefix) for one that holds it
    behind a queue: the turn's first token is 1.7 s away there, not 1.6 s."""
    placed = BoxLoad({}, [FAST, SLOW], placed="w0")
    assert placed.judged is SLOW
    late = admit(AdmitRequest("a", Work.TURN, deadline_at=NOW + 1.65), placed, LIMITS, NOW)
    assert (late.code, late.first_token_s) == ("deadline_infeasible", None)
    assert late.reason == (
        "the deadline is 1.650 s away, but the first token at w0, placement's choice, is "
        "1.700 s away (queue 1.500 s + prefill 0.200 s)"
    )
    fits = admit(AdmitRequest("a", Work.TURN, deadline_at=NOW + 1.75), placed, LIMITS, NOW)
    assert (
        fits.reason == "admitted at priority 0; first token at w0, placement's choice, in 1.700 s"
    )
    assert fits.first_token_s == pytest.approx(1.7)
    # With none chosen the fastest is judged, as before.
    unplaced = BoxLoad({}, [SLOW, FAST])
    fastest = admit(AdmitRequest("a", Work.TURN, deadline_at=NOW + 1.65), unplaced, LIMITS, NOW)
    assert fastest.reason == "admitted at priority 0; fastest first token in 1.600 s"
    assert fastest.first_token_s == pytest.approx(1.6)
    lost = admit(AdmitRequest("a", Work.TURN, deadline_at=NOW + 1.0), unplaced, LIMITS, NOW)
    assert "but the fastest worker's first token is 1.600 s away" in lost.reason
    alone = admit(AdmitRequest("a", Work.TURN, deadline_at=NOW + 1.0), BoxLoad({}, []), LIMITS, NOW)
    assert (alone.reason, alone.first_token_s) == ("admitted at priority 0", None)


def test_a_short_wake_is_named_in_the_refusal_too() -> None:
    dozing = BoxLoad({}, [WorkerEstimate(0.0, 0.3, wake_s=0.5, worker="w2")])
    late = admit(AdmitRequest("a", Work.TURN, deadline_at=NOW + 0.7), dozing, LIMITS, NOW)
    assert late.reason.endswith("0.800 s away (wake 0.500 s + queue 0.000 s + prefill 0.300 s)")
