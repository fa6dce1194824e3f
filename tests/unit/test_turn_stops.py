"""What stops a turn in flight at the desk: its task's cancellation, and its deadline.

A turn still waiting on its worker (a stream whose first chunk has not come counts) is
stopped there: its request is closed, which aborts it in vLLM, its attempt is a `cancelled`
turn row, and the client gets an error JSON (409 `task_cancelled`; at the deadline 504
`deadline_missed`, the row's error `deadline_missed`). A stream already relaying runs on
past its deadline. The deadlines ring on the test's clock (tests/fakes.py
`ManualClock.alarm`)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest

from appliance.domain.records import SessionId, TaskId, TenantId, TurnOutcome, WorkerId
from appliance.services.tasks.task_state import TaskError
from appliance.services.turns.flights import loop_alarm
from appliance.services.turns.turn import Reply, TurnRequest
from tests.fakes import ManualClock, RouterWorker, Wired, wired_desk

A = TenantId("a")
W0 = WorkerId("w0")
ANSWER = b'{"usage": {"prompt_tokens": 40, "completion_tokens": 1}}'
CHUNKS = [b'data: {"choices": [{"text": "a"}]}\n\n', b"data: [DONE]\n\n"]


def turn(task: str = "t", *, stream: bool = False, deadline_s: float | None = 2.0) -> TurnRequest:
    body = {"model": "m", "stream": True} if stream else {"model": "m"}
    return TurnRequest(
        A,
        "/v1/completions",
        body,
        client_task_id=task,
        session_id=SessionId(task),
        deadline_s=deadline_s,
    )


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


def test_a_turn_still_queued_at_its_deadline_is_aborted_and_recorded() -> None:
    worker = Worker()
    wired = desk(worker)

    async def main() -> TaskError:
        running = asyncio.create_task(wired.desk.run(turn(deadline_s=2.0)))
        await settle()
        wired.clock.advance(1.9)  # before the deadline nothing happens
        await settle()
        assert not running.done()
        wired.clock.advance(0.2)
        with pytest.raises(TaskError) as missed:
            await asyncio.wait_for(running, 5)
        await settle()
        return missed.value

    error = asyncio.run(main())
    assert (error.http_status, error.code) == (504, "deadline_missed")
    assert "deadline passed" in error.message
    assert worker.aborted == 1  # the request was closed: vLLM aborts it
    [row] = wired.ledger.turns
    assert (row.outcome, row.error, row.worker) == (TurnOutcome.CANCELLED, "deadline_missed", W0)
    assert wired.queues.routed_s(W0, wired.clock.now()) == 0  # no longer counted queued
    assert row.task_id and wired.desk.stop(row.task_id) == 0  # landed: nothing in flight


def test_a_stream_not_started_at_its_deadline_is_aborted_before_its_head() -> None:
    worker = Worker()
    wired = desk(worker)

    async def main() -> TaskError:
        running = asyncio.create_task(wired.desk.run(turn(stream=True, deadline_s=1.0)))
        await settle()  # the worker's head is in; its first chunk is not
        wired.clock.advance(1.0)
        with pytest.raises(TaskError) as missed:
            await asyncio.wait_for(running, 5)
        await settle()
        return missed.value

    error = asyncio.run(main())
    assert (error.http_status, error.code) == (504, "deadline_missed")
    assert worker.aborted == 1
    [row] = wired.ledger.turns
    assert (row.outcome, row.error, row.ttft_s) == (TurnOutcome.CANCELLED, "deadline_missed", None)


def test_a_stream_relaying_at_its_deadline_runs_on() -> None:
    worker = Worker()
    wired = desk(worker)

    async def main() -> list[bytes]:
        running = asyncio.create_task(wired.desk.run(turn(stream=True, deadline_s=1.0)))
        worker.started.set()
        reply = await running  # its first chunk is in
        wired.clock.advance(5.0)  # the deadline passes while it relays
        worker.go.set()
        got = await relay(reply)
        await settle()
        return got

    assert asyncio.run(main()) == CHUNKS
    assert worker.aborted == 0
    [row] = wired.ledger.turns
    assert (row.outcome, row.error) == (TurnOutcome.OK, None)


def test_a_turn_answered_in_time_disarms_its_deadline() -> None:
    worker = Worker()
    worker.go.set()
    wired = desk(worker)

    async def main() -> Reply:
        reply = await wired.desk.run(turn(deadline_s=2.0))
        wired.clock.advance(10.0)  # nothing rings: the alarm went with the turn
        await settle()
        return reply

    assert asyncio.run(main()).status == 200
    assert [r.outcome for r in wired.ledger.turns] == [TurnOutcome.OK]
    assert wired.clock.alarms == 0


def test_a_turns_own_deadline_binds_when_earlier_than_its_tasks() -> None:
    worker = Worker()
    wired = desk(worker)

    async def main() -> TaskError:
        worker.go.set()
        await wired.desk.run(turn(deadline_s=60.0))  # opens the task, due in 60 s
        worker.go.clear()
        running = asyncio.create_task(wired.desk.run(turn(deadline_s=1.0)))
        await settle()
        wired.clock.advance(1.0)
        with pytest.raises(TaskError) as missed:
            await asyncio.wait_for(running, 5)
        return missed.value

    assert asyncio.run(main()).code == "deadline_missed"


def test_a_turn_without_a_deadline_arms_nothing() -> None:
    worker = Worker()
    wired = desk(worker)

    async def main() -> None:
        running = asyncio.create_task(wired.desk.run(turn(deadline_s=None)))
        await settle()
        assert wired.clock.alarms == 0
        worker.go.set()
        await running

    asyncio.run(main())
    assert [r.outcome for r in wired.ledger.turns] == [TurnOutcome.OK]


def test_the_loop_alarm_rings_on_the_loops_timer_unless_disarmed() -> None:
    clock = ManualClock(100.0)
    rung: list[str] = []

    async def main() -> None:
        arm = loop_alarm(clock)
        arm(100.01, lambda: rung.append("soon"))
        arm(99.0, lambda: rung.append("past"))  # already due: on the loop's next turn
        disarm = arm(100.0, lambda: rung.append("disarmed"))
        disarm()
        await asyncio.sleep(0.05)

    asyncio.run(main())
    assert rung == ["past", "soon"]
