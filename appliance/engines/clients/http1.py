"""A lean HTTP/1.1 client for the router's hot path: kept-alive connections to one worker.

Why not aiohttp here: a model request through aiohttp cost about 0.4 ms more of the event
loop's time than the same bytes through this module (measured with
benchmarks/router_overhead.py on this kind of machine), and that time is latency added to
every turn. This client does only what the router needs of a worker: send one request with
a body, read the status line and headers, then the body whole or as it arrives (the parser,
httptools, undoes chunked framing), and reuse the connection when the answer ended cleanly.
Probes (/health, /metrics) stay on aiohttp.

Failure model: a connection the server closed while it sat idle fails before any byte of
the answer, and is retried once on a new connection (the server never read the request).
Any other failure raises `Http1Error`; the caller maps it to EngineUnavailable. Leaving an
answer before its end closes the connection, which is how vLLM learns to abort a request.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator, Sequence
from typing import cast

import httptools

HIGH_WATER = 1 << 20
"""Bytes of unread body after which reading from the socket pauses."""


class Http1Error(ConnectionError):
    """No (complete) answer: refused, reset, timed out or malformed."""


class Http1Timeout(Http1Error):
    """The server sent nothing for `read_timeout_s` while an answer was awaited."""


class _Connection(asyncio.Protocol):
    def __init__(self, loop: asyncio.AbstractEventLoop, read_timeout_s: float) -> None:
        self._loop = loop
        self._read_timeout_s = read_timeout_s
        self._parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.idle_since = 0.0
        self._waiting_since = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self.begin()

    def begin(self) -> None:
        """Ready for the next answer on this connection."""
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.head_done = False
        self.complete = False
        self.keep_alive = False
        self.received = False
        self.error: BaseException | None = None
        self._body: deque[bytes] = deque()
        self._buffered = 0
        self._waiter: asyncio.Future[None] | None = None

    # --- asyncio.Protocol ---

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is no subclass

    def data_received(self, data: bytes) -> None:
        self.received = True
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(Http1Error(f"malformed answer: {exc}"))
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        if not self.complete:
            self._fail(Http1Error(str(exc) if exc else "the server closed the connection"))

    # --- httptools callbacks ---

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        self.status = self._parser.get_status_code()
        self.head_done = True
        self._wake()

    def on_body(self, body: bytes) -> None:
        self._body.append(body)
        self._buffered += len(body)
        if self._buffered > HIGH_WATER and self.transport is not None:
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        self.complete = True
        self.keep_alive = self._parser.should_keep_alive()
        self._wake()

    # --- used by Http1Response and the pool ---

    def send(self, head: bytes, body: bytes) -> None:
        assert self.transport is not None
        self.transport.writelines((head, body) if body else (head,))

    async def wait(self) -> None:
        """Until something new arrived (head, body, end) or the connection failed; fails
        after `read_timeout_s` without anything."""
        if self.error is not None:
            raise self.error
        self._waiting_since = self._loop.time()
        if self._timer is None:  # one timer for many waits: a stream waits once per chunk
            deadline = self._waiting_since + self._read_timeout_s
            self._timer = self._loop.call_at(deadline, self._check_timeout)
        waiter = self._waiter = self._loop.create_future()
        try:
            await waiter
        finally:
            self._waiter = None
        if self.error is not None:
            raise self.error

    def _check_timeout(self) -> None:
        """The read timeout of the wait in progress, if any, from when it began."""
        self._timer = None
        if self._waiter is None or self._waiter.done():
            return  # nobody waits: the next wait sets a timer again
        deadline = self._waiting_since + self._read_timeout_s
        if self._loop.time() >= deadline:
            self._timed_out()
        else:
            self._timer = self._loop.call_at(deadline, self._check_timeout)

    def take(self) -> bytes:
        data = b"".join(self._body) if len(self._body) != 1 else self._body[0]
        self._body.clear()
        if self._buffered > HIGH_WATER and self.transport is not None:
            self.transport.resume_reading()
        self._buffered = 0
        return data

    @property
    def has_body(self) -> bool:
        return bool(self._body)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self.transport is not None:
            self.transport.abort()
            self.transport = None

    def _timed_out(self) -> None:
        self._fail(Http1Timeout(f"no answer within {self._read_timeout_s:g} s"))
        self.close()

    def _fail(self, exc: BaseException) -> None:
        if self.error is None:
            self.error = exc
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)


class Http1Response:
    """One answer: `status` and `headers` (names lower-case) are there; then the body."""

    def __init__(self, pool: Http1Pool, conn: _Connection) -> None:
        self._pool = pool
        self._conn = conn
        self.status = conn.status
        self.headers = conn.headers
        self._done = False

    async def read(self) -> bytes:
        parts = [data async for data in self.chunks()]
        return b"".join(parts)

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body in the pieces the socket delivered (chunked framing removed)."""
        conn = self._conn
        while True:
            if conn.has_body:
                yield conn.take()
                continue
            if conn.complete:
                self.release()
                return
            await conn.wait()

    @property
    def at_eof(self) -> bool:
        return self._conn.complete and not self._conn.has_body

    def release(self) -> None:
        """Back to the pool when the answer was read to its end, else closed."""
        if self._done:
            return
        self._done = True
        if self.at_eof and self._conn.keep_alive and self._conn.transport is not None:
            self._pool.put_back(self._conn)
        else:
            self._conn.close()

    def close(self) -> None:
        self._done = True
        self._conn.close()


