"""Tasks the task book no longer holds, read back from the ledger file (read-only; it works
while the appliance writes): one task by id, so a turn, event or child naming a task the book
forgot (or one that closed before a restart) is answered as the ledger says; and a task's
tree, which `GET /v1/tasks/{id}` shows for such a task.

`find` keeps one reader connection and is called on the event loop: a primary-key read of a
few tens of microseconds, made only for an id the book does not hold. `tree` opens its own
connection and is meant for a thread.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

from appliance.domain.errors import LedgerError
from appliance.domain.records import ArchivedTask, TaskStatus
from appliance.ledger.connections import open_reader

MAX_TREE_TASKS = 10_000
"""The most tasks `tree` reads (root first, breadth first): a bound on one request's work."""

_TASK = """SELECT t.task_id, t.tenant, t.parent_task_id, t.task_class, t.created_at,
        t.deadline_at, count(u.turn_id), coalesce(sum(u.prompt_tokens), 0),
        coalesce(sum(u.cached_tokens), 0), coalesce(sum(u.output_tokens), 0),
        coalesce(sum(u.cost), 0.0)
            + (SELECT coalesce(sum(e.cost), 0.0) FROM task_events e WHERE e.task_id = t.task_id),
        t.status, t.verified
    FROM tasks t LEFT JOIN turns u ON u.task_id = t.task_id
    WHERE t.task_id = ? GROUP BY t.task_id"""
_CHILDREN = "SELECT task_id FROM tasks WHERE parent_task_id = ? ORDER BY created_at, task_id"


class TaskHistory:
    def __init__(self, path: str | Path) -> None:
        self._path = path
        self._reader: sqlite3.Connection | None = None

    def find(self, task_id: str) -> ArchivedTask | None:
        """The task as the ledger keeps it (`task_id`: tenant/client id); None: never made."""
        if self._reader is None:
            self._reader = open_reader(self._path)
        try:
            return _task(self._reader, task_id)
        except sqlite3.Error as exc:
            self.close()
            raise LedgerError(f"ledger {self._path}: cannot read it ({exc}); try again") from None

    def tree(self, task_id: str) -> list[ArchivedTask]:
        """The task and its descendants, parents before children (empty: never made)."""
        conn = open_reader(self._path)
        try:
            found: list[ArchivedTask] = []
            todo = [task_id]
            while todo and len(found) < MAX_TREE_TASKS:
                task = _task(conn, todo.pop(0))
                if task is not None:
                    found.append(task)
                    todo += [r[0] for r in conn.execute(_CHILDREN, (task.task_id,))]
            return found
        except sqlite3.Error as exc:
            raise LedgerError(f"ledger {self._path}: cannot read it ({exc}); try again") from None
        finally:
            conn.close()

    def close(self) -> None:
        if self._reader is not None:
            self._reader.close()
            self._reader = None


def _task(conn: sqlite3.Connection, task_id: str) -> ArchivedTask | None:
    row = conn.execute(_TASK, (task_id,)).fetchone()
    if row is None:
        return None
    *fields, status, verified = row
    return ArchivedTask(
        *fields, status=TaskStatus(status), verified=None if verified is None else bool(verified)
    )
