"""Serving simulated workers over HTTP: one worker's engine loop and server (`serve_worker`),
several on consecutive ports (`serve_workers`, `run_workers` for `appliance sim`), or one
in a background thread (`ThreadedWorker`, for tests and tools)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import uvicorn

from appliance import eventloop
from appliance.engines.retention.plugin import RetentionTuning
from appliance.sim.entrypoints.server import create_app, make_server
from appliance.sim.runtime.endpoints import free_port, offset_endpoint
from appliance.sim.runtime.worker import SimWorker, WorkerConfig

log = logging.getLogger(__name__)


async def serve_worker(
    worker: SimWorker, *, on_started: Callable[[uvicorn.Server], None] | None = None
) -> None:
    """Run one worker's engine loop and HTTP server until the server exits (a signal in
    the main thread, or `server.should_exit` set through `on_started`'s handle)."""
    await worker.start()
    server = make_server(create_app(worker), worker.config.host, worker.config.port)
    try:
        serving = asyncio.create_task(server.serve())
        while not server.started and not serving.done():
            await asyncio.sleep(0.01)
        if server.started:
            cfg = worker.config
            log.info(
                "simulated vLLM worker %r on http://%s:%d (KV events: %s)",
                cfg.served_model_name,
                cfg.host,
                cfg.port,
                worker.kv_events_endpoint or "off",
            )
            if on_started is not None:
                on_started(server)
        await serving
    finally:
        server.should_exit = True
        await worker.stop()


class ThreadedWorker:
    """A worker serving HTTP from its own event loop in a background thread (tests, tools).
    Port 0 picks a free port. `retention`: its retention connector's settings."""

    def __init__(self, config: WorkerConfig, *, retention: RetentionTuning | None = None) -> None:
        if config.port == 0:
            config = replace(config, port=free_port(config.host))
        self.worker = SimWorker(config, retention=retention)
        self.base_url = f"http://{config.host}:{config.port}"
        self._server: uvicorn.Server | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._started = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="sim-worker", daemon=True)

    def _run(self) -> None:
        def on_started(server: uvicorn.Server) -> None:
            self._server = server
            self._loop = asyncio.get_running_loop()
            self._started.set()

        try:
            eventloop.run(serve_worker(self.worker, on_started=on_started))
        except BaseException as exc:  # reported by start()
            self._error = exc
        finally:
            self._started.set()

    def start(self, timeout_s: float = 30.0) -> ThreadedWorker:
        self._thread.start()
        if not self._started.wait(timeout_s) or self._server is None:
            raise RuntimeError(f"simulated worker did not start: {self._error!r}")
        return self

    def stop(self) -> None:
        if self._loop is not None and self._server is not None:
            server = self._server
            self._loop.call_soon_threadsafe(setattr, server, "should_exit", True)
        self._thread.join(timeout=10)

    def __enter__(self) -> ThreadedWorker:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


async def serve_workers(
    n: int, base_port: int, *, retention_endpoint: str | None = None, **config: Any
) -> None:
    """Run n workers in this event loop: worker i on base_port + i, its KV events on the
    configured endpoint's port + i, its retention control channel (if any) on
    `retention_endpoint`'s port + i. Each is a separate server (engine label "0", DP rank
    0), as n separate `vllm serve` processes are."""
    base = WorkerConfig(**config)
    workers = [
        SimWorker(
            replace(
                base,
                port=base_port + i,
                kv_events_endpoint=offset_endpoint(base.kv_events_endpoint, i),
                kv_events_replay_endpoint=offset_endpoint(base.kv_events_replay_endpoint, i),
            ),
            retention=RetentionTuning(offset_endpoint(retention_endpoint, i)),  # None: none
        )
        for i in range(n)
    ]
    await asyncio.gather(*(serve_worker(w) for w in workers))


def run_workers(n: int, base_port: int, **config: Any) -> None:
    """Blocking entry point for `appliance sim`: serve until interrupted."""
    with contextlib.suppress(KeyboardInterrupt):
        eventloop.run(serve_workers(n, base_port, **config))
