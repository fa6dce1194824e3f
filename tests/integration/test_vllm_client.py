"""The vLLM client against a scripted server on a real local port, and a closed port.

The same client against real vLLM is covered in test_supervisor_vllm.py.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
from aiohttp import web

from appliance.engines.clients.vllm_client import VllmClient, parse_sse_line
from appliance.engines.errors import EngineRequestError, EngineUnavailable

METRICS = (Path(__file__).parents[1] / "unit" / "data" / "vllm_metrics.txt").read_text()
CHUNKS = [
    {"choices": [{"index": 0, "text": "a"}]},
    {"choices": [{"index": 0, "text": "b"}]},
    {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}},
]


async def handler(request: web.Request) -> web.StreamResponse:
    path = request.path
    if path == "/health":
        return web.Response(status=200)
    if path == "/metrics":
        return web.Response(text=METRICS)
    if path == "/v1/models":
        return web.json_response({"object": "list", "data": [{"id": "tiny"}]})
    if path == "/tokenize":
        body = await request.json()
        n = len(body.get("prompt") or body["messages"][0]["content"])
        return web.json_response({"count": n, "tokens": list(range(n))})
    if path == "/v1/completions":
        body = await request.json()
        if body.get("max_tokens", 1) > 100:
            return web.json_response(
                {"error": {"message": "max_tokens is too large", "code": 400}}, status=400
            )
        if not body.get("stream"):
            return web.json_response({"echo": body, "session": request.headers.get("x-session-id")})
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b": keep-alive\n\n")
        for chunk in CHUNKS:  # one write per event, as a server sends them
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response
    return web.Response(status=404, text="not found")


@asynccontextmanager
async def served(
    handle: Callable[[web.Request], object] = handler,
) -> AsyncIterator[str]:
    """A real HTTP server on a free local port, answering with `handle`."""
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handle)  # type: ignore[arg-type]
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


@asynccontextmanager
async def client(**kw) -> AsyncIterator[VllmClient]:
    async with served() as url, VllmClient(url + "/", model="tiny", **kw) as c:
        yield c


def run(coro):
    return asyncio.run(coro)


def test_probes_and_reads() -> None:
    async def go():
        async with client() as c:
            assert c.base_url.startswith("http://127.0.0.1:") and not c.base_url.endswith("/")
            assert await c.health()
            assert (await c.models())[0]["id"] == "tiny"
            assert await c.tokenize("abc") == [0, 1, 2]
            assert await c.tokenize(messages=[{"role": "user", "content": "ab"}]) == [0, 1]
            load = await c.load()
            assert load.prefix_cache_hits_tokens == 2336 and load.time > 0

    run(go())


def test_a_reading_is_stamped_when_it_was_asked_for() -> None:
    """The gauges are as of the worker's last step, before a slow scrape's answer left: a
    request that ended meanwhile must not count as waiting (services/turns/queue_book.py)."""

    async def slow_metrics(request: web.Request) -> web.Response:
        await asyncio.sleep(0.3)
        return web.Response(text=METRICS)

    async def go():
        async with served(slow_metrics) as url, VllmClient(url, model="tiny") as c:
            asked = time.time()
            load = await c.load()
            assert asked <= load.time < asked + 0.2, load.time - asked

    run(go())


def test_tokenize_needs_exactly_one_input() -> None:
    async def go():
        async with client() as c:
            with pytest.raises(ValueError):
                await c.tokenize()

    run(go())


def test_completion_passthrough_with_headers() -> None:
    async def go():
        async with client() as c:
            body = {"model": "tiny", "prompt": "x", "cache_salt": "s"}
            out = await c.completions(body, headers={"X-Session-ID": "sess-1"})
            assert out == {"echo": body, "session": "sess-1"}

    run(go())


def test_stream_yields_each_chunk_and_skips_comments_and_done() -> None:
    async def go():
        async with client() as c:
            return [ch async for ch in c.stream("/v1/completions", {"prompt": "x"})]

    assert run(go()) == CHUNKS


def test_error_status_carries_vllms_message() -> None:
    async def go():
        async with client() as c:
            with pytest.raises(EngineRequestError) as err:
                await c.completions({"prompt": "x", "max_tokens": 1000})
            assert err.value.http_status == 400
            assert "max_tokens is too large" in err.value.message
            with pytest.raises(EngineRequestError) as err:
                async for _ in c.stream("/v1/completions", {"max_tokens": 1000}):
                    pass
            assert err.value.http_status == 400
            with pytest.raises(EngineRequestError, match="answered 404: not found"):
                await c.chat({"messages": []})

    run(go())


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_unreachable_worker() -> None:
    async def go():
        async with VllmClient(f"http://127.0.0.1:{closed_port()}") as c:
            assert not await c.health(timeout_s=1)
            with pytest.raises(EngineUnavailable, match="unreachable for /metrics"):
                await c.load()
            with pytest.raises(EngineUnavailable, match="unreachable for /v1/completions"):
                async for _ in c.stream("/v1/completions", {}):
                    pass

    run(go())


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ('data: {"a": 1}', {"a": 1}),
        ('data:{"a": 1}', {"a": 1}),
        ("data: [DONE]", None),
        (": comment", None),
        ("", None),
        ("event: ping", None),
        ("data: [1, 2]", None),
    ],
)
def test_parse_sse_line(line: str, expected) -> None:
    assert parse_sse_line(line) == expected


@pytest.mark.parametrize(
    ("status", "body", "expected"),
    [
        (503, "", "answered 503: Service Unavailable"),
        (500, "  \n", "answered 500: Internal Server Error"),
        (400, '{"error": "plain"}', "answered 400: plain"),
        (400, '{"message": "top level"}', "answered 400: top level"),
        (422, "line one\nline two", "answered 422: line one"),
    ],
)
def test_error_messages_are_one_line(status: int, body: str, expected: str) -> None:
    async def answer(request: web.Request) -> web.Response:
        return web.Response(status=status, text=body)

    async def go() -> None:
        async with served(answer) as url, VllmClient(url) as c:
            with pytest.raises(EngineRequestError) as err:
                await c.models()
            assert err.value.message == f"vLLM /v1/models {expected}"
            assert err.value.http_status == status and err.value.body == body

    run(go())
