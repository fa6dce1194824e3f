"""The appliance's HTTP/1.1 server: a lean ASGI server for its own API on one port.

Why not uvicorn: with the same app, uvicorn's request handling cost about 0.6 ms of the
event loop per request more than a protocol that parses with httptools and hands the app the
whole body (benchmarks/router_overhead.py, `http-relay` path), and that time is latency
added to every agent turn. This server does only what the API needs: HTTP/1.1 with
keep-alive (requests on one connection are answered in order, one at a time), Content-Length
and chunked request bodies (the app gets the body whole, at most `max_body` bytes, else 413,
at once when the declared length is larger; a head of at most 64 KiB and 100 headers, else
431), `Expect: 100-continue`, answers framed by Content-Length, or chunked when the app
streams (`http_answer.py`); once the client has hung up, sending raises OSError (ASGI 2.4),
which ends a streaming answer and so closes its worker request, and the scope's
`extensions.appliance.gone` is done (a model turn ends then: `app.py`). A connection idle
for `idle_s` is closed; a request whose head and body have not all arrived within
`request_s` of its first byte gets 408. A client that sends request after request without
reading the answers is read no further while `MAX_QUEUED` of them wait. Every refusal is the
API's error JSON. `stop()` refuses new connections, closes idle ones and gives requests in
flight `grace_s` to finish.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any, cast

import httptools

from appliance.api.http_server.heap_trim import HeapTrim
from appliance.api.http_server.http_answer import AnswerWriter, refusal_bytes
from appliance.api.http_server.http_request import HttpRequest

log = logging.getLogger(__name__)

App = Callable[[dict[str, Any], Any, Any], Awaitable[None]]
MAX_HEAD_BYTES = 64 * 1024
"""The request line and headers together, at most (read before the API key is checked)."""
MAX_HEADERS = 100
HEAD_TOO_LARGE = "request head too large (64 KiB and 100 headers at most)"
MAX_QUEUED = 8
"""Requests of one connection read and waiting for their answer, at most (pipelining)."""


class _ServerConnection(asyncio.Protocol):
    def __init__(self, server: ApiServer) -> None:
        self._server = server
        self._parser: httptools.HttpRequestParser | None = httptools.HttpRequestParser(self)
        self._transport: asyncio.Transport | None = None
        self._url = b""
        self._request = HttpRequest()
        self._body_size = 0
        self._queue: deque[HttpRequest] = deque()
        self._task: asyncio.Task[None] | None = None
        self._writable: asyncio.Future[None] | None = None
        self.closed = asyncio.get_running_loop().create_future()
        self.disconnected = False
        self._idle_handle: asyncio.TimerHandle | None = None
        self._request_handle: asyncio.TimerHandle | None = None
        self._head_size = 0
        """Bytes of the head arriving, counted from the data after the data it began in."""
        self._fields_size = 0
        """Bytes of its headers' names and values, counted as the parser finds them."""
        self._in_head = False
        self._began = False
        self._queued_bytes = 0
        self._reading = True

    @property
    def idle(self) -> bool:
        return self._task is None and not self._queue

    # --- asyncio.Protocol ---

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's is no subclass
        self._server.connections.add(self)
        self._idle_timer()

    def data_received(self, data: bytes) -> None:
        parser = self._parser
        if self._transport is None or parser is None:  # refused and closing
            return
        self._idle_timer()
        self._began = False
        try:
            parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self.reject(400, "upgrade_not_supported", "upgrades are not supported")
        except httptools.HttpParserError as exc:
            self.reject(400, "malformed_request", f"malformed request: {exc}")
        # A head still arriving that began before this data holds all of it (one that began
        # in it may share it with the request before, and is measured when it is whole).
        if self._in_head and not self._began and self._transport is not None:
            self._head_size += len(data)
            if self._head_size > MAX_HEAD_BYTES:
                self.reject(431, "head_too_large", HEAD_TOO_LARGE)

    def connection_lost(self, exc: Exception | None) -> None:
        self.disconnected = True
        self._transport = None
        self._server.connections.discard(self)
        if self._idle_handle is not None:
            self._idle_handle.cancel()
        if self._request_handle is not None:
            self._request_handle.cancel()
        # The parser and the timers hold this connection's bound methods: without those
        # cycles a closed connection, and a request it was reading (a body of up to
        # `max_body`), is freed now rather than when the collector next walks its oldest
        # generation, which on a quiet appliance can be minutes away.
        self._parser = self._idle_handle = self._request_handle = None
        self._queue.clear()
        if self._writable is not None and not self._writable.done():
            self._writable.set_result(None)
        if not self.closed.done():
            self.closed.set_result(None)

    def pause_writing(self) -> None:
        self._writable = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if self._writable is not None and not self._writable.done():
            self._writable.set_result(None)
        self._writable = None

    # --- httptools callbacks ---

    def on_message_begin(self) -> None:
        self._url = b""
        self._request = HttpRequest()
        self._body_size = 0
        self._head_size = 0
        self._fields_size = 0
        self._in_head = True
        self._began = True
        loop = asyncio.get_running_loop()
        self._request_handle = loop.call_later(self._server.request_s, self._request_too_slow)

    def _request_too_slow(self) -> None:
        if self._transport is not None:
            self.reject(408, "request_timeout", "the request did not arrive in time")

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        if len(self._request.headers) >= MAX_HEADERS:
            if self._transport is not None:
                self.reject(431, "head_too_large", HEAD_TOO_LARGE)
            return
        self._fields_size += len(name) + len(value)
        self._request.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        self._in_head = False
        if self._transport is None:
            return
        if len(self._url) + self._fields_size > MAX_HEAD_BYTES:
            self.reject(431, "head_too_large", HEAD_TOO_LARGE)
            return
        if self._request.declared_length() > self._server.max_body:
            self.reject(413, "body_too_large", "request body too large")
            return
        request = self._request
        assert self._parser is not None  # called back by it
        request.read_head(self._parser, self._url)
        if (b"expect", b"100-continue") in request.headers and self._transport is not None:
            self._transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes) -> None:
        self._body_size += len(body)
        if self._body_size > self._server.max_body:
            if self._transport is not None:
                self.reject(413, "body_too_large", "request body too large")
            return
        self._request.body.append(body)

    def on_message_complete(self) -> None:
        if self._request_handle is not None:
            self._request_handle.cancel()
            self._request_handle = None
        if self._transport is None:  # refused (too large): never served
            return
        self._request.received_at = time.monotonic()
        self._queue.append(self._request)
        self._queued_bytes += self._body_size
        self._flow()
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._serve())

    # --- serving, one request at a time ---

    async def _serve(self) -> None:
        try:
            while self._queue and not self.disconnected:
                request = self._queue.popleft()
                self._queued_bytes -= sum(map(len, request.body))
                self._flow()
                keep = await self._answer(request)
                if not keep:
                    self.close()
                    return
        finally:
            self._task = None
            self._idle_timer()
            self._server.request_done()

    def _flow(self) -> None:
        """Reads on while fewer than `MAX_QUEUED` requests, with at most `max_body` bytes of
        bodies, wait for their answers: a client that sends without reading the answers
        stops being read, rather than have the appliance keep all it sent."""
        full = len(self._queue) >= MAX_QUEUED or self._queued_bytes > self._server.max_body
        if full == self._reading and self._transport is not None:
            self._reading = not full
            if full:
                self._transport.pause_reading()
            else:
                self._transport.resume_reading()

    def _idle_timer(self) -> None:
        """Closes the connection after `idle_s` without a request; reset by any data."""
        if self._idle_handle is not None:
            self._idle_handle.cancel()
            self._idle_handle = None
        if self.idle and self._transport is not None:
            loop = asyncio.get_running_loop()
            self._idle_handle = loop.call_later(self._server.idle_s, self._close_if_idle)

    def _close_if_idle(self) -> None:
        if self.idle:
            self.close()

    async def _answer(self, request: HttpRequest) -> bool:
        """Runs the app for one request; whether the connection may serve another."""
        scope = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.4"},
            "http_version": request.http_version,
            "server": self._server.bound,
            "client": None,
            "scheme": "http",
            "method": request.method,
            "root_path": "",
            "path": request.path,
            "raw_path": request.raw_path,
            "query_string": request.query,
            "headers": request.headers,
            # When the whole request had arrived (time.monotonic()): the app's own time starts.
            "extensions": {"appliance": {"received_at": request.received_at, "gone": self.closed}},
        }
        body = b"".join(request.body)
        request.body.clear()  # the connection keeps its last request until the next begins
        sent_body = False
        response = AnswerWriter(self, request.method == "HEAD")

        async def receive() -> dict[str, Any]:
            nonlocal sent_body
            if not sent_body:
                sent_body = True
                return {"type": "http.request", "body": body, "more_body": False}
            await self.closed
            return {"type": "http.disconnect"}

        try:
            await self._server.app(scope, receive, response.send)
        except Exception:
            if self.disconnected:
                return False
            log.exception("the app failed on %s %s", request.method, request.path)
            if not response.started:
                response.error()
            return False
        finally:
            self._server.heap.after(len(body))
        if not response.finished:
            if not response.started:
                response.error()
            return False
        return request.keep_alive and not self.disconnected and not self._server.stopping

    def write(self, data: bytes) -> None:
        if self._transport is not None:
            self._transport.write(data)

    async def drain(self) -> None:
        if self._writable is not None:
            await self._writable

    def reject(self, status: int, code: str, message: str) -> None:
        """The error JSON; the connection then closes."""
        self.write(refusal_bytes(status, code, message))
        self.close()
        self._server.heap.after(self._body_size)

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()
            self._transport = None


