"""A turn without X-Task-ID runs as a one-turn task (`turn-...`), closed `done` when the turn
ends however it ended: the book holds no open task for it, admission counts none, the
ledger is told by a `done` task event, and the session a client named lives on (its next
turn binds a new one-turn task). `done` is the appliance's own: a client cannot send it."""

from __future__ import annotations

import asyncio
from concurrent.futures import Future
from typing import Any

import pytest

from appliance.api.errors import RequestRefused
from appliance.api.tasks.task_routes import task_event
from appliance.domain.block_hash import BlockHasher
from appliance.domain.errors import EngineRequestError, EngineUnavailable, LedgerUnavailable
from appliance.domain.records import (
    SessionId,
    TaskEvent,
    TaskEventType,
    TaskStatus,
    TenantId,
    WorkerId,
)
from appliance.services.sessions.sessions import SessionTable
from appliance.services.tasks.task_state import TaskError, TaskState, TaskTurnBegan, TaskTurnEnded
from appliance.services.tasks.tasks import TaskBook
from appliance.services.turns.turn import NoWorker, TurnRequest
from tests.fakes import AckLedger, RouterWorker, Wired, wired_desk

A = TenantId("a")
ANSWER = b'{"usage": {"prompt_tokens": 40, "completion_tokens": 1}}'


