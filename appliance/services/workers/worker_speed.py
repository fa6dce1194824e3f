"""Each worker's prefill speed as measured, against the GPU profile's.

Model of the world: the cost model (a GPU profile) says how long a prefill takes on the GPU
it was measured on. A worker on another GPU, serving another model, or running the CPU
build of vLLM is slower or faster by a roughly steady factor, its slowdown. Every load
reading carries the worker's own prefill seconds (vLLM's `request_prefill_time_seconds`
histogram: from a request's first scheduling to its first token) and the prompt and
computed (uncached) tokens of the same finished requests. Between two readings, the mean
measured prefill over the profile's prefill of the mean request is one sample of the
slowdown; samples are smoothed.

A worker never measured (or measured on too few prefills) counts as the median of those
measured, or as the profile says (1) while none is: the box's workers serve one model on
one kind of GPU. Counting it at 1 beside siblings measured 100x slower (the CPU build)
made a cold prefill there look 100x cheaper than the rest of a session's turn at its
home, and a ten-turn session left its prefix for the one worker that had never served.

Only calm intervals count: a prefill that shares the worker's steps with other requests'
prefills and decodes takes longer, and that is batching and queueing, which the router
already counts, not speed. So an interval is a sample only when the worker did one request
at a time throughout: every request it finished in the interval, and every one running at
either reading, was the router's (no more than the router had there), none was waiting at
either reading, and the router's never overlapped (`AttemptSpans.one_at_a_time`). Calm
readings alone are not enough: twice a second leaves room for several short requests in
between, and under load (50 agent sessions on two simulated workers, the router-overhead
benchmark) such intervals measured workers that run at the profile's speed 2-6x slower,
each differently, so one looked slower than the other and sessions left their prefix there.
A busy worker keeps the slowdown measured when it was calm (speed is the hardware's and the
model's, it does not drift with load); a worker never calm stays at 1.

The router's queue estimates, the seconds a resident prefix saves, and admission's prefill
estimates all scale by it, so a router in front of workers slower than its profile sees
their queues as long as they really are, and one in front of faster ones does not hold
work back.
"""

from __future__ import annotations

from collections.abc import Iterable
from statistics import median
from typing import Protocol

from appliance.domain.records import WorkerId
from appliance.domain.worker import LoadSnapshot
from appliance.policy.routing import PrefillCost
from appliance.ports import WorkerEndpoint

MIN_PREFILLS = 3
"""Prefills a reading must add before it says anything about speed."""
SMOOTHING = 0.3
"""Weight of the newest sample in the running slowdown."""
SLOWDOWN_RANGE = (1e-3, 1e5)
"""A sample outside this is a broken reading, not a speed: clamped to it."""


def measured_slowdown(delta: LoadSnapshot, cost: PrefillCost) -> float | None:
    """Measured prefill seconds over the profile's for the same requests, from a reading's
    increments over an earlier one (`LoadSnapshot.since`); None for fewer than
    `MIN_PREFILLS` prefills or nothing to compare with."""
    n = delta.prefill_count
    if n < MIN_PREFILLS or delta.prefill_sum_s <= 0 or (mean := delta.mean_prefill) is None:
        return None
    fresh = max(1, mean[0])
    modelled = cost.prefill_s(fresh, max(0, mean[1] - fresh))
    if modelled <= 0:
        return None
    low, high = SLOWDOWN_RANGE
    return min(high, max(low, delta.prefill_sum_s / n / modelled))


class OwnTraffic(Protocol):
    """What the router knows of its own attempts at each worker (AttemptSpans)."""

    def in_flight_at(self, worker: WorkerId, t: float) -> int: ...

    def one_at_a_time(self, worker: WorkerId, since: float, until: float) -> int | None: ...


class WorkerSpeeds:
    """The running slowdown of every worker, fed each time the daemon polls them."""

    def __init__(self, cost: PrefillCost, spans: OwnTraffic) -> None:
        self._cost = cost
        self._spans = spans
        self._last: dict[WorkerId, LoadSnapshot] = {}
        self._slowdown: dict[WorkerId, float] = {}

    def observe(self, workers: Iterable[WorkerEndpoint]) -> None:
        """Takes each worker's newest load reading (one already seen changes nothing)."""
        for w in workers:
            load, last = w.load, self._last.get(w.id)
            if load is None or (last is not None and load.time <= last.time):
                continue
            if last is None:
                self._last[w.id] = load  # the first reading: what the next compares with
                continue
            delta = load.since(last)
            if not self._alone(w.id, last, load, delta.prefill_count):
                self._last[w.id] = load  # busy in between: measure from here
                continue
            sample = measured_slowdown(delta, self._cost)
            if sample is None:
                continue  # too few prefills yet: the next reading compares with `last`
            self._last[w.id] = load
            before = self._slowdown.get(w.id)
            self._slowdown[w.id] = (
                sample if before is None else before + SMOOTHING * (sample - before)
            )

    def slowdown(self, worker: WorkerId) -> float:
        """Measured prefill seconds per second of the cost model's (the module docstring
        says what a worker not yet measured counts as)."""
        measured = self._slowdown.get(worker)
        if measured is not None:
            return measured
        return median(self._slowdown.values()) if self._slowdown else 1.0

    def _alone(self, worker: WorkerId, last: LoadSnapshot, load: LoadSnapshot, done: int) -> bool:
        """Whether the worker did one request at a time from `last` to `load`, `done` of
        them finishing in between (the module docstring)."""
        for reading in (last, load):
            if reading.waiting or reading.running > self._spans.in_flight_at(worker, reading.time):
                return False
        own = self._spans.one_at_a_time(worker, last.time, load.time)
        return own is not None and done <= own
