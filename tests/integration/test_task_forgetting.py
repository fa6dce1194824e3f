"""The task book's memory stays bounded over a real ledger file: settled trees beyond the
shelf's bound are forgotten, their sessions end, and a forgotten task is still the ledger's
(read back when a request names it: an open one taken back, a closed one refusing as
before, its document the ledger's)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from appliance.domain.block_hash import BlockHasher
from appliance.domain.records import (
    SessionId,
    TaskEventType,
    TaskId,
    TenantId,
    TurnId,
    TurnOutcome,
    TurnRecord,
    WorkerId,
)
from appliance.ledger import LedgerWriter
from appliance.ledger.task_history import TaskHistory
from appliance.services.sessions.sessions import SessionTable
from appliance.services.tasks.settled_tasks import SettledShelf
from appliance.services.tasks.task_state import TaskError, TaskTurnBegan, TaskTurnEnded
from appliance.services.tasks.tasks import TaskBook

T = TenantId("t")
KEEP = 4


@pytest.fixture
def ledger(tmp_path: Path) -> Iterator[LedgerWriter]:
    with LedgerWriter.open(tmp_path / "ledger.db") as writer:
        yield writer


def book_over(ledger: LedgerWriter, *, idle_s: float = 600.0) -> tuple[TaskBook, SessionTable]:
    sessions = SessionTable(BlockHasher.for_engine("sha256", 16, None))
    book = TaskBook(
        ledger,
        idle_s=idle_s,
        archive=TaskHistory(ledger.path),
        shelf=SettledShelf(KEEP),
        on_close=lambda task: sessions.forget_task(task.key),
    )
    return book, sessions


def one_turn_done(book: TaskBook, sessions: SessionTable, task: str, now: float) -> None:
    """A turn of `task` in its session `s-<task>`, ended."""
    state = book.ensure(T, task, now)
    session = sessions.open(T, SessionId(f"s-{task}"), now)
    sessions.bind_task(session, state.key)
    sessions.began(session, now)
    book.turn_began(TaskTurnBegan(state, now))
    book.turn_ended(TaskTurnEnded(state, now + 1))
    sessions.ended(session, now + 1)


def test_closed_tasks_beyond_the_bound_are_forgotten_and_their_sessions_end(
    ledger: LedgerWriter,
) -> None:
    book, sessions = book_over(ledger)
    for n in range(KEEP + 3):
        one_turn_done(book, sessions, f"job{n}", float(n))
        book.event(T, f"job{n}", TaskEventType.SUCCEEDED, n + 2.0)
    held = sorted(t.client_id for t in book)
    assert held == [f"job{n}" for n in range(3, KEEP + 3)]  # the newest KEEP settled
    assert len(sessions) == 0  # each ended with its task
    ledger.flush()
    again = book.get(T, "job0")  # the ledger's: closed, and it refuses as before
    assert again is not None and (again.status, again.turns) == ("succeeded", 0)
    assert book.find(TaskId("t/job0")) is None  # read back, not held again
    with pytest.raises(TaskError) as closed:
        book.event(T, "job0", TaskEventType.FAILED, 20.0)
    assert closed.value.code == "task_closed"
    # A retry of the event that closed it is answered as before, and writes nothing.
    assert book.event(T, "job0", TaskEventType.SUCCEEDED, 21.0).status == "succeeded"
    with pytest.raises(TaskError) as refused:
        book.check_parent(T, "job0")
    assert refused.value.code == "task_closed"


def test_an_open_tree_and_a_turn_in_flight_keep_their_tasks(ledger: LedgerWriter) -> None:
    book, sessions = book_over(ledger)
    root = book.create(T, "root", 0.0)
    book.create(T, "kid", 0.0, parent_id="root")
    book.event(T, "kid", TaskEventType.SUCCEEDED, 1.0)  # its root is open: not settled
    busy = book.create(T, "busy", 0.0)
    book.turn_began(TaskTurnBegan(busy, 1.0))
    book.event(T, "busy", TaskEventType.FAILED, 2.0)  # closed with a turn in flight
    for n in range(KEEP + 2):
        one_turn_done(book, sessions, f"job{n}", 3.0 + n)
        book.event(T, f"job{n}", TaskEventType.SUCCEEDED, 4.0 + n)
    assert {"root", "kid", "busy"} <= {t.client_id for t in book}
    book.turn_ended(TaskTurnEnded(busy, 20.0))  # now it settles, the newest of all
    for n in range(KEEP):
        one_turn_done(book, sessions, f"more{n}", 30.0 + n)
        book.event(T, f"more{n}", TaskEventType.SUCCEEDED, 31.0 + n)
    held = {t.client_id for t in book}
    assert {"root", "kid"} <= held and "busy" not in held
    assert book.find(root.key) is root


def test_a_forgotten_idle_task_is_taken_back_open_with_its_sums(ledger: LedgerWriter) -> None:
    book, sessions = book_over(ledger, idle_s=10.0)
    one_turn_done(book, sessions, "agent", 0.0)
    ledger.record_turn(
        TurnRecord(
            TurnId("u1"),
            T,
            TaskId("t/agent"),
            None,
            WorkerId("w0"),
            "m",
            100,
            40,
            5,
            TurnOutcome.OK,
            0.0,
            1.0,
        )
    )
    for n in range(KEEP + 1):  # each admission look lets go tasks idle for 10 s
        one_turn_done(book, sessions, f"job{n}", 100.0 + 20 * n)
        book.tenant_loads(115.0 + 20 * n)
    assert book.find(TaskId("t/agent")) is None  # idle, settled, forgotten
    assert sessions.get(T, SessionId("s-agent")) is not None  # open: its session stays
    ledger.flush()
    back = book.get(T, "agent")
    assert back is not None and back.status == "open"
    assert (back.turns, back.prompt_tokens, back.cached_tokens) == (1, 100, 40)
    assert book.find(TaskId("t/agent")) is back  # held again: its next turn counts
    assert book.ensure(T, "agent", 500.0) is back


def test_the_document_of_a_forgotten_tree_comes_from_the_ledger(ledger: LedgerWriter) -> None:
    book, sessions = book_over(ledger)
    root = book.create(T, "orchestrator", 0.0, task_class="plan")
    for kid in ("a", "b"):
        book.create(T, kid, 0.0, parent_id="orchestrator")
    ledger.record_turn(
        TurnRecord(
            TurnId("u1"),
            T,
            TaskId("t/a"),
            None,
            WorkerId("w0"),
            "m",
            100,
            40,
            5,
            TurnOutcome.OK,
            0.0,
            1.0,
        )
    )
    book.event(T, "a", TaskEventType.SUCCEEDED, 1.0)
    book.event(T, "orchestrator", TaskEventType.SUCCEEDED, 2.0)  # b is discarded with it
    book.discard_branches(root, 2.0)
    live = book.tree(root)
    for n in range(KEEP + 1):
        one_turn_done(book, sessions, f"job{n}", 3.0 + n)
        book.event(T, f"job{n}", TaskEventType.SUCCEEDED, 4.0 + n)
    assert book.find(root.key) is None
    ledger.flush()
    archived = book.archived(T, "orchestrator")
    assert archived is not None
    assert [(c["id"], c["status"], c["turns"]) for c in archived["children"]] == [
        ("a", "succeeded", 1),
        ("b", "cancelled", 0),
    ]
    drop_counts = ("turns", "cost", "tokens", "children")
    assert {k: v for k, v in archived.items() if k not in drop_counts} == {
        k: v for k, v in live.items() if k not in drop_counts
    }  # the same document, from the ledger
    assert book.archived(T, "never") is None
