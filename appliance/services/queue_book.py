"""The queue book: what the router has sent each worker and not seen finish, and what that
means as seconds of prefill ahead of a new request there.

Model of the world. Every attempt the router sends is written here when it leaves
(`sent`), when its first byte comes back (`first_byte`: its prefill is done) and when it
ends (`ended`). From that the book answers `queue_s(worker)`: the prefill seconds ahead of
a new request at that worker. What the router sent counts only for the part the worker
cannot have done yet, taking the requests one after the other at the cost model's speed
scaled by the worker's measured slowdown: a non-streamed answer shows no first token, and
counting its prefill until the whole answer is back would count its decode as queue. When
the worker reports waiting requests that are not the router's own (other clients, a
restarted router), those count at the worker's mean prompt length instead, if that is more.

A worker's reading is up to a refresh old, so the router's own requests are counted as
they were when it was taken (`AttemptSpans.in_flight_at`, the spans the book writes): a
stale reading of its own queue must never look like load. Failed attempts are remembered
for `FAILURE_WINDOW_S` (a tie-breaker of the routing policy). The book takes `now` from its
clock, so the replay can run it in virtual time.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence

from appliance.domain.records import TurnId, WorkerId
from appliance.policy.routing import PrefillCost
from appliance.ports import Clock, WorkerEndpoint
from appliance.services.attempt_spans import AttemptSpans

FAILURE_WINDOW_S = 60.0
MEAN_PREFILL_WEIGHT = 0.1
"""Smoothing of the moving average of recent turns' prefill seconds."""


class QueueBook:
    def __init__(
        self,
        cost: PrefillCost,
        clock: Clock,
        slowdown: Callable[[WorkerId], float] | None = None,
        spans: AttemptSpans | None = None,
    ) -> None:
        self._cost = cost
        self._clock = clock
        self.slowdown = slowdown or (lambda worker: 1.0)
        """Each worker's prefill seconds per second of the cost model's (WorkerSpeeds)."""
        self.spans = spans or AttemptSpans(clock)
        """When the router's attempts at each worker ran (written here as they go)."""
        # Failed attempts per worker in the last FAILURE_WINDOW_S, oldest first.
        self._failures: dict[WorkerId, deque[float]] = {}
        # Prefill work sent to each worker whose first byte has not come back yet: its
        # estimated seconds and when the worker should be done with it.
        self._pending: dict[WorkerId, dict[TurnId, tuple[float, float]]] = {}
        self._mean_prefill_s = 0.0

    # --- what the router reports -----------------------------------------------------

    def sent(self, worker: WorkerId, turn: TurnId, prefill_s: float, started_at: float) -> None:
        """An attempt left for `worker`, with `prefill_s` of estimated prefill."""
        done_by = started_at + self.routed_s(worker, started_at) + prefill_s
        self._pending.setdefault(worker, {})[turn] = (prefill_s, done_by)
        self.spans.began(worker, turn, started_at)
        self._mean_prefill_s += MEAN_PREFILL_WEIGHT * (prefill_s - self._mean_prefill_s)

    def first_byte(self, worker: WorkerId, turn: TurnId) -> None:
        """The attempt's first byte came back: its prefill is done."""
        self._pending.get(worker, {}).pop(turn, None)

    def ended(self, worker: WorkerId, turn: TurnId, *, failed: bool) -> None:
        self._pending.get(worker, {}).pop(turn, None)
        end = self.spans.ended(worker, turn)
        if failed:
            self._failures.setdefault(worker, deque()).append(end)

    # --- what the policy reads -------------------------------------------------------

    def prefill_s(self, worker: WorkerId, fresh: int, reused: int) -> float:
        """The cost model's prefill seconds at this worker's measured speed."""
        return self._cost.prefill_s(fresh, reused) * self.slowdown(worker)

    def estimates(self, workers: Sequence[WorkerEndpoint]) -> dict[WorkerId, float]:
        """`queue_s` of every worker: computed once per turn, for admission and placement."""
        return {w.id: self.queue_s(w) for w in workers}

    def queue_s(self, worker: WorkerEndpoint) -> float:
        """Prefill seconds ahead of a new request at `worker` (the module docstring)."""
        load = worker.load
        routed = self.routed_s(worker.id, self._clock.now())
        foreign = load.waiting - self.spans.in_flight_at(worker.id, load.time) if load else 0
        if load is None or foreign <= 0:
            return routed
        mean_prompt = load.prompt_tokens / load.ttft_count if load.ttft_count else 0
        per_request = self.prefill_s(worker.id, int(mean_prompt), 0) if mean_prompt else 0.0
        return max(routed, foreign * max(per_request, self._mean_prefill_s))

    def routed_s(self, worker: WorkerId, now: float) -> float:
        """The prefill seconds the router sent to `worker` that it may still have to do."""
        pending = self._pending.get(worker)
        if not pending:
            return 0.0
        return sum(min(est, done_by - now) for est, done_by in pending.values() if done_by > now)

    def recent_failures(self, worker: WorkerId) -> int:
        seen = self._failures.get(worker)
        if not seen:
            return 0
        horizon = self._clock.now() - FAILURE_WINDOW_S
        while seen and seen[0] < horizon:
            seen.popleft()
        return len(seen)