class EventLedger(AckLedger):
    """Acknowledges everything; keeps the task events."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[TaskEvent] = []

    def record_task_event(self, event: TaskEvent) -> Future[None]:
        self.events.append(event)
        done: Future[None] = Future()
        done.set_result(None)
        return done


class RefusingLedger(EventLedger):
    def record_task_event(self, event: TaskEvent) -> Future[None]:
        super().record_task_event(event)
        refused: Future[None] = Future()
        refused.set_exception(LedgerUnavailable("disk full; the write was lost"))
        return refused


class Answering:
    async def post(self, path: str, body: Any, headers: Any = None) -> bytes:
        return ANSWER


class Failing:
    def __init__(self, exc: Exception) -> None:
        self.exc = exc

    async def post(self, path: str, body: Any, headers: Any = None) -> bytes:
        raise self.exc


def turn(session: str | None = None, task: str | None = None) -> TurnRequest:
    return TurnRequest(
        A,
        "/v1/completions",
        {"model": "m"},
        client_task_id=task,
        session_id=SessionId(session) if session else None,
    )


def wired(client: Any, ledger: EventLedger | None = None) -> Wired:
    return wired_desk([RouterWorker(WorkerId("w0"), client)], ledger=ledger or EventLedger())


def one_turn_tasks(book: TaskBook) -> list[TaskState]:
    return [t for t in book if t.client_id.startswith("turn-")]


def test_a_turn_without_a_task_leaves_its_one_turn_task_done() -> None:
    ledger = EventLedger()
    w = wired(Answering(), ledger)
    for n in range(5):
        reply = asyncio.run(w.desk.run(turn("s" if n % 2 else None)))
        assert reply.status == 200 and reply.headers["X-Task-ID"].startswith("turn-")
    tasks = one_turn_tasks(w.tasks)
    assert len(tasks) == 5
    assert {t.status for t in tasks} == {TaskStatus.DONE}
    assert all(t.verified is None for t in tasks)  # no outcome: never a verified success
    assert [e.type for e in ledger.events] == [TaskEventType.DONE] * 5
    assert sorted(e.task_id for e in ledger.events) == sorted(t.key for t in tasks)
    assert w.tasks.tenant_loads(w.clock.now()) == {}  # admission counts nothing open


def test_the_session_a_client_named_outlives_its_one_turn_tasks() -> None:
    w = wired(Answering())
    asyncio.run(w.desk.run(turn("s")))
    first = w.desk.sessions.get(A, SessionId("s"))
    assert first is not None and first.turns == 1
    asyncio.run(w.desk.run(turn("s")))
    again = w.desk.sessions.get(A, SessionId("s"))
    assert again is first and again.turns == 2  # the same session: its chain, its home
    assert again.home == WorkerId("w0")
    done = one_turn_tasks(w.tasks)
    assert len(done) == 2 and again.task_id == done[-1].key != done[0].key
    assert all(t.status is TaskStatus.DONE for t in done)
    # A one-turn session (no id named) leaves nothing, as before.
    asyncio.run(w.desk.run(turn()))
    assert [s.session_id for s in w.desk.sessions] == ["s"]


@pytest.mark.parametrize(
    "exc",
    [EngineUnavailable("refused"), EngineRequestError("bad", http_status=400, body="{}")],
    ids=["no worker", "worker said 400"],
)
def test_a_failed_turn_closes_its_one_turn_task_too(exc: Exception) -> None:
    w = wired(Failing(exc))
    if isinstance(exc, EngineUnavailable):
        with pytest.raises(NoWorker):
            asyncio.run(w.desk.run(turn("s")))
    else:
        assert asyncio.run(w.desk.run(turn("s"))).status == 400
    (task,) = one_turn_tasks(w.tasks)
    assert task.status is TaskStatus.DONE and task.load.in_flight == 0
    assert w.tasks.tenant_loads(w.clock.now()) == {}


def test_a_cancelled_turn_closes_its_one_turn_task() -> None:
    class Hanging:
        async def post(self, path: str, body: Any, headers: Any = None) -> bytes:
            await asyncio.Event().wait()
            return ANSWER

    w = wired(Hanging())

    async def hang_up() -> None:
        run = asyncio.create_task(w.desk.run(turn("s")))
        await asyncio.sleep(0.01)
        assert [t.status for t in one_turn_tasks(w.tasks)] == [TaskStatus.OPEN]  # its turn runs
        run.cancel()  # the client left
        with pytest.raises(asyncio.CancelledError):
            await run

    asyncio.run(hang_up())
    (task,) = one_turn_tasks(w.tasks)
    assert task.status is TaskStatus.DONE
    assert w.desk.sessions.get(A, SessionId("s")) is not None


def test_a_done_task_takes_no_more_turns_and_no_client_reports_done() -> None:
    w = wired(Answering())
    reply = asyncio.run(w.desk.run(turn()))
    with pytest.raises(TaskError) as closed:
        asyncio.run(w.desk.run(turn(task=reply.headers["X-Task-ID"])))
    assert closed.value.code == "task_closed" and "is done" in closed.value.message
    with pytest.raises(RequestRefused) as refused:  # `done` is the appliance's own
        task_event({"type": "done"})
    assert "done" not in refused.value.message.split("one of", 1)[1]
    assert task_event({"type": "succeeded"}).kind is TaskEventType.SUCCEEDED


def book_and_sessions(ledger: EventLedger) -> tuple[TaskBook, SessionTable]:
    sessions = SessionTable(BlockHasher.for_engine("sha256", 16, None))
    book = TaskBook(ledger, on_close=lambda task: sessions.forget_task(task.key))
    return book, sessions


def test_done_ends_no_session_while_a_closing_event_does() -> None:
    book, sessions = book_and_sessions(EventLedger())
    for name, one_turn in (("turn-1", True), ("job", False)):
        state = book.ensure(A, name, 0.0, one_turn=one_turn)
        session = sessions.open(A, SessionId(f"s-{name}"), 0.0)
        sessions.bind_task(session, state.key)
        book.turn_began(TaskTurnBegan(state, 0.0))
        book.turn_ended(TaskTurnEnded(state, 1.0))
    assert book.get(A, "turn-1").status is TaskStatus.DONE  # type: ignore[union-attr]
    assert book.get(A, "job").status is TaskStatus.OPEN  # type: ignore[union-attr]
    book.event(A, "job", TaskEventType.FAILED, 2.0)
    assert [s.session_id for s in sessions] == ["s-turn-1"]
    assert not TaskStatus.DONE.ends_sessions and TaskStatus.FAILED.ends_sessions


def test_a_one_turn_task_closes_with_its_last_turn_in_flight() -> None:
    ledger = EventLedger()
    book, _ = book_and_sessions(ledger)
    state = book.ensure(A, "turn-2", 0.0, one_turn=True)
    book.turn_began(TaskTurnBegan(state, 0.0))
    book.turn_began(TaskTurnBegan(state, 0.5))  # a client named it while its stream ran
    book.turn_ended(TaskTurnEnded(state, 1.0))
    assert state.status is TaskStatus.OPEN
    book.turn_ended(TaskTurnEnded(state, 2.0))
    assert state.status is TaskStatus.DONE
    assert [(e.type, e.at) for e in ledger.events] == [(TaskEventType.DONE, 2.0)]


def test_a_one_turn_task_cancelled_during_its_turn_stays_cancelled() -> None:
    ledger = EventLedger()
    book, _ = book_and_sessions(ledger)
    parent = book.create(A, "root", 0.0)
    state = book.ensure(A, "turn-3", 0.0, parent_id="root", one_turn=True)
    book.turn_began(TaskTurnBegan(state, 0.0))
    book.cancel(A, "root", 0.5)
    book.turn_ended(TaskTurnEnded(state, 1.0))
    assert (parent.status, state.status) == (TaskStatus.CANCELLED, TaskStatus.CANCELLED)
    assert TaskEventType.DONE not in [e.type for e in ledger.events]


def test_a_refused_done_leaves_the_task_open_and_uncounted() -> None:
    book, _ = book_and_sessions(RefusingLedger())
    state = book.ensure(A, "turn-4", 0.0, one_turn=True)
    book.turn_began(TaskTurnBegan(state, 0.0))
    book.turn_ended(TaskTurnEnded(state, 1.0))
    assert state.written is not None and state.written.exception() is not None
    assert state.status is TaskStatus.OPEN  # memory never runs ahead of the ledger
    assert book.tenant_loads(1.0) == {}  # but admission counts it no more
