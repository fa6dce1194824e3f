"""vLLM servers the appliance did not start: the same handles and client, no supervisor.

Model of the world: an external server is reached at its base URL and may publish KV events.
Its KV endpoint is written as the server itself was configured: `tcp://<appliance
address>:P` when the server connects to us (the appliance binds it, which also works for
servers on other hosts), or `tcp://*:P` / `ipc://...` when the server binds (then the
appliance connects, on this host). The appliance cannot restart or drain an external
server: its handle only moves between HEALTHY and UNHEALTHY as /health answers, and it
counts no restarts; an engine restart shows up as KV sequence numbers going back, which
makes the index forget that worker.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from functools import partial

import zmq

from appliance.domain.errors import ConfigError
from appliance.domain.kv_events import KvEventBatch
from appliance.domain.records import WorkerId
from appliance.domain.worker import UVICORN_KEEPALIVE_S, WorkerState
from appliance.engines.clients.kv_events import KvEventSubscriber
from appliance.engines.clients.vllm_client import READ_TIMEOUT_S, VllmClient
from appliance.engines.clients.workers import KvBatchSink, KvResetSink, WorkerHandle
from appliance.engines.errors import PortInUse

log = logging.getLogger(__name__)


class ExternalEngine:
    """Handles on external servers, their KV subscribers, and a health check to poll."""

    def __init__(
        self,
        urls: Sequence[str],
        kv_event_endpoints: Sequence[str] = (),
        *,
        model: str | None = None,
        on_kv_batch: KvBatchSink | None = None,
        on_kv_reset: KvResetSink | None = None,
        keepalive_s: float = UVICORN_KEEPALIVE_S,
        request_timeout_s: float = READ_TIMEOUT_S,
    ) -> None:
        if kv_event_endpoints and len(kv_event_endpoints) != len(urls):
            raise ConfigError(
                "engine.external_kv_event_endpoints must have one entry per engine.external_urls"
            )
        endpoints: list[str | None] = list(kv_event_endpoints) or [None] * len(urls)
        self._kv_fix = "check engine.external_kv_event_endpoints"
        self._on_kv_batch = on_kv_batch
        self._on_kv_reset = on_kv_reset
        self.workers: tuple[WorkerHandle, ...] = tuple(
            WorkerHandle(
                id=WorkerId(f"w{i}"),
                engine="external",
                url=url.rstrip("/"),
                client=VllmClient(
                    url,
                    model=model,
                    read_timeout_s=request_timeout_s,
                    server_keepalive_s=keepalive_s,
                ),
                kv_events_endpoint=endpoint,
                state=WorkerState.UNHEALTHY,
            )
            for i, (url, endpoint) in enumerate(zip(urls, endpoints, strict=True))
        )
        self._subscribers: list[KvEventSubscriber] = []
        self._started = False

    async def start(self) -> ExternalEngine:
        """Subscribes to KV events and reads every server's health once (none must answer).
        Idempotent."""
        if self._started:
            return self
        self._started = True
        if self._on_kv_batch is not None or self._on_kv_reset is not None:
            for handle in self.workers:
                if handle.kv_events_endpoint:
                    self._subscribers.append(self._subscribe(handle))
        await self.refresh()
        return self

    def _subscribe(self, handle: WorkerHandle) -> KvEventSubscriber:
        assert handle.kv_events_endpoint is not None
        try:
            return KvEventSubscriber(
                handle.kv_events_endpoint,
                partial(self._batch, handle.id),
                on_reset=partial(self._reset, handle.id),
            ).start()
        except zmq.ZMQError as exc:
            raise PortInUse(
                f"cannot listen on {handle.kv_events_endpoint} for {handle.url}'s KV events "
                f"({exc}); {self._kv_fix}"
            ) from None

    def _batch(self, worker: WorkerId, batch: KvEventBatch) -> None:
        if self._on_kv_batch is not None:
            self._on_kv_batch(worker, batch)

    def _reset(self, worker: WorkerId, reason: str) -> None:
        if self._on_kv_reset is not None:
            self._on_kv_reset(worker, reason)

    async def refresh(self) -> None:
        """One health (and, when healthy, load) reading of every server."""
        await asyncio.gather(*(self._refresh(h) for h in self.workers))

    async def _refresh(self, handle: WorkerHandle) -> None:
        ok = await handle.client.health()
        new = WorkerState.HEALTHY if ok else WorkerState.UNHEALTHY
        if new != handle.state:
            log.info("%s worker %s (%s) is %s", handle.engine, handle.id, handle.url, new.value)
        handle.set_state(new)
        if ok:
            await handle.refresh_load()

    async def aclose(self) -> None:
        for sub in self._subscribers:
            sub.close()
        self._subscribers.clear()
        for handle in self.workers:
            await handle.client.aclose()

    async def __aenter__(self) -> ExternalEngine:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


async def connect_external(
    urls: Sequence[str],
    kv_event_endpoints: Sequence[str] = (),
    *,
    model: str | None = None,
    on_kv_batch: KvBatchSink | None = None,
    on_kv_reset: KvResetSink | None = None,
    keepalive_s: float = UVICORN_KEEPALIVE_S,
    request_timeout_s: float = READ_TIMEOUT_S,
) -> ExternalEngine:
    """Handles on external servers, subscribed and health-checked once;
    `request_timeout_s`: how long a server may send nothing on a model request."""
    engine = ExternalEngine(
        urls,
        kv_event_endpoints,
        model=model,
        on_kv_batch=on_kv_batch,
        on_kv_reset=on_kv_reset,
        keepalive_s=keepalive_s,
        request_timeout_s=request_timeout_s,
    )
    try:
        return await engine.start()
    except BaseException:
        await engine.aclose()
        raise
