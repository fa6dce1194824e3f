"""The GPU meter: a worker's busy GPU-seconds divided among its attempts by modelled compute,
adding up to the busy time exactly; idle time apart."""

from __future__ import annotations

import math

import pytest

from appliance.domain.records import TurnId, WorkerId
from appliance.perf.latency import LatencyModel
from appliance.perf.profile import bundled_profile
from appliance.services.turns.turn import Attempt
from appliance.services.workers.gpu_meter import GpuMeter
from tests.fakes import ManualClock

W0, W1 = WorkerId("w0"), WorkerId("w1")
COST = LatencyModel.from_profile(bundled_profile())


def meter(clock: ManualClock, gpus: int = 1, slowdown: float = 1.0) -> GpuMeter:
    return GpuMeter(clock, COST, lambda worker: slowdown, gpus)


def attempt(
    clock: ManualClock, name: str, worker: WorkerId = W0, est_prefill_s: float = 0.1
) -> Attempt:
    return Attempt(TurnId(name), worker, 0, clock.now(), est_prefill_s)


def usage(prompt: int, output: int, cached: int = 0) -> dict[str, object]:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": output,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def compute_s(prompt: int, output: int, cached: int = 0) -> float:
    """The meter's model of an attempt's compute, written out."""
    step = COST.decode_step_s(1, prompt)
    return COST.prefill_s(prompt - cached, cached) + output * step


def test_an_attempt_alone_takes_its_whole_wall_time_times_the_workers_gpus() -> None:
    clock = ManualClock()
    m = meter(clock, gpus=2)
    a = attempt(clock, "a")
    m.began(a, 1000)
    clock.advance(3.0)
    a.usage = usage(1000, 50)
    assert m.ended(a) == pytest.approx(6.0)
    clock.advance(5.0)  # idle: charged to no attempt, shown apart
    reading = m.reading(W0)
    assert reading.busy_s == pytest.approx(6.0)
    assert reading.awake_s == pytest.approx(16.0)
    assert reading.idle_s == pytest.approx(10.0)


def test_overlapping_attempts_share_the_busy_time_by_their_compute_and_add_up_to_it() -> None:
    clock = ManualClock()
    m = meter(clock)
    big, small = attempt(clock, "big", est_prefill_s=0.0), attempt(clock, "small")
    m.began(big, 8000)
    m.began(small, 500)
    clock.advance(2.0)
    big.usage, small.usage = usage(8000, 100), usage(500, 100)
    # Both end at the same instant: the first to end shares the pool with what the other
    # has done by the router's account (its estimated prefill, no chunks).
    first = m.ended(big)
    second = m.ended(small)
    big_c = compute_s(8000, 100)
    assert first == pytest.approx(2.0 * big_c / (big_c + small.estimated_prefill_s))
    assert first + second == pytest.approx(2.0)
    assert m.reading(W0).busy_s == pytest.approx(2.0)


def test_a_gap_between_attempts_is_idle_and_their_shares_are_each_their_own_span() -> None:
    clock = ManualClock()
    m = meter(clock)
    shares = []
    for name in ("one", "two"):
        a = attempt(clock, name)
        m.began(a, 100)
        clock.advance(1.5)
        a.usage = usage(100, 10)
        shares.append(m.ended(a))
        clock.advance(4.0)
    assert shares == [pytest.approx(1.5), pytest.approx(1.5)]
    assert m.reading(W0).idle_s == pytest.approx(8.0)


def test_workers_are_metered_apart() -> None:
    clock = ManualClock()
    m = meter(clock)
    a = attempt(clock, "a", W0)
    m.began(a, 100)
    clock.advance(1.0)
    b = attempt(clock, "b", W1)
    m.began(b, 100)
    clock.advance(1.0)
    assert m.ended(a) == pytest.approx(2.0)  # b's work at w1 takes nothing of w0's time
    clock.advance(1.0)
    assert m.ended(b) == pytest.approx(2.0)
    assert (m.reading(W0).busy_s, m.reading(W1).busy_s) == (pytest.approx(2.0),) * 2


def test_an_attempt_without_the_workers_counts_is_weighed_by_what_the_router_saw() -> None:
    """A stream cut midway has no usage: its estimated prefill and chunks relayed count."""
    clock = ManualClock()
    m = meter(clock)
    cut = attempt(clock, "cut", est_prefill_s=0.2)
    other = attempt(clock, "other", est_prefill_s=0.0)
    m.began(cut, 1000)
    m.began(other, 1000)
    cut.chunks = 30
    clock.advance(4.0)
    other.usage = usage(1000, 20)
    taken = m.ended(other)
    cut_done = 0.2 + 30 * COST.decode_step_s(1, 1000)
    other_c = compute_s(1000, 20)
    assert taken == pytest.approx(4.0 * other_c / (other_c + cut_done))
    assert m.ended(cut) == pytest.approx(4.0 - taken)


def test_the_workers_slowdown_scales_the_prefill_it_is_weighed_by() -> None:
    clock = ManualClock()
    slow = meter(clock, slowdown=3.0)
    a, b = attempt(clock, "a", est_prefill_s=0.0), attempt(clock, "b", est_prefill_s=1.0)
    slow.began(a, 4000)
    slow.began(b, 10)
    clock.advance(1.0)
    a.usage = usage(4000, 0)
    prefill = 3.0 * COST.prefill_s(4000, 0)
    assert slow.ended(a) == pytest.approx(prefill / (prefill + 1.0))


def test_attempts_of_no_compute_split_the_time_evenly_and_unknown_ones_take_nothing() -> None:
    clock = ManualClock()
    m = meter(clock)
    a, b = attempt(clock, "a", est_prefill_s=0.0), attempt(clock, "b", est_prefill_s=0.0)
    m.began(a, 0)
    m.began(b, 0)
    clock.advance(2.0)
    assert m.ended(a) == pytest.approx(1.0)
    assert m.ended(b) == pytest.approx(1.0)
    assert m.ended(attempt(clock, "never-began")) == 0.0


def test_many_overlapping_attempts_add_up_to_the_busy_time() -> None:
    clock = ManualClock()
    m = meter(clock, gpus=4)
    running: list[Attempt] = []
    total = 0.0
    for i in range(40):
        a = attempt(clock, f"t{i}", est_prefill_s=0.01 * (i % 7))
        m.began(a, 100 * (i % 5 + 1))
        running.append(a)
        clock.advance(0.05 * (i % 3 + 1))
        if i % 2:
            done = running.pop(0)
            done.usage = usage(100 * (i % 5 + 1), i)
            total += m.ended(done)
    for a in running:
        total += m.ended(a)
    assert math.isclose(total, m.reading(W0).busy_s, rel_tol=1e-9)
    assert m.reading(W0).idle_s == pytest.approx(0.0)


def test_a_resting_worker_is_not_awake_and_counts_again_from_its_wake() -> None:
    clock = ManualClock(0.0)
    m = meter(clock, gpus=2)
    clock.advance(10.0)
    m.rests(W0, True, clock.now())  # stopped at 10 s
    clock.advance(50.0)
    m.rests(W0, False, 40.0)  # its wake began at 40 s: awake from there
    reading = m.reading(W0)
    assert (reading.awake_s, reading.resting_s) == (2 * 30.0, 2 * 30.0)
    assert m.reading(W1).resting_s == 0.0 and m.reading(W1).awake_s == 2 * 60.0
