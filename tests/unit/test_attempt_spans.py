"""The router's own attempts at a worker in time: how many were in flight at a reading's
time, and whether they ran one at a time over an interval."""

from __future__ import annotations

from appliance.domain.records import TurnId, WorkerId
from appliance.services.turns.attempt_spans import SPAN_MEMORY_S, AttemptSpans
from tests.fakes import ManualClock

W = WorkerId("w0")


def spans_of(*spans: tuple[float, float | None]) -> tuple[AttemptSpans, ManualClock]:
    """Attempts (start, end) at W, ended in order of their ends; None: still in flight."""
    clock = ManualClock(0.0)
    book = AttemptSpans(clock)
    for i, (start, _) in enumerate(spans):
        book.began(W, TurnId(f"t{i}"), start)
    for end, i in sorted((end, i) for i, (_, end) in enumerate(spans) if end is not None):
        clock.t = end
        assert book.ended(W, TurnId(f"t{i}")) == end
    clock.t = 10.0
    return book, clock


def test_in_flight_at_a_time_counts_the_ones_that_had_started_and_not_ended() -> None:
    book, _ = spans_of((1.0, 2.0), (1.5, 3.0), (2.5, None))
    assert [book.in_flight_at(W, t) for t in (0.5, 1.0, 1.7, 2.0, 2.7, 3.5)] == [0, 1, 2, 1, 2, 1]
    assert book.in_flight_at(WorkerId("other"), 2.0) == 0


def test_attempts_one_after_the_other_are_counted() -> None:
    book, _ = spans_of((1.0, 2.0), (2.0, 3.0), (3.5, None))
    assert book.one_at_a_time(W, 0.0, 4.0) == 3
    assert book.one_at_a_time(W, 2.5, 3.2) == 1  # only the one that ended in it
    assert book.one_at_a_time(W, 3.0, 3.2) == 0  # none touched it
    assert book.one_at_a_time(W, 1.5, 1.9) == 1  # in flight throughout


def test_attempts_in_flight_together_are_none() -> None:
    book, _ = spans_of((1.0, 2.0), (1.9, 3.0))
    assert book.one_at_a_time(W, 0.0, 4.0) is None
    assert book.one_at_a_time(W, 2.0, 4.0) == 1  # the first had ended by then
    running, _ = spans_of((1.0, None), (5.0, 6.0))  # the first never ended
    assert running.one_at_a_time(W, 4.0, 7.0) is None


def test_an_interval_older_than_the_spans_kept_is_none() -> None:
    book, clock = spans_of((1.0, 2.0))
    clock.t = 2.0 + SPAN_MEMORY_S + 1.0
    assert book.one_at_a_time(W, 1.5, clock.t) is None
    assert book.one_at_a_time(W, clock.t - 1.0, clock.t) == 0
    assert book.in_flight_at(W, 1.5) == 0  # forgotten: past any reading's age
