"""The appliance's HTTP/1.1 server with a small Starlette app, over real sockets on
127.0.0.1: httpx for what clients do, a raw socket for what they sometimes do."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import time
import tracemalloc
import weakref
from collections.abc import AsyncIterator, Iterator

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from appliance.api.http_server.server import MAX_QUEUED, ApiServer, _ServerConnection
from appliance.eventloop import run


class Probe:
    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.stream_closed = asyncio.Event()
        self.slow_started = asyncio.Event()


def app(probe: Probe) -> Starlette:
    async def echo(request: Request) -> Response:
        body = await request.body()
        return JSONResponse(
            {
                "n": len(body),
                "path": request.url.path,
                "q": request.url.query,
                "head": body[:10].decode(),
            }
        )

    async def stream(request: Request) -> Response:
        async def pieces() -> AsyncIterator[bytes]:
            try:
                yield b"data: one\n\n"
                await probe.release.wait()
                for _ in range(500):  # 5 s unless a hang-up ends it
                    yield b"data: more\n\n"
                    await asyncio.sleep(0.01)
            finally:
                probe.stream_closed.set()

        return StreamingResponse(pieces(), media_type="text/event-stream")

    async def slow(request: Request) -> Response:
        probe.slow_started.set()
        await asyncio.sleep(0.3)
        return JSONResponse({"slow": True})

    async def item(request: Request) -> Response:
        return JSONResponse({"name": request.path_params["name"]})

    async def boom(request: Request) -> Response:
        raise RuntimeError("bug")

    routes = [
        Route("/echo", echo, methods=["POST", "GET"]),
        Route("/stream", stream),
        Route("/slow", slow),
        Route("/boom", boom),
        Route("/items/{name}", item),
    ]
    return Starlette(routes=routes)


async def serving(probe: Probe, **kw: float) -> ApiServer:
    server = ApiServer(app(probe), "127.0.0.1", 0, **kw)  # type: ignore[arg-type]
    await server.start()
    return server


def url(server: ApiServer, path: str) -> str:
    assert server.bound is not None
    return f"http://127.0.0.1:{server.bound[1]}{path}"


async def raw(server: ApiServer, data: bytes) -> bytes:
    assert server.bound is not None
    reader, writer = await asyncio.open_connection("127.0.0.1", server.bound[1])
    writer.write(data)
    out = await asyncio.wait_for(reader.read(), 5)
    writer.close()
    return out


def test_requests_on_one_kept_alive_connection_with_whole_and_chunked_bodies() -> None:
    async def main() -> None:
        server = await serving(Probe())
        async with httpx.AsyncClient() as client:
            r = await client.post(url(server, "/echo?x=1"), content=b"a" * 100_000)
            assert r.json() == {"n": 100_000, "path": "/echo", "q": "x=1", "head": "a" * 10}

            async def chunks() -> AsyncIterator[bytes]:
                for piece in (b"hello ", b"chunked ", b"world"):
                    yield piece

            r = await client.post(url(server, "/echo"), content=chunks())
            assert r.json()["n"] == len(b"hello chunked world")
            assert (await client.get(url(server, "/nowhere"))).status_code == 404
            assert (await client.get(url(server, "/items/a%20b"))).json() == {"name": "a b"}
        assert len(server.connections) == 0 or all(c.idle for c in server.connections)
        await server.stop()

    run(main())


def test_a_streamed_answer_arrives_as_it_is_made_and_a_hang_up_ends_it() -> None:
    async def main() -> None:
        probe = Probe()
        server = await serving(probe)
        async with httpx.AsyncClient() as client, client.stream("GET", url(server, "/stream")) as r:
            assert r.headers["transfer-encoding"] == "chunked"
            pieces = r.aiter_raw()
            assert await pieces.__anext__() == b"data: one\n\n"  # before the rest exists
        # The client hung up mid-stream: the next send fails and the stream is closed.
        probe.release.set()
        await asyncio.wait_for(probe.stream_closed.wait(), 1)
        await server.stop()

    run(main())


def test_pipelined_requests_are_answered_in_order_and_expect_continue_is_honoured() -> None:
    async def main() -> None:
        server = await serving(Probe())
        one = b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc"
        two = b"GET /echo HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        out = await raw(server, one + two)
        assert out.count(b"HTTP/1.1 200 OK") == 2
        assert out.index(b'"n":3') < out.index(b'"n":0')
        expect = b"POST /echo HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 2\r\n"
        expect += b"Connection: close\r\n\r\nhi"
        out = await raw(server, expect)
        assert out.startswith(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK")
        await server.stop()

    run(main())


def refusal(out: bytes, status: int, code: str) -> str:
    """The one answer on the connection: `status` with the API's error JSON; its message."""
    head, _, body = out.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 %d " % status) and out.count(b"HTTP/1.1 ") == 1, out
    assert b"content-type: application/json" in head and b"connection: close" in head, head
    error = json.loads(body)["error"]
    assert error["code"] == code and error["type"] and error["param"] is None, error
    return str(error["message"])


