"""A worker's prefill slowdown against the cost model: measured from the increments of its
request-level prefill histograms between two readings in which it did the router's requests
one at a time, smoothed, 1 until measured."""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest

from appliance.domain.records import WorkerId
from appliance.domain.worker import LoadSnapshot
from appliance.services.workers.worker_speed import (
    MIN_PREFILLS,
    SMOOTHING,
    WorkerSpeeds,
    measured_slowdown,
)
from tests.fakes import LinearCost

COST = LinearCost()  # 1 ms per fresh token, 0.1 ms per reused one


def reading(
    at: float,
    count: int,
    prefill_s: float,
    fresh: int,
    prompt: int,
    running: int = 1,
    waiting: int = 0,
) -> LoadSnapshot:
    """Counters since the engine started: `count` finished requests, their prefill seconds,
    computed (fresh) and prompt tokens."""
    return LoadSnapshot(
        time=at,
        running=running,
        waiting=waiting,
        kv_cache_usage_perc=0.0,
        prefix_cache_queries_tokens=prompt,
        prompt_tokens=prompt,
        prefill_sum_s=prefill_s,
        prefill_count=count,
        prefill_fresh_tokens=fresh,
        prefill_prompt_tokens=prompt,
    )


def test_the_slowdown_is_the_mean_measured_prefill_over_the_models_for_the_mean_request() -> None:
    before = reading(10.0, 5, 1.0, 1_000, 5_000)
    # 4 more requests: 500 fresh of 2,500 tokens each; the model says 0.5 + 0.2 = 0.7 s.
    after = reading(10.5, 9, 1.0 + 4 * 2.1, 3_000, 15_000)
    assert measured_slowdown(after.since(before), COST) == pytest.approx(3.0)


def test_too_few_prefills_say_nothing() -> None:
    before = reading(10.0, 5, 1.0, 1_000, 5_000)
    after = reading(10.5, 5 + MIN_PREFILLS - 1, 9.0, 2_000, 9_000)
    assert measured_slowdown(after.since(before), COST) is None


class FreeCost:
    """A profile that models no prefill time at all."""

    def prefill_s(self, fresh: int, reused: int = 0) -> float:
        return 0.0


@pytest.mark.parametrize(
    ("count", "prefill_s", "fresh", "prompt", "slowdown"),
    [
        # exactly MIN_PREFILLS prefills of 100 fresh tokens (0.1 s modelled), 0.2 s each
        (MIN_PREFILLS, MIN_PREFILLS * 0.2, MIN_PREFILLS * 100, MIN_PREFILLS * 100, 2.0),
        # well under a second of prefill in all is still a measurement
        (3, 0.3, 300, 300, 1.0),
        # no prefill time at all is a broken reading, not infinite speed
        (3, 0.0, 300, 300, None),
        # fully cached prompts still compute one token each: 1 fresh + 999 reused = 0.1009 s
        (3, 3 * 0.1009, 0, 3_000, 1.0),
        # the mean request is in whole tokens: 1,000 // 3 = 333 fresh of 3,001 // 3 = 1,000,
        # 0.333 + 0.0667 = 0.3997 s modelled
        (3, 3 * 2 * 0.3997, 1_000, 3_001, 2.0),
        # clamped to the plausible range
        (3, 3 * 1e4, 300, 300, 1e5),
        (3, 3 * 1e-6, 300, 300, 1e-3),
    ],
    ids=[
        "exactly MIN_PREFILLS prefills",
        "under a second of prefill",
        "no prefill seconds",
        "fully cached prompts",
        "whole-token mean request",
        "clamped above",
        "clamped below",
    ],
)
def test_measured_slowdown(
    count: int, prefill_s: float, fresh: int, prompt: int, slowdown: float | None
) -> None:
    delta = reading(1.0, count, prefill_s, fresh, prompt)
    sample = measured_slowdown(delta, COST)
    if slowdown is None:
        assert sample is None
    else:
        assert sample == pytest.approx(slowdown, rel=1e-9)


def test_a_profile_that_models_no_prefill_time_says_nothing() -> None:
    assert measured_slowdown(reading(1.0, 4, 4.0, 4_000, 4_000), FreeCost()) is None


@dataclass
class Worker:
    id: WorkerId
    load: LoadSnapshot | None = None


@dataclass
class OwnTraffic:
    """The router's attempts as the tests set them: `running` in flight at any time, and in
    any interval `sequential` of them one at a time (None: two overlapped)."""

    running: int = 1
    sequential: int | None = 1000

    def in_flight_at(self, worker: WorkerId, t: float) -> int:
        return self.running

    def one_at_a_time(self, worker: WorkerId, since: float, until: float) -> int | None:
        return self.sequential


