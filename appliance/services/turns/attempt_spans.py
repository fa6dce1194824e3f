"""When each attempt the router sent to each worker started and ended: what the router
knows of its own traffic, for the readings of the workers to be judged against.

A worker's reading is up to a refresh old, so the queue book counts the router's requests as
they were when the reading was taken (`in_flight_at`): a stale reading of its own queue must
never look like load. The worker speeds take a prefill sample only from an interval in which
the worker did the router's requests one at a time (`one_at_a_time`): a prefill that shares
the worker's steps with other requests takes longer, and that is batching, not speed. The
router's span of an attempt (sent to answered) holds the worker's, so spans that never
overlap mean requests that never shared a step. Ended spans are kept `SPAN_MEMORY_S`.
"""

from __future__ import annotations

from collections import deque
from itertools import pairwise

from appliance.domain.records import TurnId, WorkerId
from appliance.ports import Clock

SPAN_MEMORY_S = 120.0
"""Longer than any worker reading can be old, and than most intervals a speed sample spans
(one that spans more is not measured: its early attempts are forgotten)."""


class AttemptSpans:
    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        # When each attempt in flight at each worker started, and (start, end) of the ones
        # that ended in the last SPAN_MEMORY_S, oldest end first.
        self._running: dict[WorkerId, dict[TurnId, float]] = {}
        self._ended: dict[WorkerId, deque[tuple[float, float]]] = {}

    def began(self, worker: WorkerId, turn: TurnId, at: float) -> None:
        self._running.setdefault(worker, {})[turn] = at

    def ended(self, worker: WorkerId, turn: TurnId) -> float:
        """The attempt ended now; returns when."""
        end = self._clock.now()
        started = self._running.get(worker, {}).pop(turn, end)
        self._ended.setdefault(worker, deque()).append((started, end))
        return end

    def in_flight_at(self, worker: WorkerId, t: float) -> int:
        """The router's attempts in flight at `worker` at time `t` (recent ones are kept)."""
        running = sum(1 for start in self._running.get(worker, {}).values() if start <= t)
        for start, end in reversed(self._recent(worker)):  # only the ends after `t`
            if end <= t:
                break
            running += start <= t
        return running

    def one_at_a_time(self, worker: WorkerId, since: float, until: float) -> int | None:
        """The router's attempts at `worker` in flight at any time in (`since`, `until`],
        or None when two of them were in flight at once (or the interval began before the
        spans kept)."""
        if since < self._clock.now() - SPAN_MEMORY_S:
            return None
        spans = [(start, float("inf")) for start in self._running.get(worker, {}).values()]
        for start, end in reversed(self._recent(worker)):
            if end <= since:
                break
            spans.append((start, end))
        spans = sorted(s for s in spans if s[0] <= until)
        for (_, end), (start, _) in pairwise(spans):
            if start < end:
                return None
        return len(spans)

    def _recent(self, worker: WorkerId) -> deque[tuple[float, float]]:
        ended = self._ended.setdefault(worker, deque())
        horizon = self._clock.now() - SPAN_MEMORY_S
        while ended and ended[0][1] < horizon:
            ended.popleft()
        return ended
