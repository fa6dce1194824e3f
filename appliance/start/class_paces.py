"""The task classes' paces a restarted appliance starts from (services/tasks/task_paces.py): the
newest tasks of each class that succeeded, read back from the ledger file (read-only; it
works while the appliance writes), so a turn's share of its deadline need not wait for a
class's tasks to finish again after every restart.

One query at start, bounded: tasks created since `since` (the `tasks_created` index), the
newest `per_class` of each tenant's class, at most `limit` in all, their attempts through
the `turns_task` index. A run is read from its attempts, less the failed ones (a failed
attempt is placed again): their count, the seconds they ran (summed, so overlapping turns
count twice, capped at the span they cover), the span from the first one's start to the
last one's end, and the seconds from that end to the task's close. A ledger that cannot be
read starts the history empty; it fills as tasks finish.
"""

from __future__ import annotations

import logging
import sqlite3
from pathlib import Path

from appliance.domain.errors import LedgerError
from appliance.ledger.connections import open_reader
from appliance.policy.deadline_share import TaskRun
from appliance.services.tasks.task_paces import HISTORY_RUNS, ClassRun

log = logging.getLogger(__name__)

MAX_RUNS = 10_000
"""The most finished tasks read back in all."""

_RUNS = """SELECT tenant, task_class, turns, busy_s, first_at, last_at, finished_at FROM (
        SELECT t.tenant, t.task_class, t.finished_at, count(u.turn_id) AS turns,
            sum(u.finished_at - u.started_at) AS busy_s,
            min(u.started_at) AS first_at, max(u.finished_at) AS last_at,
            row_number() OVER (PARTITION BY t.tenant, t.task_class
                ORDER BY t.finished_at DESC) AS newest
        FROM tasks t JOIN turns u ON u.task_id = t.task_id
        WHERE t.created_at >= ? AND t.status = 'succeeded' AND t.task_class IS NOT NULL
            AND t.finished_at IS NOT NULL AND u.outcome != 'failed'
        GROUP BY t.task_id)
    WHERE newest <= ? ORDER BY finished_at DESC LIMIT ?"""


def finished_runs(
    path: str | Path, *, since: float, per_class: int = HISTORY_RUNS, limit: int = MAX_RUNS
) -> list[ClassRun]:
    """(tenant, class, run) of the newest succeeded tasks of each class, oldest first."""
    try:
        conn = open_reader(path)
    except LedgerError as exc:
        log.warning("task classes' paces start empty: %s", exc.message)
        return []
    try:
        rows = conn.execute(_RUNS, (since, per_class, limit)).fetchall()
    except sqlite3.Error as exc:
        log.warning("task classes' paces start empty: ledger %s unread (%s)", path, exc)
        return []
    finally:
        conn.close()
    runs = []
    for tenant, task_class, turns, busy_s, first_at, last_at, finished_at in reversed(rows):
        span = max(0.0, last_at - first_at)
        busy = min(max(0.0, busy_s), span)
        run = TaskRun(turns, busy, span - busy, max(0.0, finished_at - last_at))
        runs.append((tenant, task_class, run))
    return runs