def speeds_of(own: OwnTraffic | None = None) -> WorkerSpeeds:
    return WorkerSpeeds(COST, own or OwnTraffic())


def test_speeds_start_at_the_profile_then_follow_readings_smoothly() -> None:
    speeds, w = speeds_of(), Worker(WorkerId("w0"))
    speeds.observe([w])  # no reading yet
    w.load = reading(1.0, 0, 0.0, 0, 0)
    speeds.observe([w])  # the first reading is only what the next one compares with
    assert speeds.slowdown(w.id) == 1.0
    w.load = reading(1.5, 4, 4 * 1.0, 4 * 1_000, 4 * 1_000)  # 1 s where the model says 1 s
    speeds.observe([w])
    assert speeds.slowdown(w.id) == pytest.approx(1.0)
    w.load = reading(2.0, 8, 4.0 + 4 * 5.0, 8 * 1_000, 8 * 1_000)  # now 5 s each
    speeds.observe([w])
    assert speeds.slowdown(w.id) == pytest.approx(1.0 + SMOOTHING * 4.0)
    speeds.observe([w])  # the same reading again changes nothing
    assert speeds.slowdown(w.id) == pytest.approx(1.0 + SMOOTHING * 4.0)


def test_a_worker_never_measured_counts_as_the_median_of_those_measured() -> None:
    speeds = speeds_of()
    assert speeds.slowdown(WorkerId("never-read")) == 1.0  # none measured: the profile
    for i, each_s in enumerate((2.0, 100.0, 300.0)):
        w = Worker(WorkerId(f"w{i}"), reading(1.0, 0, 0.0, 0, 0))
        speeds.observe([w])
        w.load = reading(1.5, 4, 4 * each_s, 4 * 1_000, 4 * 1_000)
        speeds.observe([w])
        assert speeds.slowdown(w.id) == pytest.approx(each_s)
    assert speeds.slowdown(WorkerId("never-read")) == pytest.approx(100.0)


def test_a_reading_with_too_few_prefills_is_pooled_with_the_next() -> None:
    speeds, w = speeds_of(), Worker(WorkerId("w0"), reading(1.0, 0, 0.0, 0, 0))
    speeds.observe([w])
    w.load = reading(1.5, 2, 2 * 2.0, 2_000, 2_000)  # 2 requests at 2x: too few alone
    speeds.observe([w])
    assert speeds.slowdown(w.id) == 1.0
    w.load = reading(2.0, 4, 4 * 2.0, 4_000, 4_000)  # 2 more: 4 since the first reading
    speeds.observe([w])
    assert speeds.slowdown(w.id) == pytest.approx(2.0)


def test_an_engine_restart_measures_from_its_new_counters() -> None:
    speeds, w = speeds_of(), Worker(WorkerId("w0"), reading(1.0, 100, 100.0, 10**6, 10**6))
    speeds.observe([w])
    w.load = reading(2.0, 4, 4 * 0.5, 4_000, 4_000)  # counters went back: a new engine
    speeds.observe([w])
    assert speeds.slowdown(w.id) == pytest.approx(0.5)


def test_a_busy_interval_is_queueing_not_speed() -> None:
    speeds, w = speeds_of(), Worker(WorkerId("w0"), reading(1.0, 0, 0.0, 0, 0))
    speeds.observe([w])
    w.load = reading(1.5, 4, 4 * 1.0, 4_000, 4_000)  # 1 s each, as the model says
    speeds.observe([w])
    w.load = reading(2.0, 8, 4.0 + 4 * 6.0, 8_000, 8_000, running=5)  # batched: 6 s each
    speeds.observe([w])
    w.load = reading(2.5, 12, 28.0 + 4 * 6.0, 12_000, 12_000, running=0)  # still from busy
    speeds.observe([w])
    assert speeds.slowdown(w.id) == pytest.approx(1.0)
    w.load = reading(3.0, 16, 52.0 + 4 * 2.0, 16_000, 16_000)  # calm again: 2 s each
    speeds.observe([w])
    assert speeds.slowdown(w.id) == pytest.approx(1.0 + SMOOTHING * 1.0)


CALM = reading(1.0, 0, 0.0, 0, 0)