def test_bad_requests_get_a_clear_status_the_error_json_and_a_closed_connection() -> None:
    """The server's own refusals were plain text, where every other refusal is JSON."""

    async def main() -> None:
        server = await serving(Probe(), max_body=1000)
        out = await raw(server, b"NOT HTTP\r\n\r\n")
        assert "malformed request" in refusal(out, 400, "malformed_request")
        big = b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
        big += b"1388\r\n" + b"x" * 5000 + b"\r\n0\r\n\r\n"
        refusal(await raw(server, big), 413, "body_too_large")  # never served
        out = await raw(server, b"GET /boom HTTP/1.1\r\nHost: x\r\n\r\n")
        assert out.startswith(b"HTTP/1.1 500 ")  # Starlette's own answer, then closed
        await server.stop()

        async def broken(scope: object, receive: object, send: object) -> None:
            raise RuntimeError("bug")

        server = ApiServer(broken, "127.0.0.1", 0)
        await server.start()
        out = await raw(server, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        refusal(out, 500, "internal")  # the app failed before its answer began
        await server.stop()

    run(main())


def test_a_body_declared_past_the_limit_is_refused_before_it_is_sent() -> None:
    """A Content-Length past `max_body` used to be read up to the limit (or waited for until
    the request's deadline) before the 413; and `Expect: 100-continue` got its 100 first."""

    async def main() -> None:
        server = await serving(Probe(), max_body=1000)
        head = b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 5000\r\n"
        start = time.monotonic()
        refusal(await raw(server, head + b"\r\n"), 413, "body_too_large")
        out = await raw(server, head + b"Expect: 100-continue\r\n\r\n")
        refusal(out, 413, "body_too_large")  # no 100 Continue before it
        assert time.monotonic() - start < 1.0
        await server.stop()

    run(main())


def test_pipelined_requests_read_together_are_not_taken_for_a_large_head() -> None:
    """The head's size was counted as all the data read while a head was arriving, so a read
    of many small pipelined requests ending inside one's head was refused 431."""

    async def main() -> None:
        server = await serving(Probe())
        one = b"GET /echo HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"p" * 200 + b"\r\n\r\n"
        last = b"GET /echo HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        assert server.bound is not None
        reader, writer = await asyncio.open_connection("127.0.0.1", server.bound[1])
        writer.write(one * 400 + last[:20])  # about 100 KB, the last head cut short
        await writer.drain()
        await asyncio.sleep(0.1)
        writer.write(last[20:])
        out = await asyncio.wait_for(reader.read(), 5)
        writer.close()
        assert out.count(b"HTTP/1.1 200 OK") == 401 and b" 431 " not in out
        await server.stop()

    run(main())


class _Transport:
    """Stands in for the socket of one connection: what was written, and reading's state."""

    def __init__(self) -> None:
        self.out = bytearray()
        self.reading = True

    def write(self, data: bytes) -> None:
        self.out += data

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True

    def close(self) -> None:
        pass


def test_a_client_that_reads_no_answers_is_read_no_further_until_it_does() -> None:
    """Pipelined requests were all read and queued whatever their number: a client sending
    without reading held the appliance's memory without bound."""

    async def main() -> None:
        server = ApiServer(app(Probe()), "127.0.0.1", 0)  # type: ignore[arg-type]
        conn = _ServerConnection(server)
        transport = _Transport()
        conn.connection_made(transport)  # type: ignore[arg-type]
        conn.pause_writing()  # the client reads nothing: the socket's buffer is full
        request = b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\n\r\nx"
        conn.data_received(request * (MAX_QUEUED - 1))
        await asyncio.sleep(0.05)
        assert transport.reading
        conn.data_received(request * 2)
        await asyncio.sleep(0.05)
        assert not transport.reading  # MAX_QUEUED wait: it reads no more
        conn.resume_writing()  # the client reads again
        for _ in range(100):
            await asyncio.sleep(0.01)
            if transport.out.count(b"HTTP/1.1 200 OK") == MAX_QUEUED + 1:
                break
        assert transport.out.count(b"HTTP/1.1 200 OK") == MAX_QUEUED + 1
        assert transport.reading
        conn.connection_lost(None)

    run(main())


def test_a_closed_connection_is_freed_without_the_collector() -> None:
    """The parser and the timers held the connection's bound methods: a closed connection,
    with the body it was reading, waited for a full collection (often minutes away)."""

    async def main() -> None:
        server = await serving(Probe(), max_body=4 * 2**20)
        assert server.bound is not None
        _, writer = await asyncio.open_connection("127.0.0.1", server.bound[1])
        writer.write(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 4000000\r\n\r\n")
        writer.write(b"x" * 2_000_000)  # half of it, then the client goes
        await writer.drain()
        await asyncio.sleep(0.05)
        [conn] = server.connections
        gone = weakref.ref(conn)
        del conn
        writer.close()
        await asyncio.sleep(0.1)
        assert gone() is None
        await server.stop()

    gc.disable()
    try:
        run(main())
    finally:
        gc.enable()


def test_stop_lets_a_request_in_flight_finish_and_closes_idle_connections() -> None:
    async def main() -> None:
        probe = Probe()
        server = await serving(probe, idle_s=60)
        async with httpx.AsyncClient() as client:
            await client.post(url(server, "/echo"), content=b"x")  # leaves an idle connection
            async with httpx.AsyncClient() as other:
                slow = asyncio.create_task(other.get(url(server, "/slow")))
                await probe.slow_started.wait()
                await server.stop()
                assert (await slow).json() == {"slow": True}
        assert not server.connections
        try:
            await raw(server, b"GET /echo HTTP/1.1\r\n\r\n")
        except OSError:
            pass  # refused: the listener is closed
        else:
            raise AssertionError("a stopped server accepted a connection")

    run(main())


def test_an_idle_connection_is_closed_after_idle_s() -> None:
    async def main() -> None:
        server = await serving(Probe(), idle_s=0.2)
        assert server.bound is not None
        reader, writer = await asyncio.open_connection("127.0.0.1", server.bound[1])
        writer.write(b"GET /echo HTTP/1.1\r\nHost: x\r\n\r\n")
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(), 3)  # b"" at EOF: the server closed
        assert answer.startswith(b"HTTP/1.1 200 OK")
        writer.close()
        await server.stop()

    run(main())


async def answer_while_sending(server: ApiServer, chunks: Iterator[bytes], pause_s: float) -> bytes:
    """Sends `chunks` one by one until the server answers; the answer's head."""
    assert server.bound is not None
    reader, writer = await asyncio.open_connection("127.0.0.1", server.bound[1])
    try:
        for chunk in chunks:
            writer.write(chunk)
            with contextlib.suppress(asyncio.TimeoutError):
                return await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), pause_s)
        raise AssertionError("the server never answered")
    finally:
        writer.close()


