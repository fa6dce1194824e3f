"""What a restarted appliance takes back from its ledger (read-only): the open tasks the
clients named, and the sessions active lately, so a task created before a restart is still
found (and not created twice), and a session's next turn goes where its prefix may still be;
the waits between sessions' turns, which the idle reaper's survival model learns from; and
each worker's newest cache generation on a receipt, which the new KV index continues from.

Turns without a task id are tasks of one turn of their own (`turn-...`): they are not taken
back. Both lists are bounded (the newest `limit` active since `since`); a session's prefix
chain is not stored, so its next turn is tokenised and hashed whole.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import NamedTuple, cast

from appliance.domain.errors import LedgerError
from appliance.domain.records import OpenTask, RecentSession, WorkerId
from appliance.ledger.connections import open_reader

ONE_TURN_PREFIX = "turn-"

_OPEN_TASKS = """SELECT t.task_id, t.tenant, t.parent_task_id, t.task_class, t.created_at,
        t.deadline_at, count(u.turn_id), coalesce(sum(u.prompt_tokens), 0),
        coalesce(sum(u.cached_tokens), 0), coalesce(sum(u.output_tokens), 0),
        coalesce(sum(u.cost), 0.0), max(coalesce(u.finished_at, t.created_at), t.created_at)
    FROM tasks t LEFT JOIN turns u ON u.task_id = t.task_id
    WHERE t.status = 'open' AND substr(t.task_id, length(t.tenant) + 2, 5) != ?
    GROUP BY t.task_id
    HAVING max(coalesce(u.finished_at, t.created_at), t.created_at) >= ?
    ORDER BY 12 DESC LIMIT ?"""

_SESSIONS = """SELECT session_id, tenant, task_id, worker, created_at, last_active_at
    FROM sessions WHERE coalesce(last_active_at, created_at) >= ?
    ORDER BY coalesce(last_active_at, created_at) DESC LIMIT ?"""


def open_tasks(path: str | Path, *, since: float, limit: int) -> list[OpenTask]:
    """Open tasks a client named, active since `since`, oldest first (parents first)."""
    rows = _read(path, _OPEN_TASKS, (ONE_TURN_PREFIX, since, limit))
    tasks = [OpenTask(*row[:11]) for row in rows]
    return sorted(tasks, key=lambda t: t.created_at)


def recent_sessions(path: str | Path, *, since: float, limit: int) -> list[RecentSession]:
    """Sessions active since `since`, least recently active first."""
    rows = _read(path, _SESSIONS, (since, limit))
    return [
        RecentSession(sid.split("/", 1)[-1], tenant, task, worker, created, last)
        for sid, tenant, task, worker, created, last in reversed(rows)
    ]


_GAPS = """SELECT tenant, depth, finished_at, next_started FROM (
        SELECT tenant, finished_at,
            lead(started_at) OVER turns_of AS next_started, row_number() OVER turns_of AS depth
        FROM (SELECT tenant, started_at, finished_at,
                coalesce(session_id, 'task:' || task_id) AS session
            FROM turns
            WHERE outcome = 'ok' AND finished_at >= ? AND (session_id IS NOT NULL
                OR substr(task_id, length(tenant) + 2, 5) != ?))
        WINDOW turns_of AS (PARTITION BY tenant, session ORDER BY started_at))
    ORDER BY finished_at DESC LIMIT ?"""


class TurnGap(NamedTuple):
    """The wait after a session's `depth`-th turn: `seconds` until its next turn began, or,
    when none has (`returned` False), the seconds it has waited so far."""

    tenant: str
    depth: int
    seconds: float
    returned: bool


def session_gaps(path: str | Path, *, since: float, now: float, limit: int) -> list[TurnGap]:
    """The waits after sessions' turns that ended since `since` (the newest `limit`), oldest
    first. Tasks of one turn are no sessions: nothing comes back to them."""
    rows = _read(path, _GAPS, (since, ONE_TURN_PREFIX, limit))
    gaps = []
    for row in reversed(rows):
        tenant, depth, finished_at, next_started = cast(tuple[str, int, float, float | None], row)
        end = now if next_started is None else next_started
        gaps.append(TurnGap(tenant, depth, max(0.0, end - finished_at), next_started is not None))
    return gaps


_GENERATIONS = """SELECT worker, max(generation) FROM cache_receipts
    WHERE generation IS NOT NULL GROUP BY worker"""


def receipt_generations(path: str | Path) -> dict[WorkerId, int]:
    """Per worker, the newest cache generation a receipt of it names."""
    return {WorkerId(str(w)): int(cast(int, g)) for w, g in _read(path, _GENERATIONS, ())}


def _read(path: str | Path, sql: str, params: tuple[object, ...]) -> list[tuple[object, ...]]:
    conn = open_reader(path)
    try:
        return list(conn.execute(sql, params).fetchall())
    except sqlite3.Error as exc:
        raise LedgerError(f"ledger {path}: cannot read what to restore ({exc})") from None
    finally:
        conn.close()
