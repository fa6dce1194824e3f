"""The appliance's end of the retention control channel: one ROUTER socket per worker, bound
on 127.0.0.1 before the worker starts (the connector in the worker connects to it).

Model of the world: a worker's connector says hello with a report (seq 0, holding nothing)
and reports again on every change and every few seconds; its socket identity is its
incarnation, so a directive goes to the connector that is running now, and a restarted
worker shows up as a new incarnation that holds nothing. `forget` (the supervisor calls
it when the process exits) makes the view say so before the new one is up. A directive to a
worker with no connector connected is not sent (the call returns False): the caller's view
already says that worker holds nothing. A directive sent takes effect at the worker's next
scheduler step (on an idle worker: when its next request comes, before it is admitted); the
view shows it once the report that follows arrives.

Keys are what vLLM sees as a request's `session_id`: the appliance forwards
`"{tenant}/{session}"` in every turn's body. Times are unix times.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import suppress
from dataclasses import dataclass

import zmq
import zmq.asyncio

from appliance.domain.records import WorkerId
from appliance.domain.retention import HostTierSize, RetainedKv, ReturnedKv
from appliance.engines.retention.protocol import (
    RetentionDemote,
    RetentionDirective,
    RetentionEvictFirst,
    RetentionHold,
    RetentionOrder,
    RetentionQuery,
    RetentionRelease,
    RetentionReport,
    RetentionRestore,
    decode_report,
    encode_retention,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class WorkerRetention:
    """What the appliance knows of one worker's holds."""

    worker: WorkerId
    incarnation: str | None = None
    """The connector running now; None before its hello, and after the worker exited."""
    report: RetentionReport | None = None
    """Its latest report; None: it holds nothing."""
    restarts: int = 0
    """Incarnations seen after the first."""

    @property
    def held(self) -> dict[str, int]:
        """Held blocks by key."""
        return {h.key: h.blocks for h in self.report.held} if self.report else {}


