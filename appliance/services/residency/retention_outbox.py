"""Directives to the workers' retention connectors, sent in the order they were decided.

The idle reaper decides on the event loop, in the turn desk's path, and must not wait there:
each directive is queued at once and sent by `run` (or `flush`) right after, in order, so a
hold and the release that follows it reach a worker in that order. A retention that controls
nothing (`NoRetention`) queues nothing.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from functools import partial

from appliance.domain.records import WorkerId
from appliance.ports import KvRetention

log = logging.getLogger(__name__)


class RetentionOutbox:
    def __init__(self, retention: KvRetention) -> None:
        self.retention = retention
        self._queued: deque[Callable[[], Awaitable[bool]]] = deque()
        self._wake = asyncio.Event()
        self.unsent = 0
        """Directives no worker took (its connector not connected)."""

    def hold(self, worker: WorkerId, key: str, until_s: float, priority: float) -> None:
        self._queue(partial(self.retention.hold, worker, key, until_s, priority))

    def release(self, worker: WorkerId, key: str) -> None:
        self._queue(partial(self.retention.release, worker, key))

    def evict_first(
        self, worker: WorkerId, key: str, keep_blocks: int = 0, drop_host: bool = False
    ) -> None:
        self._queue(partial(self.retention.evict_first, worker, key, keep_blocks, drop_host))

    def demote(self, worker: WorkerId, key: str) -> None:
        self._queue(partial(self.retention.demote, worker, key))

    def restore(self, worker: WorkerId, key: str, until_s: float, priority: float) -> None:
        self._queue(partial(self.retention.restore, worker, key, until_s, priority))

    def order(self, worker: WorkerId, priorities: Mapping[str, float]) -> None:
        self._queue(partial(self.retention.order, worker, priorities))

    def _queue(self, send: Callable[[], Awaitable[bool]]) -> None:
        if self.retention.controls:
            self._queued.append(send)
            self._wake.set()

    async def flush(self) -> None:
        """Sends every directive queued so far, in order."""
        while self._queued:
            send = self._queued.popleft()
            try:
                sent = await send()
            except Exception:
                log.exception("idle reaper: a directive could not be sent")
                sent = False
            self.unsent += not sent

    async def run(self) -> None:
        """Sends directives as they are queued, until cancelled."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            await self.flush()
