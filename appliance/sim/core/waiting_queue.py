"""The scheduler's waiting queue, and the engine's state of one unfinished request that it
holds (`engine.py` says when requests enter and leave it)."""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterator
from typing import Literal

from appliance.sim.engine_io import FinishReason, RequestOutput, SimRequest
from appliance.sim.kv.cache_request import CacheRequest

SchedulingPolicy = Literal["fcfs", "priority"]


class RequestState:
    """The engine's state of one unfinished request."""

    __slots__ = (
        "arrival_s",
        "cache",
        "first_scheduled_s",
        "first_token_sent",
        "num_cached_tokens",
        "num_host_cached_tokens",
        "ready_s",
        "req",
        "seq",
    )

    def __init__(self, req: SimRequest, cache: CacheRequest, arrival_s: float, seq: int):
        self.req = req
        self.cache = cache
        self.arrival_s = arrival_s
        self.seq = seq
        self.num_cached_tokens = 0
        self.num_host_cached_tokens = 0
        self.ready_s = 0.0  # while loading from the host tier: when the copy ends
        self.first_token_sent = False
        self.first_scheduled_s: float | None = None

    def priority_key(self) -> tuple[int, float, str, int]:
        """vLLM's `Request.__lt__`: priority, then arrival, then request id."""
        return (self.req.priority, self.arrival_s, self.req.request_id, self.seq)


def request_output(
    entry: RequestState, tokens: list[int], reason: FinishReason | None
) -> RequestOutput:
    """What a step produced for the request: `tokens`, and its end if `reason`."""
    return RequestOutput(
        entry.req.request_id,
        tokens,
        reason is not None,
        reason,
        entry.cache.num_prompt_tokens,
        entry.num_cached_tokens,
        False,
        entry.cache.num_preemptions,
        entry.first_scheduled_s,
        entry.num_host_cached_tokens,
    )


class WaitingQueue:
    """FCFS: a deque (preempted requests go back to the front). Priority: a heap on
    (priority, arrival, request id), where a preempted request simply goes back in."""

    def __init__(self, policy: SchedulingPolicy) -> None:
        self.priority = policy == "priority"
        self._fifo: deque[RequestState] = deque()
        self._heap: list[tuple[tuple[int, float, str, int], RequestState]] = []

    def __len__(self) -> int:
        return len(self._heap) if self.priority else len(self._fifo)

    def __iter__(self) -> Iterator[RequestState]:
        return (e for _, e in self._heap) if self.priority else iter(self._fifo)

    def add(self, e: RequestState) -> None:
        if self.priority:
            heapq.heappush(self._heap, (e.priority_key(), e))
        else:
            self._fifo.append(e)

    def prepend(self, e: RequestState) -> None:
        if self.priority:
            self.add(e)
        else:
            self._fifo.appendleft(e)

    def order_key(self, e: RequestState) -> tuple[object, ...]:
        """Where `e` would stand in this queue: priority, then arrival (vLLM's
        `Request.__lt__`); arrival alone under FCFS."""
        key = e.priority_key()
        return key if self.priority else key[1:]

    def peek(self) -> RequestState:
        return self._heap[0][1] if self.priority else self._fifo[0]

    def pop(self) -> RequestState:
        return heapq.heappop(self._heap)[1] if self.priority else self._fifo.popleft()

    def remove(self, e: RequestState) -> None:
        if self.priority:
            self._heap = [x for x in self._heap if x[1] is not e]
            heapq.heapify(self._heap)
        else:
            self._fifo.remove(e)
