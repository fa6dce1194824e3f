"""What a restarted appliance reads back from a real ledger file: the open tasks clients
named (with their turns' sums), not the one-turn tasks, and the recent sessions, bounded;
each worker's newest cache generation on a receipt, a ledger from before generations too."""

from __future__ import annotations

import sqlite3
from contextlib import closing
from pathlib import Path

from sqlite_utils import Database

from appliance.domain.records import (
    CacheReceipt,
    CacheTier,
    SessionId,
    SessionRecord,
    TaskEvent,
    TaskEventType,
    TaskId,
    TaskRecord,
    TenantId,
    TurnId,
    TurnOutcome,
    TurnRecord,
    WorkerId,
)
from appliance.ledger import LedgerWriter
from appliance.ledger.restore import (
    TurnGap,
    open_tasks,
    receipt_generations,
    recent_sessions,
    session_gaps,
)
from appliance.ledger.schema import migrations

T = TenantId("t")


def turn(n: int, task: str, at: float) -> TurnRecord:
    return TurnRecord(
        TurnId(f"u{n}"),
        T,
        TaskId(task),
        None,
        WorkerId("w0"),
        "m",
        100,
        40,
        5,
        TurnOutcome.OK,
        at,
        at + 1,
    )


def test_open_named_tasks_and_recent_sessions_come_back(tmp_path: Path) -> None:
    path = tmp_path / "ledger.db"
    with LedgerWriter.open(path) as ledger:
        for task, at in [("t/root", 10.0), ("t/old", 1.0), ("t/done", 10.0), ("t/turn-abc", 10.0)]:
            ledger.record_task(TaskRecord(TaskId(task), T, at))
        ledger.record_task(TaskRecord(TaskId("t/kid"), T, 11.0, parent_task_id=TaskId("t/root")))
        ledger.record_task_event(TaskEvent(TaskId("t/done"), TaskEventType.SUCCEEDED, 12.0))
        ledger.record_turn(turn(1, "t/root", 20.0))
        ledger.record_turn(turn(2, "t/root", 30.0))
        for sid, at in [("t/s-new", 50.0), ("t/s-mid", 40.0), ("t/s-old", 2.0)]:
            ledger.record_session(
                SessionRecord(SessionId(sid), T, at, TaskId("t/root"), WorkerId("w1"), at)
            )
        ledger.flush()
    tasks = open_tasks(path, since=5.0, limit=10)
    assert [t.task_id for t in tasks] == ["t/root", "t/kid"]  # parents first; no done, old, turn-
    root = tasks[0]
    sums = (root.turns, root.prompt_tokens, root.cached_tokens, root.output_tokens)
    assert sums == (2, 200, 80, 10)
    assert [t.task_id for t in open_tasks(path, since=5.0, limit=1)] == ["t/root"]  # newest
    sessions = recent_sessions(path, since=5.0, limit=10)
    assert [(s.session_id, s.worker) for s in sessions] == [("s-mid", "w1"), ("s-new", "w1")]
    assert [s.session_id for s in recent_sessions(path, since=0.0, limit=1)] == ["s-new"]


def test_the_waits_between_sessions_turns_come_back_for_the_reaper(tmp_path: Path) -> None:
    path = tmp_path / "ledger.db"

    def at(n: int, session: str | None, task: str, start: float, ok: bool = True) -> TurnRecord:
        outcome = TurnOutcome.OK if ok else TurnOutcome.FAILED
        return TurnRecord(
            TurnId(f"g{n}"),
            T,
            TaskId(task),
            SessionId(session) if session else None,
            WorkerId("w0"),
            "m",
            100,
            40,
            5,
            outcome,
            start,
            start + 1,
        )

    with LedgerWriter.open(path) as ledger:
        for task in ("t/a", "t/turn-x", "t/b"):
            ledger.record_task(TaskRecord(TaskId(task), T, 0.0))
        for record in [
            at(1, "s1", "t/a", 10.0),  # ends 11, next at 14: 3 s
            at(2, "s1", "t/a", 14.0),  # ends 15, next at 25: 10 s
            at(3, "s1", "t/a", 20.0, ok=False),  # failed attempts are no turns
            at(4, "s1", "t/a", 25.0),  # ends 26, no next: waited 74 s by now
            at(5, None, "t/turn-x", 30.0),  # a task of one turn: no session
            at(6, None, "t/b", 40.0),  # the session of task b, keyed by its task
        ]:
            ledger.record_turn(record)
        ledger.flush()
    gaps = session_gaps(path, since=0.0, now=100.0, limit=100)
    assert gaps == [
        TurnGap("t", 1, 3.0, True),
        TurnGap("t", 2, 10.0, True),
        TurnGap("t", 3, 74.0, False),
        TurnGap("t", 1, 59.0, False),
    ]
    assert session_gaps(path, since=0.0, now=100.0, limit=1) == [TurnGap("t", 1, 59.0, False)]
    assert session_gaps(path, since=30.0, now=100.0, limit=10) == [TurnGap("t", 1, 59.0, False)]


def test_each_workers_newest_receipt_generation_comes_back(tmp_path: Path) -> None:
    path = tmp_path / "ledger.db"
    with closing(sqlite3.connect(path)) as conn:  # a ledger from before generations
        migrations.apply(Database(conn), stop_before=["0005_receipt_generation"])
        conn.execute(
            "INSERT INTO cache_receipts (prefix_digest, token_count, model, runtime_identity, "
            "tenant_domain, worker, tier, created_at, last_used_at) "
            "VALUES ('old', 64, 'm', 'rt', 't', 'w2', 'gpu', 1.0, 1.0)"
        )
        conn.commit()
    with LedgerWriter.open(path) as ledger:  # migrates it
        for digest, worker, generation in [("a", "w0", 1), ("b", "w0", 3), ("c", "w1", 0)]:
            w = WorkerId(worker)
            receipt = CacheReceipt(
                digest, 64, "m", "rt", "t", w, CacheTier.GPU, 2.0, 2.0, generation
            )
            ledger.record_cache_receipt(receipt)
        ledger.flush()
    assert receipt_generations(path) == {"w0": 3, "w1": 0}  # w2's receipt names none
