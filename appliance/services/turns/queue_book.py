"""The queue book: what the router has sent each worker and not seen finish, and what that
means as seconds of prefill ahead of a new request there.

Model of the world. Every attempt the router sends is written here when it leaves
(`sent`), when its first byte comes back (`first_byte`: its prefill is done) and when it
ends (`ended`). From that the book answers `queue_s(worker)`: the prefill seconds ahead of
a new request at that worker. What the router sent counts only for the part the worker
cannot have done yet, taking the requests one after the other at the cost model's speed
scaled by the worker's measured slowdown: a non-streamed answer shows no first token, and
counting its prefill until the whole answer is back would count its decode as queue.

A streamed attempt past its estimate with no first byte yet is still in its prefill (it
shares the worker's steps with others' decodes, waits for blocks, or the estimate was
short): it counts as needing as long again as it has overrun, up to its estimate. Letting
it lapse made a worker with a 115k-token cold prefill 27 s in (10 s estimated, 36 s taken)
look idle, and short turns sent there waited 9 s for a first token (the Mooncake replay's
slowest requests under the same router, whatever the residency). A non-streamed attempt
shows its first byte only at its end, so it counts only up to its estimate. (Counting an
overdue one once more at the worker's mean prefill when a reading shows it waiting, as
below, took the recorded agent sessions' TTFT p95 back from 1.39 to 1.58 s: the book's
own figure for it is the better one.)

A worker does not always take its requests as fast as that: one whose KV cache is full
admits a waiting request only when running ones end and free their blocks, so requests the
book counts as done long ago can still be waiting there. The worker's reading says how many
are waiting; those the book no longer counts (its own past their estimate, other clients',
a restarted router's) count at the worker's mean prefill, or the book's mean prefill if
that is more, on top of what the book counts. The worker's mean prefill is that of its
finished requests, their mean fresh prompt over their mean cached one (vLLM's
`request_prefill_kv_computed_tokens`), not their whole prompt: an agent's turn re-sends a
long prompt mostly cached, and counted whole, each reading made an evenly loaded worker
look seconds busier than its sibling (200 sessions in `benchmarks/router_overhead.py`:
sessions moved off their prefixes, cache hit 0.72, first byte p50 9.4 s against 2.6 s
direct). On the agent workload at 4 x 8 GiB the
book alone estimated 0.00-0.02 s at workers where turns then waited 1.9-6.5 s for a first
token (1-6 requests waiting), and sessions stayed there.

A worker's reading is up to a refresh old, so of the requests it reports waiting those that
have left the queue since (their first byte came, or they ended without one) are not
counted, nor are those the book still counts, sent by then: a stale reading of its own queue
must never look like load. A non-streamed attempt admitted since the reading counts until
it ends or the next reading. Failed attempts are remembered for `FAILURE_WINDOW_S` (a
tie-breaker of the routing policy). The book takes `now` from its clock, so the replay can
run it in virtual time.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence

from appliance.domain.records import TurnId, WorkerId
from appliance.domain.worker import LoadSnapshot
from appliance.policy.routing import PrefillCost
from appliance.ports import Clock, WorkerEndpoint
from appliance.services.turns.attempt_spans import SPAN_MEMORY_S, AttemptSpans

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
        # estimated seconds, when the worker should be done with it, when it was sent and
        # whether it streams (its first byte will be seen).
        self._pending: dict[WorkerId, dict[TurnId, tuple[float, float, float, bool]]] = {}
        # When the router's attempts at each worker left its waiting queue, as far as the
        # router can tell (first byte, or the end before one), oldest first.
        self._left: dict[WorkerId, deque[float]] = {}
        self._mean_prefill_s = 0.0

    # --- what the router reports -----------------------------------------------------

    def sent(
        self,
        worker: WorkerId,
        turn: TurnId,
        prefill_s: float,
        started_at: float,
        *,
        streamed: bool = True,
    ) -> None:
        """An attempt left for `worker`, with `prefill_s` of estimated prefill."""
        done_by = started_at + self.routed_s(worker, started_at) + prefill_s
        self._pending.setdefault(worker, {})[turn] = (prefill_s, done_by, started_at, streamed)
        self.spans.began(worker, turn, started_at)
        self._mean_prefill_s += MEAN_PREFILL_WEIGHT * (prefill_s - self._mean_prefill_s)

    def first_byte(self, worker: WorkerId, turn: TurnId) -> None:
        """The attempt's first byte came back: its prefill is done."""
        self._left_queue(worker, turn)

    def ended(self, worker: WorkerId, turn: TurnId, *, failed: bool) -> None:
        self._left_queue(worker, turn)
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
        return self.queue_at(worker.id, worker.load)

    def queue_at(self, worker: WorkerId, load: LoadSnapshot | None) -> float:
        """`queue_s` of `worker` given its latest reading, `load` (None: none yet)."""
        now = self._clock.now()
        routed = self.routed_s(worker, now)
        if load is None:
            return routed
        uncounted = load.waiting - self._left_since(worker, load.time)
        uncounted -= self._counted(worker, load.time, now)
        if uncounted <= 0:
            return routed
        return routed + uncounted * max(self._waiting_prefill_s(worker, load), self._mean_prefill_s)

    def _waiting_prefill_s(self, worker: WorkerId, load: LoadSnapshot) -> float:
        """The prefill a request the worker reports waiting will take: its finished
        requests' mean fresh prompt over their mean cached one, or, before any has
        finished, the mean prompt of those that had a first token."""
        if (mean := load.mean_prefill) is not None:
            fresh, prompt = mean
            return self.prefill_s(worker, fresh, max(0, prompt - fresh))
        mean_prompt = load.prompt_tokens / load.ttft_count if load.ttft_count else 0
        return self.prefill_s(worker, int(mean_prompt), 0) if mean_prompt else 0.0

    def routed_s(self, worker: WorkerId, now: float) -> float:
        """The prefill seconds the router sent to `worker` that it may still have to do."""
        pending = self._pending.get(worker)
        if not pending:
            return 0.0
        return sum(
            _left_s(est, done_by, now, streamed) for est, done_by, _, streamed in pending.values()
        )

    def _counted(self, worker: WorkerId, sent_by: float, now: float) -> int:
        """The router's attempts at `worker` sent by `sent_by` that `routed_s` still counts."""
        pending = self._pending.get(worker, {}).values()
        return sum(
            1
            for est, done_by, sent, streamed in pending
            if sent <= sent_by and _left_s(est, done_by, now, streamed) > 0
        )

    def _left_queue(self, worker: WorkerId, turn: TurnId) -> None:
        if self._pending.get(worker, {}).pop(turn, None) is None:
            return
        now = self._clock.now()
        left = self._left.setdefault(worker, deque())
        left.append(now)
        while left[0] < now - SPAN_MEMORY_S:  # older than any reading
            left.popleft()

    def _left_since(self, worker: WorkerId, t: float) -> int:
        """The router's attempts at `worker` that left its waiting queue after `t`."""
        n = 0
        left = self._left.get(worker, ())
        for at in reversed(left):
            if at <= t:
                break
            n += 1
        return n

    def recent_failures(self, worker: WorkerId) -> int:
        seen = self._failures.get(worker)
        if not seen:
            return 0
        horizon = self._clock.now() - FAILURE_WINDOW_S
        while seen and seen[0] < horizon:
            seen.popleft()
        return len(seen)


def _left_s(est: float, done_by: float, now: float, streamed: bool) -> float:
    """The prefill seconds an attempt may still have ahead of it (the module docstring)."""
    if done_by > now:
        return min(est, done_by - now)
    return min(est, now - done_by) if streamed else 0.0
