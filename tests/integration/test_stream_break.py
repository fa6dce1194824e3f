"""A worker whose stream breaks midway, on a real local port: the client gets every byte the
worker sent, then an SSE error event, and the ledger a failed attempt; the session is free
for its next turn, which goes to a worker that answers."""

from __future__ import annotations

import asyncio

import orjson

from appliance.domain.records import SessionId, TaskId, TenantId, TurnOutcome, WorkerId
from appliance.engines.clients.vllm_client import VllmClient
from appliance.services.turns.turn import TurnRequest
from tests.fakes import RouterWorker, Wired, read_request_body, wired_desk

EVENTS = [
    b'data: {"choices": [{"index": 0, "text": "a"}]}\n\n',
    b'data: {"choices": [{"index": 0, "text": "b"}]}\n\n',
]


async def breaking_worker(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Reads one request, answers two SSE events in chunked framing, then hangs up without
    the last chunk."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(
        int(line.split(b":", 1)[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    await reader.readexactly(length)
    writer.write(
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    )
    for event in EVENTS:
        writer.write(b"%x\r\n%s\r\n" % (len(event), event))
        await writer.drain()
        await asyncio.sleep(0.01)
    writer.close()


async def healthy_worker(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while True:
        if await read_request_body(reader) is None:
            writer.close()
            return
        body = b'{"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 1}}'
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
        await writer.drain()


def test_a_stream_that_breaks_midway_ends_with_an_error_event_and_a_failed_attempt() -> None:
    async def main() -> tuple[list[bytes], Wired, str]:
        broken = await asyncio.start_server(breaking_worker, "127.0.0.1", 0)
        fine = await asyncio.start_server(healthy_worker, "127.0.0.1", 0)
        ports = [s.sockets[0].getsockname()[1] for s in (broken, fine)]
        workers = [
            RouterWorker(WorkerId(f"w{i}"), VllmClient(f"http://127.0.0.1:{port}"))
            for i, port in enumerate(ports)
        ]
        wired = wired_desk(workers)
        body = {"model": "m", "prompt": "x", "stream": True}
        turn = TurnRequest(
            TenantId("a"), "/v1/completions", body, list(range(40)), TaskId("a/t"), SessionId("s")
        )
        reply = await wired.desk.handle(turn)  # w0: both workers alike, the first listed
        assert reply.chunks is not None and reply.headers["X-Appliance-Worker"] == "w0"
        relayed = [chunk async for chunk in reply.chunks]
        workers[0].healthy = False  # as the health check would see it next
        next_turn = TurnRequest(
            TenantId("a"),
            "/v1/completions",
            {**body, "stream": False},
            list(range(48)),
            TaskId("a/t"),
            SessionId("s"),
        )
        second = await wired.desk.handle(next_turn)
        await asyncio.sleep(0.01)  # the ledger records are written on the loop's next turn
        for w in workers:
            await w.client.aclose()
        await asyncio.sleep(0.01)  # the healthy worker sees its connection end
        for server in (broken, fine):
            server.close()
            await server.wait_closed()
        return relayed, wired, second.headers["X-Appliance-Worker"]

    relayed, wired, second_worker = asyncio.run(main())
    ledger = wired.ledger
    data = b"".join(relayed)
    assert data.startswith(b"".join(EVENTS))  # everything the worker sent, unchanged
    error = orjson.loads(data[len(b"".join(EVENTS)) :].removeprefix(b"data: ").strip())
    assert error["error"]["type"] == "stream_error" and error["error"]["code"] == 502
    assert [(t.worker, t.outcome) for t in ledger.turns] == [
        ("w0", TurnOutcome.FAILED),
        ("w1", TurnOutcome.OK),
    ]
    assert ledger.turns[0].error is not None and "stream broke" in ledger.turns[0].error
    assert second_worker == "w1"
    session = wired.desk.sessions.get(TenantId("a"), SessionId("s"))
    assert session is not None and session.in_flight == 0
