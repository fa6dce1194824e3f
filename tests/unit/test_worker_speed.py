"""A worker's prefill slowdown against the cost model: measured from the increments of its
request-level prefill histograms between two readings, smoothed, 1 until measured."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from appliance.domain.records import WorkerId
from appliance.domain.worker import LoadSnapshot
from appliance.services.worker_speed import (
    MIN_PREFILLS,
    SMOOTHING,
    WorkerSpeeds,
    measured_slowdown,
)
from tests.fakes import LinearCost

COST = LinearCost()  # 1 ms per fresh token, 0.1 ms per reused one


def reading(
    at: float, count: int, prefill_s: float, fresh: int, prompt: int, running: int = 1
) -> LoadSnapshot:
    """Counters since the engine started: `count` finished requests, their prefill seconds,
    computed (fresh) and prompt tokens."""
    return LoadSnapshot(time=at, running=running, waiting=0, kv_cache_usage_perc=0.0,
                        prefix_cache_queries_tokens=prompt, prompt_tokens=prompt,
                        prefill_sum_s=prefill_s, prefill_count=count,
                        prefill_fresh_tokens=fresh, prefill_prompt_tokens=prompt)  # fmt: skip


def test_the_slowdown_is_the_mean_measured_prefill_over_the_models_for_the_mean_request() -> None:
    before = reading(10.0, 5, 1.0, 1_000, 5_000)
    # 4 more requests: 500 fresh of 2,500 tokens each; the model says 0.5 + 0.2 = 0.7 s.
    after = reading(10.5, 9, 1.0 + 4 * 2.1, 3_000, 15_000)
    assert measured_slowdown(after.since(before), COST) == pytest.approx(3.0)


def test_too_few_prefills_say_nothing() -> None:
    before = reading(10.0, 5, 1.0, 1_000, 5_000)
    after = reading(10.5, 5 + MIN_PREFILLS - 1, 9.0, 2_000, 9_000)
    assert measured_slowdown(after.since(before), COST) is None


@dataclass
class Worker:
    id: WorkerId
    load: LoadSnapshot | None = None


def test_speeds_start_at_the_profile_then_follow_readings_smoothly() -> None:
    speeds, w = WorkerSpeeds(COST), Worker(WorkerId("w0"))
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
    assert speeds.slowdown(WorkerId("never-read")) == 1.0


def test_a_reading_with_too_few_prefills_is_pooled_with_the_next() -> None:
    speeds, w = WorkerSpeeds(COST), Worker(WorkerId("w0"), reading(1.0, 0, 0.0, 0, 0))
    speeds.observe([w])
    w.load = reading(1.5, 2, 2 * 2.0, 2_000, 2_000)  # 2 requests at 2x: too few alone
    speeds.observe([w])
    assert speeds.slowdown(w.id) == 1.0
    w.load = reading(2.0, 4, 4 * 2.0, 4_000, 4_000)  # 2 more: 4 since the first reading
    speeds.observe([w])
    assert speeds.slowdown(w.id) == pytest.approx(2.0)


def test_an_engine_restart_measures_from_its_new_counters() -> None:
    speeds, w = WorkerSpeeds(COST), Worker(WorkerId("w0"), reading(1.0, 100, 100.0, 10**6, 10**6))
    speeds.observe([w])
    w.load = reading(2.0, 4, 4 * 0.5, 4_000, 4_000)  # counters went back: a new engine
    speeds.observe([w])
    assert speeds.slowdown(w.id) == pytest.approx(0.5)


def test_a_busy_interval_is_queueing_not_speed() -> None:
    speeds, w = WorkerSpeeds(COST), Worker(WorkerId("w0"), reading(1.0, 0, 0.0, 0, 0))
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