class ApiServer:
    """Serves `app` on `host:port` until `stop()`."""

    def __init__(
        self,
        app: App,
        host: str,
        port: int,
        *,
        max_body: int = 64 * 2**20,
        grace_s: float = 30.0,
        idle_s: float = 75.0,
        request_s: float = 30.0,
    ) -> None:
        self.app = app
        self.idle_s = idle_s
        self.request_s = request_s
        self.host = host
        self.port = port
        self.max_body = max_body
        self.grace_s = grace_s
        self.connections: set[_ServerConnection] = set()
        self.heap = HeapTrim()
        """Gives memory back to the OS after a large body (`heap_trim.py`)."""
        self.stopping = False
        self.bound: tuple[str, int] | None = None
        self._server: asyncio.AbstractServer | None = None
        self._done = asyncio.Event()

    async def start(self) -> None:
        if self._server is not None:
            return  # started already (the daemon binds before its workers are up)
        self._server = await asyncio.get_running_loop().create_server(
            lambda: _ServerConnection(self), self.host, self.port, reuse_address=True, backlog=2048
        )
        self.bound = cast(tuple[str, int], self._server.sockets[0].getsockname()[:2])

    async def serve(self) -> None:
        """Serves until cancelled, then stops gracefully."""
        await self.start()
        try:
            await asyncio.get_running_loop().create_future()  # until cancelled
        finally:
            await asyncio.shield(self.stop())

    @property
    def started(self) -> bool:
        return self.bound is not None

    def request_done(self) -> None:
        self._done.set()

    async def stop(self) -> None:
        self.stopping = True
        if self._server is not None:
            self._server.close()
        deadline = asyncio.get_running_loop().time() + self.grace_s
        while True:
            for conn in list(self.connections):
                if conn.idle:
                    conn.close()
            busy = [c for c in self.connections if not c.idle]
            left = deadline - asyncio.get_running_loop().time()
            if not busy or left <= 0:
                break
            self._done.clear()
            try:
                await asyncio.wait_for(self._done.wait(), left)
            except TimeoutError:
                break
        for conn in list(self.connections):
            conn.close()
