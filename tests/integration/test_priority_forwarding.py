"""A turn's priority reaches the worker as vLLM's priority scheduling reads it, on a real
local port: the lowest value runs first, so the desk sends the admission-clipped
X-Priority negated (times `PREFILL_RANKS`, the turn's prefill rank added), and a priority
the client wrote into the body never gets through."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson

from appliance.domain.records import SessionId, TaskId, TenantId, WorkerId
from appliance.engines.clients.vllm_client import VllmClient
from appliance.policy.routing.turn_order import PREFILL_RANKS
from appliance.services.turns.turn import TurnRequest
from tests.fakes import RouterWorker, read_request_body, wired_desk


def capturing_worker(bodies: list[dict[str, Any]]) -> Any:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while (body := await read_request_body(reader)) is not None:
            bodies.append(orjson.loads(body))
            answer = b'{"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 1}}'
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(answer), answer))
            await writer.drain()
        writer.close()

    return serve


def forwarded_bodies(turns: list[TurnRequest]) -> list[dict[str, Any]]:
    """The bodies the desk sends a worker on a real local port for `turns`, one by one."""
    bodies: list[dict[str, Any]] = []

    async def main() -> None:
        server = await asyncio.start_server(capturing_worker(bodies), "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        worker = RouterWorker(WorkerId("w0"), VllmClient(f"http://127.0.0.1:{port}"))
        desk = wired_desk([worker]).desk
        for turn in turns:
            await desk.handle(turn)
        await worker.client.aclose()
        server.close()
        await server.wait_closed()

    asyncio.run(main())
    return bodies


def test_the_worker_gets_the_clipped_priority_negated_and_never_the_clients_own() -> None:
    body = {"model": "m", "prompt": "x", "priority": -1000}  # the client asks to jump
    turns = [
        TurnRequest(
            TenantId("a"),
            "/v1/completions",
            body,
            list(range(40 + i)),
            TaskId("a/t"),
            SessionId("s"),
            priority=priority,
        )
        for i, priority in enumerate((3, 0, -2))
    ]
    bodies = forwarded_bodies(turns)
    assert [b["priority"] // PREFILL_RANKS for b in bodies] == [-3, 0, 2]


def test_among_turns_of_one_priority_the_shorter_estimated_prefill_goes_first() -> None:
    # The desk's cost model (`LinearCost`): 1 ms a fresh token, nothing resident, so 40
    # tokens rank 0 and 450 tokens (0.45 s) rank 4 of 0.1 s; the client's field never counts.
    body = {"model": "m", "prompt": "x", "priority": 7}
    turns = [
        TurnRequest(
            TenantId("a"),
            "/v1/completions",
            body,
            list(range(1000 * i, 1000 * i + n)),
            TaskId(f"a/t{i}"),
            SessionId(f"s{i}"),
        )
        for i, n in enumerate((40, 450))
    ]
    assert [b["priority"] for b in forwarded_bodies(turns)] == [0, 4]
