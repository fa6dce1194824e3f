"""A ledger written before `done` existed migrates: `0008_one_turn_tasks_done` rebuilds
`tasks` and `task_events` so their CHECKs allow it, every row keeps every value and the
indexes are there again; the one-turn tasks that ledger left open stay open (and are still
not taken back), and can now be closed `done`."""

from __future__ import annotations

import sqlite3
from contextlib import closing
from pathlib import Path

import pytest
from sqlite_utils import Database

from appliance.domain.records import TaskEvent, TaskEventType, TaskId, TaskRecord, TenantId
from appliance.ledger import LedgerWriter, open_reader
from appliance.ledger.reports import cost_report
from appliance.ledger.restore import open_tasks
from appliance.ledger.schema import KNOWN, SCHEMA_VERSION, migrations

NEW = "0008_one_turn_tasks_done"
TASKS = [  # task_id, tenant, parent, class, status, verified, evidence, created, finished,
    # deadline, budget, max_children
    ("t/job", "t", None, "fix", "succeeded", 1, "run 7", 1.0, 9.0, 50.0, 2.5, 4),
    ("t/kid", "t", "t/job", None, "cancelled", None, "discarded: job", 2.0, 8.0, None, None, None),
    ("t/turn-aa", "t", None, None, "open", None, None, 3.0, None, None, None, None),
    ("t/turn-bb", "t", None, None, "open", None, None, 4.0, None, 40.0, None, None),
    ("t/agent", "t", None, "chat", "open", None, None, 5.0, None, None, None, 2),
]
EVENTS = [  # event_id, task_id, type, at, verified, evidence, tool_class, expected_s, cost
    (1, "t/job", "tool_started", 3.0, None, None, "pytest", 12.0, 0.0),
    (2, "t/job", "tool_finished", 4.0, None, None, "pytest", None, 0.25),
    (5, "t/kid", "cancelled", 8.0, None, "discarded: job", None, None, 0.0),
    (9, "t/job", "succeeded", 9.0, 1, "run 7", None, None, 0.0),
]


def old_ledger(path: Path) -> None:
    """A ledger as the build before `done` left it, with its rows."""
    with closing(sqlite3.connect(path, isolation_level=None)) as conn:
        migrations.apply(Database(conn), stop_before=NEW)
        conn.executemany(f"INSERT INTO tasks VALUES ({', '.join('?' * 12)})", TASKS)
        conn.executemany(f"INSERT INTO task_events VALUES ({', '.join('?' * 9)})", EVENTS)
        with pytest.raises(sqlite3.IntegrityError):  # the old CHECK: no `done`
            conn.execute("UPDATE tasks SET status = 'done' WHERE task_id = 't/turn-aa'")


def rows(path: Path, table: str) -> list[tuple[object, ...]]:
    with closing(sqlite3.connect(path)) as conn:
        return conn.execute(f"SELECT * FROM {table} ORDER BY 1").fetchall()


def indexes(path: Path) -> dict[str, str]:
    with closing(sqlite3.connect(path)) as conn:
        found = conn.execute(
            "SELECT name, tbl_name FROM sqlite_master WHERE type = 'index' AND sql IS NOT NULL"
        )
        return dict(found.fetchall())


def test_an_old_ledger_migrates_and_keeps_its_tasks_and_events(tmp_path: Path) -> None:
    db = tmp_path / "ledger.db"
    old_ledger(db)
    before = rows(db, "tasks"), rows(db, "task_events")
    with LedgerWriter.open(db) as ledger:
        assert (rows(db, "tasks"), rows(db, "task_events")) == before
        assert {"tasks_parent", "tasks_created"} <= indexes(db).keys()
        assert indexes(db)["task_events_task"] == "task_events"
        with closing(sqlite3.connect(db)) as conn:
            assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == len(KNOWN)
            assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
            names = {r[0] for r in conn.execute("SELECT name FROM sqlite_master")}
            assert not {"tasks_new", "task_events_new"} & names
        # Still not taken back on a restart: one-turn tasks stay the ledger's.
        assert [t.task_id for t in open_tasks(db, since=0.0, limit=10)] == ["t/agent"]
        # An old open one-turn task can now close `done`, and a new event gets a new id.
        ledger.record_task_event(TaskEvent(TaskId("t/turn-aa"), TaskEventType.DONE, 20.0)).result()
        with closing(open_reader(db)) as conn:
            status = conn.execute(
                "SELECT status, finished_at FROM tasks WHERE task_id = 't/turn-aa'"
            ).fetchone()
            event = conn.execute("SELECT event_id, type FROM task_events WHERE at = 20").fetchone()
        assert tuple(status) == ("done", 20.0) and tuple(event) == (10, "done")
    with closing(sqlite3.connect(db)) as conn, pytest.raises(sqlite3.IntegrityError):
        conn.execute("UPDATE tasks SET status = 'closed' WHERE task_id = 't/turn-bb'")
    # The migration is applied once, named, and the ledger opens again as it is.
    with LedgerWriter.open(db):
        pass
    with closing(sqlite3.connect(db)) as conn:
        assert [r[0] for r in conn.execute("SELECT name FROM _sqlite_migrations")] == KNOWN


def test_done_is_a_task_but_never_a_success_in_the_cost_report(tmp_path: Path) -> None:
    db = tmp_path / "ledger.db"
    with LedgerWriter.open(db) as ledger:
        for name, at in (("t/job", 1.0), ("t/turn-cc", 2.0), ("t/turn-dd", 3.0)):
            ledger.record_task(TaskRecord(TaskId(name), TenantId("t"), at))
        ledger.record_task_event(TaskEvent(TaskId("t/job"), TaskEventType.SUCCEEDED, 4.0, True))
        for name in ("t/turn-cc", "t/turn-dd"):
            ledger.record_task_event(TaskEvent(TaskId(name), TaskEventType.DONE, 5.0))
        ledger.flush()
    (group,) = cost_report(db, by=["tenant"])
    assert (group["tasks"], group["succeeded"]) == (3, 1)
