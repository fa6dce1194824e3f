"""The hot path's HTTP/1.1 client against real sockets on 127.0.0.1: a small raw server
whose behaviour each test chooses (framing, closing idle connections, stalling)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from appliance.engines.clients.http1 import HIGH_WATER, Http1Error, Http1Pool
from appliance.eventloop import run

Handler = Callable[[bytes, asyncio.StreamReader, asyncio.StreamWriter], Awaitable[bool]]
"""Gets the request head and answers; returns whether to keep the connection open."""


async def read_request(reader: asyncio.StreamReader) -> bytes | None:
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, ConnectionError):
        return None
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    body = await reader.readexactly(length) if length else b""
    return head + body


class Server:
    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.requests: list[bytes] = []
        self.writers: list[asyncio.StreamWriter] = []

    async def __aenter__(self) -> Server:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        for w in self.writers:
            w.close()
        self.server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.writers.append(writer)
        while (request := await read_request(reader)) is not None:
            self.requests.append(request)
            if not await self.handler(request, reader, writer):
                break
        writer.close()


def fixed(body: bytes, status: int = 200) -> Handler:
    async def handle(request: bytes, reader: asyncio.StreamReader, w: asyncio.StreamWriter) -> bool:
        w.write(b"HTTP/1.1 %d X\r\nContent-Length: %d\r\n\r\n%s" % (status, len(body), body))
        await w.drain()
        return True

    return handle


def pool(port: int, **kw: float) -> Http1Pool:
    opts = {"connect_timeout_s": 2.0, "read_timeout_s": 5.0, "keepalive_s": 10.0, **kw}
    return Http1Pool("127.0.0.1", port, **opts)


def test_reads_the_answer_and_reuses_the_connection() -> None:
    async def main() -> None:
        async with Server(fixed(b'{"ok": 1}')) as srv:
            p = pool(srv.port)
            for i in range(3):
                r = await p.request("POST", "/v1/x", b"body%d" % i, (("X-A", "b"),))
                assert (r.status, await r.read()) == (200, b'{"ok": 1}')
            assert srv.connections == 1
            assert srv.requests[2].endswith(b"body2")
            assert b"\r\nX-A: b\r\n" in srv.requests[0]
            assert b"\r\nContent-Length: 5\r\n" in srv.requests[0]
            p.close()

    run(main())


def test_chunked_answer_arrives_piece_by_piece_without_framing() -> None:
    release = asyncio.Event()

    async def handle(request: bytes, reader: asyncio.StreamReader, w: asyncio.StreamWriter) -> bool:
        w.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        w.write(b"6\r\ndata: \r\n")
        await w.drain()
        await release.wait()  # the client must see the first piece before the rest exists
        w.write(b"3\r\nab\n\r\n0\r\n\r\n")
        await w.drain()
        return True

    async def main() -> None:
        async with Server(handle) as srv:
            p = pool(srv.port)
            r = await p.request("POST", "/s", b"{}")
            pieces = r.chunks()
            assert await pieces.__anext__() == b"data: "
            release.set()
            assert b"".join([x async for x in pieces]) == b"ab\n"
            assert r.at_eof
            r2 = await p.request("POST", "/s", b"{}")  # reused after a clean end
            assert srv.connections == 1
            r2.close()

    run(main())


def test_an_idle_connection_the_server_closed_is_replaced_without_an_error() -> None:
    async def close_after_answer(
        request: bytes, r: asyncio.StreamReader, w: asyncio.StreamWriter
    ) -> bool:
        await fixed(b"x")(request, r, w)
        return False  # the server ends every connection after one answer, as keep-alive ends

    async def main() -> None:
        async with Server(close_after_answer) as srv:
            p = pool(srv.port)
            for _ in range(3):
                r = await p.request("POST", "/", b"")
                assert await r.read() == b"x"
                await asyncio.sleep(0.05)  # the server's close reaches the idle connection
            assert srv.connections == 3
            assert len(srv.requests) == 3  # never sent twice

    run(main())


def test_leaving_an_answer_early_closes_its_connection() -> None:
    async def endless(
        request: bytes, reader: asyncio.StreamReader, w: asyncio.StreamWriter
    ) -> bool:
        w.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n1\r\na\r\n")
        await w.drain()
        closed = await reader.read(1)  # b"" once the client hangs up
        assert closed == b""
        return False

    async def main() -> None:
        async with Server(endless) as srv:
            p = pool(srv.port)
            r = await p.request("POST", "/", b"")
            assert await r.chunks().__anext__() == b"a"
            r.release()  # not at its end: closed, not pooled
            r2 = await p.request("POST", "/", b"")
            assert srv.connections == 2
            r2.close()

    run(main())


def test_failures_raise_http1_error() -> None:
    async def stall(request: bytes, reader: asyncio.StreamReader, w: asyncio.StreamWriter) -> bool:
        await asyncio.sleep(5)
        return False

    async def garbage(
        request: bytes, reader: asyncio.StreamReader, w: asyncio.StreamWriter
    ) -> bool:
        w.write(b"NOT HTTP AT ALL\r\n\r\n")
        await w.drain()
        return True

    async def broken(request: bytes, reader: asyncio.StreamReader, w: asyncio.StreamWriter) -> bool:
        w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly part")
        await w.drain()
        return False

    async def main() -> None:
        async with Server(stall) as srv:
            with pytest.raises(Http1Error, match=r"no answer within 0\.2 s"):
                await pool(srv.port, read_timeout_s=0.2).request("POST", "/", b"")
        async with Server(garbage) as srv:
            with pytest.raises(Http1Error, match="malformed"):
                await pool(srv.port).request("POST", "/", b"")
        async with Server(broken) as srv:
            r = await pool(srv.port).request("POST", "/", b"")
            with pytest.raises(Http1Error, match="closed"):
                await r.read()
        async with Server(fixed(b"")) as srv:
            port = srv.port
        with pytest.raises(Http1Error, match="cannot connect"):
            await pool(port).request("POST", "/", b"")

    run(main())


def test_a_slow_reader_pauses_the_socket_and_loses_nothing() -> None:
    size = 3 * HIGH_WATER + 123

    async def big(request: bytes, reader: asyncio.StreamReader, w: asyncio.StreamWriter) -> bool:
        w.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % size)
        for i in range(size // 65536 + 1):
            w.write(bytes([i % 251]) * min(65536, size - i * 65536))
            await w.drain()
        return True

    async def main() -> None:
        async with Server(big) as srv:
            r = await pool(srv.port).request("GET", "/", b"")
            await asyncio.sleep(0.3)  # everything the socket takes arrives unread
            data = await r.read()
            assert len(data) == size
            assert data[65536 * 5] == 5 % 251

    run(main())


def test_a_connection_idle_longer_than_the_servers_keepalive_is_not_reused() -> None:
    async def main() -> None:
        async with Server(fixed(b"x")) as srv:
            p = pool(srv.port, keepalive_s=0.2)
            assert await (await p.request("GET", "/", b"")).read() == b"x"
            assert await (await p.request("GET", "/", b"")).read() == b"x"  # at once: reused
            assert srv.connections == 1
            await asyncio.sleep(0.3)  # the server may be closing it now
            assert await (await p.request("GET", "/", b"")).read() == b"x"
            assert srv.connections == 2

    run(main())


def test_the_read_timeout_counts_from_the_last_thing_that_arrived() -> None:
    async def trickle(
        request: bytes, reader: asyncio.StreamReader, w: asyncio.StreamWriter
    ) -> bool:
        w.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        for piece in (b"a", b"b", b"c", b"d"):  # 0.4 s in all, a piece every 0.1 s
            await asyncio.sleep(0.1)
            w.write(b"1\r\n%s\r\n" % piece)
            await w.drain()
        await asyncio.sleep(1.0)  # then nothing
        return False

    async def main() -> None:
        async with Server(trickle) as srv:
            response = await pool(srv.port, read_timeout_s=0.25).request("POST", "/", b"")
            seen = b""
            with pytest.raises(Http1Error, match=r"no answer within 0\.25 s"):
                async for piece in response.chunks():
                    seen += piece
            assert seen == b"abcd"

    run(main())