def test_a_head_past_its_bounds_is_431_before_it_is_read_whole() -> None:
    """A 200 MB header used to be read whole before the key was checked (fault 6)."""

    async def main() -> None:
        server = await serving(Probe())
        sent: list[int] = []

        def big_header() -> Iterator[bytes]:
            yield b"GET /echo HTTP/1.1\r\nHost: x\r\nX-Big: "
            for _ in range(400):  # up to 25 MB
                sent.append(65536)
                yield b"y" * 65536

        head = await answer_while_sending(server, big_header(), 0.05)
        assert head.startswith(b"HTTP/1.1 431 ") and sum(sent) < 2**20
        many = b"GET /echo HTTP/1.1\r\n" + b"".join(b"X-%d: 1\r\n" % i for i in range(101))
        assert (await raw(server, many + b"\r\n")).startswith(b"HTTP/1.1 431 ")
        fine = b"GET /echo HTTP/1.1\r\n" + b"".join(b"X-%d: 1\r\n" % i for i in range(90))
        assert (await raw(server, fine + b"Connection: close\r\n\r\n")).startswith(b"HTTP/1.1 200")
        await server.stop()

    run(main())


def test_a_request_that_trickles_in_is_cut_off_at_its_deadline() -> None:
    """One header byte at a time used to keep a connection for ever: each byte reset the idle
    timer (fault 6). The request as a whole now has `request_s`."""

    async def main() -> None:
        server = await serving(Probe(), request_s=0.5, idle_s=60)
        start = time.monotonic()
        slow = b"GET /echo HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"z" * 100
        head = await answer_while_sending(server, (bytes([b]) for b in slow), 0.05)
        assert head.startswith(b"HTTP/1.1 408 ")
        assert 0.4 <= time.monotonic() - start < 3.0  # the deadline (timers may fire a hair early)
        await server.stop()

    run(main())


def test_a_kept_alive_connection_keeps_no_body_it_has_answered() -> None:
    """The connection held its last request, body and all, until the next one began: an
    idle kept-alive connection could hold `max_body` bytes for `idle_s`."""

    async def main() -> None:
        server = await serving(Probe(), max_body=4 * 2**20)
        assert server.bound is not None
        reader, writer = await asyncio.open_connection("127.0.0.1", server.bound[1])
        tracemalloc.start()
        body = b"x" * 2_000_000
        writer.write(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 2000000\r\n\r\n" + body)
        del body
        await writer.drain()
        await asyncio.wait_for(reader.readuntil(b'"head"'), 5)  # answered; the connection stays
        await asyncio.sleep(0.05)
        held, _ = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert held < 500_000, held
        writer.close()
        await server.stop()

    run(main())
