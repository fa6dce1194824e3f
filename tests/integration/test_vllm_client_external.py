"""External engines: handles on servers the appliance did not start, no supervisor.

A scripted HTTP server stands in for the vLLM server and the simulator's publisher (byte
for byte vLLM's) for its KV events; against real vLLM see test_supervisor_vllm.py.
"""

from __future__ import annotations

import asyncio
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from appliance.domain import kv_events as ev
from appliance.domain.errors import ConfigError
from appliance.domain.worker import WorkerState
from appliance.engines.clients.workers import KvIndexFeed
from appliance.engines.external import connect_external
from appliance.sim.kv.kv_publisher import KvEventPublisher
from tests.ports import free_port

METRICS = (Path(__file__).parents[1] / "unit" / "data" / "vllm_metrics.txt").read_bytes()


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        body = METRICS if self.path == "/metrics" else b""
        self.send_response(200 if self.path in ("/health", "/metrics") else 404)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture
def server_url():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()
    server.server_close()


STORED = ev.BlockStored(
    block_hashes=(11, 12), parent_block_hash=None, token_ids=tuple(range(64)), block_size=32
)


def test_external_servers_are_health_checked_and_feed_the_index(server_url: str) -> None:
    dead_url = f"http://127.0.0.1:{free_port()}"
    endpoint = f"tcp://127.0.0.1:{free_port()}"  # the server connects: the appliance binds
    feed = KvIndexFeed()

    async def go() -> None:
        engine = await connect_external(
            [server_url, dead_url],
            [endpoint, f"tcp://127.0.0.1:{free_port()}"],
            model="tiny",
            on_kv_batch=feed.on_batch,
            on_kv_reset=feed.on_reset,
        )
        try:
            w0, w1 = engine.workers
            assert (w0.id, w0.engine, w0.url) == ("w0", "external", server_url.rstrip("/"))
            assert w0.state == WorkerState.HEALTHY and w0.accepts_requests
            assert w0.load is not None and w0.load.prefix_cache_hits_tokens == 2336
            assert w1.state == WorkerState.UNHEALTHY and not w1.accepts_requests
            assert w0.status().restarts == 0 and w0.status().healthy

            publisher = KvEventPublisher(endpoint)
            try:
                deadline = time.monotonic() + 10
                while not feed.lookup((11, 12)) and time.monotonic() < deadline:
                    publisher.publish([STORED])  # ZMQ slow joiner: resend until seen
                    await asyncio.sleep(0.05)
            finally:
                publisher.close()
            assert feed.lookup((11, 12)) == {"w0": 2}
        finally:
            await engine.aclose()

    asyncio.run(go())


def test_endpoint_count_must_match_urls() -> None:
    with pytest.raises(ConfigError, match="one entry per"):
        asyncio.run(connect_external(["http://a", "http://b"], ["tcp://127.0.0.1:1"]))


def test_without_kv_endpoints_nothing_is_subscribed(server_url: str) -> None:
    async def go() -> None:
        async with await connect_external([server_url], on_kv_batch=lambda w, b: None) as eng:
            assert eng.workers[0].kv_events_endpoint is None
            assert eng.workers[0].healthy

    asyncio.run(go())


def test_factory_from_settings(server_url: str) -> None:
    from appliance.config.settings import EngineSettings
    from appliance.engines.factory import start_external

    settings = EngineSettings(kind="external", model="org/tiny", external_urls=[server_url])

    async def go() -> None:
        engine = await start_external(settings)
        try:
            assert engine.workers[0].healthy
            assert engine.workers[0].client.model == "tiny"
        finally:
            await engine.aclose()

    asyncio.run(go())
