"""Each worker's prefill speed as measured, against the GPU profile's.

Model of the world: the cost model (a GPU profile) says how long a prefill takes on the GPU
it was measured on. A worker on another GPU, serving another model, or running the CPU
build of vLLM is slower or faster by a roughly steady factor, its slowdown. Every load
reading carries the worker's own prefill seconds (vLLM's `request_prefill_time_seconds`
histogram: from a request's first scheduling to its first token) and the prompt and
computed (uncached) tokens of the same finished requests. Between two readings, the mean
measured prefill over the profile's prefill of the mean request is one sample of the
slowdown; samples are smoothed, and a worker never measured (or measured on too few
prefills) counts as the profile says (1).

Only calm intervals count: a prefill that shares the worker's steps with other requests'
prefills and decodes takes longer, and that is queueing, which the router already counts,
not speed. So an interval is a sample only when both of its readings show at most one
request running and none waiting; a busy worker keeps the slowdown measured when it was
calm (speed is the hardware's and the model's, it does not drift with load).

The router's queue estimates, the seconds a resident prefix saves, and admission's prefill
estimates all scale by it, so a router in front of workers slower than its profile sees
their queues as long as they really are, and one in front of faster ones does not hold
work back.
"""

from __future__ import annotations

from collections.abc import Iterable

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
    if n < MIN_PREFILLS or delta.prefill_sum_s <= 0:
        return None
    fresh = max(1, delta.prefill_fresh_tokens // n)
    reused = max(0, delta.prefill_prompt_tokens // n - fresh)
    modelled = cost.prefill_s(fresh, reused)
    if modelled <= 0:
        return None
    low, high = SLOWDOWN_RANGE
    return min(high, max(low, delta.prefill_sum_s / n / modelled))


class WorkerSpeeds:
    """The running slowdown of every worker, fed each time the daemon polls them."""

    def __init__(self, cost: PrefillCost) -> None:
        self._cost = cost
        self._last: dict[WorkerId, LoadSnapshot] = {}
        self._slowdown: dict[WorkerId, float] = {}

    def observe(self, workers: Iterable[WorkerEndpoint]) -> None:
        """Takes each worker's newest load reading (one already seen changes nothing)."""
        for w in workers:
            load, last = w.load, self._last.get(w.id)
            if load is None or (last is not None and load.time <= last.time):
                continue
            if last is None or not (_calm(last) and _calm(load)):
                self._last[w.id] = load  # busy in between: measure from here
                continue
            sample = measured_slowdown(load.since(last), self._cost)
            if sample is None:
                continue  # too few prefills yet: the next reading compares with `last`
            self._last[w.id] = load
            before = self._slowdown.get(w.id)
            self._slowdown[w.id] = (
                sample if before is None else before + SMOOTHING * (sample - before)
            )

    def slowdown(self, worker: WorkerId) -> float:
        """Measured prefill seconds per second of the cost model's (1 until measured)."""
        return self._slowdown.get(worker, 1.0)


def _calm(load: LoadSnapshot) -> bool:
    return load.running <= 1 and load.waiting == 0