@pytest.mark.parametrize(
    ("first_then", "first_now"),
    [
        (None, None),
        (CALM, None),
        (CALM, CALM),
        (None, CALM),
        (CALM, reading(1.0, 4, 4 * 5.0, 4_000, 4_000)),
        (CALM, reading(1.5, 4, 4 * 5.0, 4_000, 4_000, running=2)),
        (CALM, reading(1.5, 4, 4 * 5.0, 4_000, 4_000, waiting=1)),
        (CALM, reading(1.5, MIN_PREFILLS - 1, 5.0, 1_000, 1_000)),
    ],
    ids=[
        "never read",
        "its reading lost",
        "the reading already seen",
        "its first reading",
        "a reading no newer than the last",
        "two requests running: busy",
        "a request waiting: busy",
        "too few prefills",
    ],
)
def test_a_worker_without_a_sample_leaves_the_next_one_measured(
    first_then: LoadSnapshot | None, first_now: LoadSnapshot | None
) -> None:
    """Each worker of a poll is read on its own: one that gives no sample (it counts as
    the one measured, not at its own 5x) does not keep the worker after it from being
    measured."""
    speeds = speeds_of()
    first, second = Worker(WorkerId("w0"), first_then), Worker(WorkerId("w1"), CALM)
    speeds.observe([first, second])
    first.load, second.load = first_now, reading(1.5, 4, 4 * 2.0, 4_000, 4_000)
    speeds.observe([first, second])
    assert speeds.slowdown(second.id) == pytest.approx(2.0)
    assert speeds.slowdown(first.id) == pytest.approx(2.0)


def test_a_lost_reading_keeps_the_slowdown_and_the_last_reading() -> None:
    speeds, w = speeds_of(), Worker(WorkerId("w0"), CALM)
    speeds.observe([w])
    w.load = reading(1.5, 4, 4 * 2.0, 4_000, 4_000)
    speeds.observe([w])
    w.load = None  # the poll failed
    speeds.observe([w])
    assert speeds.slowdown(w.id) == pytest.approx(2.0)
    w.load = reading(2.0, 8, 8.0 + 4 * 3.0, 8_000, 8_000)  # measured from the 1.5 s reading
    speeds.observe([w])
    assert speeds.slowdown(w.id) == pytest.approx(2.0 + SMOOTHING * 1.0)


@pytest.mark.parametrize(
    ("own", "done", "then", "now"),
    [
        (OwnTraffic(sequential=None), 4, CALM, reading(1.5, 4, 4 * 5.0, 4_000, 4_000)),
        (OwnTraffic(sequential=3), 4, CALM, reading(1.5, 4, 4 * 5.0, 4_000, 4_000)),
        (OwnTraffic(running=0), 4, CALM, reading(1.5, 4, 4 * 5.0, 4_000, 4_000, running=0)),
        (
            OwnTraffic(running=0),
            4,
            reading(1.0, 0, 0.0, 0, 0, running=0),
            reading(1.5, 4, 4 * 5.0, 4_000, 4_000, running=1),
        ),
    ],
    ids=[
        "the router's requests overlapped",
        "a request finished that was not the router's",
        "a request running at the first reading was not the router's",
        "a request running at the second reading was not the router's",
    ],
)
def test_prefills_the_worker_did_beside_other_requests_are_no_sample(
    own: OwnTraffic, done: int, then: LoadSnapshot, now: LoadSnapshot
) -> None:
    """Calm readings at both ends are not enough: the worker must have done one request at a
    time in between, and only the router's (the others' prefills shared its steps)."""
    own = replace(own)  # the parameter is shared between runs; this test changes it below
    speeds, w = speeds_of(own), Worker(WorkerId("w0"), then)
    speeds.observe([w])
    w.load = now
    speeds.observe([w])
    assert now.prefill_count - then.prefill_count == done
    assert speeds.slowdown(w.id) == 1.0
    own.running, own.sequential = 1, 1000  # from the spoiled reading on, alone again
    w.load = reading(2.0, 8, 20.0 + 4 * 2.0, 8_000, 8_000)
    speeds.observe([w])
    assert speeds.slowdown(w.id) == pytest.approx(2.0)


def test_as_many_finished_as_the_router_had_there_one_at_a_time_is_a_sample() -> None:
    own = OwnTraffic(running=1, sequential=4)
    speeds, w = speeds_of(own), Worker(WorkerId("w0"), CALM)
    speeds.observe([w])
    w.load = reading(1.5, 4, 4 * 2.0, 4_000, 4_000)
    speeds.observe([w])
    assert speeds.slowdown(w.id) == pytest.approx(2.0)
