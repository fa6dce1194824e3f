"""What stops a turn in flight at the desk: its task's cancellation.

A turn still waiting on its worker (a stream whose first chunk has not come counts) is
stopped there: its request is closed, which aborts it in vLLM, its attempt is a `cancelled`
turn row, and the client gets an error JSON (409 `task_cancelled`)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest

from appliance.domain.records import SessionId, TaskId, TenantId, TurnOutcome, WorkerId
from appliance.services.tasks import TaskError
from appliance.services.turn import Reply
from appliance.services.turn_desk import TurnInput
from tests.fakes import ManualClock, RouterWorker, Wired, wired_desk

A = TenantId("a")
W0 = WorkerId("w0")
ANSWER = b'{"usage": {"prompt_tokens": 40, "completion_tokens": 1}}'
CHUNKS = [b'data: {"choices": [{"text": "a"}]}\n\n', b"data: [DONE]\n\n"]


def turn(task: str = "t", *, stream: bool = False, deadline_s: float | None = None) -> TurnInput:
    body = {"model": "m", "stream": True} if stream else {"model": "m"}
    return TurnInput(A, "/v1/completions", body, tokenize=lambda _: ([1] * 40, None),
                     estimate=lambda _: None, task_id=task, session_id=SessionId(task),
                     deadline_s=deadline_s)  # fmt: skip


class Worker:
    """A worker that answers when the test lets it (`go`); until then the turn waits in its
    queue. A stream sends its head at once (as vLLM does), its chunks after `go`; `started`
    lets the first chunk through alone."""

    def __init__(self) -> None:
        self.go = asyncio.Event()
        self.started = asyncio.Event()
        self.aborted = 0
        """Requests closed before their answer was complete."""

    async def post(self, path: str, body: Any, headers: Any = None) -> bytes:
        try:
            await self.go.wait()
        except asyncio.CancelledError:
            self.aborted += 1
            raise
        return ANSWER

    @asynccontextmanager
    async def open_stream(self, path: str, body: Any) -> AsyncIterator[Any]:
        done = False
        worker = self

        class Response:
            async def chunks(self) -> AsyncIterator[bytes]:
                nonlocal done
                await worker.started.wait()
                yield CHUNKS[0]
                await worker.go.wait()
                yield CHUNKS[1]
                done = True

        try:
            yield Response()
        finally:
            self.aborted += not done


def desk(worker: Worker) -> Wired:
    return wired_desk([RouterWorker(W0, worker)], clock=ManualClock(100.0))


async def relay(reply: Reply) -> list[bytes]:
    assert reply.chunks is not None
    got = [chunk async for chunk in reply.chunks]
    assert reply.on_end is not None
    reply.on_end()
    return got


async def settle() -> None:
    """A few loop turns: the request reaches the worker; the ledger rows are handed over."""
    for _ in range(5):
        await asyncio.sleep(0)


def test_cancelling_a_stream_not_yet_started_answers_409_before_its_head() -> None:
    worker = Worker()
    wired = desk(worker)

    async def main() -> TaskError:
        running = asyncio.create_task(wired.desk.run(turn(stream=True, deadline_s=None)))
        await settle()
        assert wired.desk.stop(TaskId(f"{A}/t")) == 1
        with pytest.raises(TaskError) as cancelled:
            await asyncio.wait_for(running, 5)
        await settle()
        return cancelled.value

    error = asyncio.run(main())
    assert (error.http_status, error.code) == (409, "task_cancelled")
    assert worker.aborted == 1
    [row] = wired.ledger.turns
    assert (row.outcome, row.error) == (TurnOutcome.CANCELLED, None)