class Http1Pool:
    """Kept-alive connections to one `host:port`. Use from one event loop only."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        connect_timeout_s: float,
        read_timeout_s: float,
        keepalive_s: float,
        max_idle: int = 64,
    ) -> None:
        self.host = host
        self.port = port
        self._connect_timeout_s = connect_timeout_s
        self._read_timeout_s = read_timeout_s
        self._keepalive_s = keepalive_s
        self._max_idle = max_idle
        self._idle: deque[_Connection] = deque()
        self._host_header = f"Host: {host}:{port}\r\n".encode()

    async def request(
        self,
        method: str,
        path: str,
        body: bytes = b"",
        headers: Sequence[tuple[str, str]] = (),
    ) -> Http1Response:
        """Sends the request and waits for the status line and headers."""
        lines = [f"{method} {path} HTTP/1.1\r\n".encode(), self._host_header]
        lines += [f"{k}: {v}\r\n".encode("latin-1") for k, v in headers]
        lines.append(f"Content-Length: {len(body)}\r\n\r\n".encode())
        head = b"".join(lines)
        conn = self._take_idle()
        if conn is not None:
            try:
                return await self._exchange(conn, head, body)
            except Http1Error as exc:
                if conn.received or isinstance(exc, Http1Timeout):
                    raise  # a server that sent nothing in time may be working on it
                # The server had closed this idle connection: it never read the request.
        conn = await self._connect()
        return await self._exchange(conn, head, body)

    async def _exchange(self, conn: _Connection, head: bytes, body: bytes) -> Http1Response:
        conn.begin()
        try:
            conn.send(head, body)
            while not conn.head_done:
                await conn.wait()
        except BaseException:
            conn.close()
            raise
        return Http1Response(self, conn)

    async def _connect(self) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(
                    lambda: _Connection(loop, self._read_timeout_s), self.host, self.port
                ),
                self._connect_timeout_s,
            )
        except OSError as exc:  # TimeoutError included
            raise Http1Error(f"cannot connect: {exc or type(exc).__name__}") from None
        return conn

    def _take_idle(self) -> _Connection | None:
        now = time.monotonic()
        while self._idle:
            conn = self._idle.pop()  # the most recently used: least likely to be closed
            if conn.transport is not None and now - conn.idle_since < self._keepalive_s:
                return conn
            conn.close()
        return None

    def put_back(self, conn: _Connection) -> None:
        conn.idle_since = time.monotonic()
        self._idle.append(conn)
        while len(self._idle) > self._max_idle:
            self._idle.popleft().close()

    def close(self) -> None:
        while self._idle:
            self._idle.pop().close()