class RetentionClient:
    """The appliance's `ports.KvRetention` for vLLM workers."""

    controls = True
    """Directives reach the workers (`ports.KvRetention`)."""

    def __init__(self, endpoints: Mapping[WorkerId, str], *, backlog: int = 1000) -> None:
        self.endpoints = dict(endpoints)
        self._ctx = zmq.asyncio.Context()
        self._sockets: dict[WorkerId, zmq.asyncio.Socket] = {}
        self._views = {w: WorkerRetention(w) for w in self.endpoints}
        self._backlog: asyncio.Queue[tuple[WorkerId, RetentionReport]] = asyncio.Queue(backlog)
        self._changed = asyncio.Event()
        """Set (and replaced) whenever a view changes."""
        self._tasks: list[asyncio.Task[None]] = []
        self._greeted: set[WorkerId] = set()
        """Workers whose connector said hello at least once."""
        self._gone: set[str] = set()
        """Incarnations of workers that exited."""
        self._retained: dict[WorkerId, tuple[RetentionReport, dict[str, RetainedKv]]] = {}

    def bind(self) -> RetentionClient:
        """Binds every worker's socket (zmq.ZMQError when a port is taken) and starts
        listening; on the event loop that will use it."""
        for worker, endpoint in self.endpoints.items():
            sock = self._ctx.socket(zmq.ROUTER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # an unknown identity raises, not drops
            self._sockets[worker] = sock
            sock.bind(endpoint)
            self._tasks.append(asyncio.create_task(self._listen(worker, sock)))
        return self

    async def aclose(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with suppress(asyncio.CancelledError):
                await task
        for sock in self._sockets.values():
            sock.close(0)
        self._ctx.term()

    # --- directives ---

    async def hold(self, worker: WorkerId, key: str, until_s: float, priority: float = 0.0) -> bool:
        """Hold (or extend) `key`'s newest finished request's cached blocks until `until_s`."""
        return await self.send(worker, RetentionHold(key, until_s, priority))

    async def release(self, worker: WorkerId, key: str) -> bool:
        return await self.send(worker, RetentionRelease(key))

    async def evict_first(
        self, worker: WorkerId, key: str, keep_blocks: int = 0, drop_host: bool = False
    ) -> bool:
        return await self.send(worker, RetentionEvictFirst(key, keep_blocks, drop_host))

    async def demote(self, worker: WorkerId, key: str) -> bool:
        """Stop holding; the key's blocks go first on the GPU once the host tier has them."""
        return await self.send(worker, RetentionDemote(key))

    async def restore(
        self, worker: WorkerId, key: str, until_s: float, priority: float = 0.0
    ) -> bool:
        """Bring the key's prefix back into HBM from the host tier, kept until `until_s`."""
        return await self.send(worker, RetentionRestore(key, until_s, priority))

    async def order(self, worker: WorkerId, priorities: Mapping[str, float]) -> bool:
        """New priorities for held keys: under pressure the lowest goes first."""
        return await self.send(worker, RetentionOrder(dict(priorities)))

    async def query(self, worker: WorkerId) -> bool:
        """Asks for a report now."""
        return await self.send(worker, RetentionQuery())

    async def send(self, worker: WorkerId, directive: RetentionDirective) -> bool:
        """False when no connector of that worker is connected (nothing was sent)."""
        incarnation = self._views[worker].incarnation
        if incarnation is None:
            return False
        try:
            await self._sockets[worker].send_multipart(
                [incarnation.encode(), encode_retention(directive)], flags=zmq.NOBLOCK
            )
        except zmq.ZMQError as exc:  # gone (EHOSTUNREACH) or not reading (EAGAIN)
            log.debug("retention directive to %s not sent: %s", worker, exc)
            return False
        return True

    # --- what the workers say ---

    def view(self, worker: WorkerId) -> WorkerRetention:
        return self._views[worker]

    def retained(self, worker: WorkerId) -> Mapping[str, RetainedKv]:
        """What the worker holds by key, as its latest report shows it (built once a report:
        the state asks for every session)."""
        view = self._views.get(worker)
        report = view.report if view is not None else None
        if report is None:
            return {}
        cached = self._retained.get(worker)
        if cached is None or cached[0] is not report:
            held = {h.key: RetainedKv(h.key, h.tokens, h.until_s, h.priority) for h in report.held}
            cached = self._retained[worker] = (report, held)
        return cached[1]

    def kv_usage(self, worker: WorkerId) -> float | None:
        """Share of the pool not free (requests' and held blocks), per the latest report."""
        view = self._views.get(worker)
        report = view.report if view is not None else None
        if report is None or report.pool_blocks <= 0:
            return None
        return 1.0 - min(report.free_blocks, report.pool_blocks) / report.pool_blocks

    def host_tier(self, worker: WorkerId) -> HostTierSize | None:
        """The worker's host tier per the latest report; None: it has none (or no report
        yet)."""
        view = self._views.get(worker)
        report = view.report if view is not None else None
        if report is None or report.host_blocks <= 0:
            return None
        used = min(report.host_used_blocks, report.host_blocks)
        return HostTierSize(report.host_blocks, used, report.pool_blocks)

    async def returned(self) -> AsyncIterator[ReturnedKv]:
        """Every hold given back, as the reports arrive (`reports`: one reader)."""
        async for worker, report in self.reports():
            for g in report.given_back:
                yield ReturnedKv(worker, g.key, g.blocks, g.reason.value)

    def forget(self, worker: WorkerId) -> None:
        """The worker's process exited: it holds nothing, and no connector is there."""
        view = self._views[worker]
        if view.incarnation is not None:
            self._gone.add(view.incarnation)  # its last reports may still be on the way
        self._views[worker] = WorkerRetention(worker, None, None, view.restarts)
        self._notify()

    async def reports(self) -> AsyncIterator[tuple[WorkerId, RetentionReport]]:
        """Every report as it arrives (the oldest are dropped past `backlog` unread)."""
        while True:
            yield await self._backlog.get()

    async def wait_for(
        self,
        worker: WorkerId,
        predicate: Callable[[WorkerRetention], bool],
        timeout_s: float,
    ) -> WorkerRetention:
        """The worker's view once `predicate` holds for it (TimeoutError after `timeout_s`)."""
        async with asyncio.timeout(timeout_s):
            while not predicate(self._views[worker]):
                await self._changed.wait()
        return self._views[worker]

    async def _listen(self, worker: WorkerId, sock: zmq.asyncio.Socket) -> None:
        while True:
            frames = await sock.recv_multipart()
            try:
                report = decode_report(frames[-1])
            except ValueError as exc:
                log.warning("undecodable retention report from %s: %s", worker, exc)
                continue
            self._accept(worker, report)

    def _accept(self, worker: WorkerId, report: RetentionReport) -> None:
        view = self._views[worker]
        restarts = view.restarts
        if report.incarnation in self._gone:
            return
        if report.incarnation != view.incarnation:
            # The newest connector to speak is the one running: a worker runs one.
            if worker in self._greeted:
                restarts += 1
            self._greeted.add(worker)
            log.info("worker %s: retention connector %s", worker, report.incarnation)
        self._views[worker] = WorkerRetention(worker, report.incarnation, report, restarts)
        if self._backlog.full():
            self._backlog.get_nowait()
        self._backlog.put_nowait((worker, report))
        self._notify()

    def _notify(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()
