"""While the ledger cannot write, the appliance takes no new turn (nothing would be answered
without its record), and a task change the ledger refused is taken back in memory."""

from __future__ import annotations

import asyncio
from concurrent.futures import Future
from typing import Any

import pytest

from appliance.domain.errors import LedgerUnavailable
from appliance.domain.records import SessionId, TaskEventType, TaskStatus, TenantId, WorkerId
from appliance.services.tasks.tasks import TaskBook
from appliance.services.turns.turn import TurnRequest
from tests.fakes import AckLedger, RouterWorker, wired_desk

A = TenantId("a")


def turn() -> TurnRequest:
    return TurnRequest(
        A,
        "/v1/completions",
        {"model": "m"},
        session_id=SessionId("s"),
    )


def test_no_turn_is_taken_while_the_ledger_cannot_write() -> None:
    class Client:
        async def post(self, path: str, body: Any, headers: Any = None) -> bytes:
            return b'{"usage": {"prompt_tokens": 40, "completion_tokens": 1}}'

    wired = wired_desk([RouterWorker(WorkerId("w0"), Client())])
    wired.ledger.failing = "database or disk is full"
    with pytest.raises(LedgerUnavailable, match="disk is full") as refused:
        asyncio.run(wired.desk.run(turn()))
    assert refused.value.http_status == 503 and refused.value.retry_after_s
    assert wired.ledger.turns == [] and len(wired.desk.sessions) == 0
    wired.ledger.failing = None  # room again: turns are taken
    assert asyncio.run(wired.desk.run(turn())).status == 200


class RefusingLedger(AckLedger):
    def record_task_event(self, event: Any) -> Future[None]:
        refused: Future[None] = Future()
        refused.set_exception(LedgerUnavailable("disk full; the write was lost"))
        return refused


def test_a_refused_terminal_event_leaves_the_task_as_it_was() -> None:
    book = TaskBook(RefusingLedger())  # type: ignore[arg-type]
    book.create(A, "t", 0.0)
    state = book.event(A, "t", TaskEventType.SUCCEEDED, 1.0, verified=True)
    assert state.written is not None and state.written.exception() is not None
    assert (state.status, state.verified) == (TaskStatus.OPEN, None)


def test_a_task_whose_creation_was_refused_is_forgotten() -> None:
    book = TaskBook(AckLedger())  # type: ignore[arg-type]
    parent = book.create(A, "p", 0.0)
    child = book.create(A, "c", 0.0, parent_id="p")
    book.drop(child)
    assert book.get(A, "c") is None and parent.children == []
