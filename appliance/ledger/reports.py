"""Reports read from a ledger file, read-only (they back `appliance costs --db FILE` and work
while the appliance writes). The arithmetic is policy.costs' and policy.overhead's pure
rules; this module only reads rows."""

from __future__ import annotations

import math
import sqlite3
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from appliance.domain.errors import ConfigError, LedgerError
from appliance.domain.records import TaskStatus
from appliance.ledger.connections import open_reader
from appliance.policy.costs import GROUP_KEYS, AttemptRow, TaskRow, cost_per_success, group_row
from appliance.policy.overhead import Overhead, UsageRow, with_overhead

_TASKS = """SELECT task_id, tenant, created_at, parent_task_id, task_class, status, verified
    FROM tasks"""
# Summed per task (priced and unpriced apart): the rule only adds attempts up.
_ATTEMPTS = """SELECT task_id, tenant, min(finished_at), count(*), sum(cost), cost IS NULL,
    sum(gpu_s) FROM turns WHERE task_id IS NOT NULL GROUP BY task_id, tenant, cost IS NULL"""
_TASKLESS = "SELECT turn_id, tenant, finished_at, cost, gpu_s FROM turns WHERE task_id IS NULL"
# A task's tool costs (task events) count as its attempted cost, priced already.
_TOOLS = """SELECT e.task_id, t.tenant, min(e.at), sum(e.cost) FROM task_events e
    JOIN tasks t ON t.task_id = e.task_id WHERE e.cost > 0 GROUP BY e.task_id"""
# Each usage period's overhead (its workers' idle and energy costs, the box's), in its range.
_USAGE = """SELECT p.started_at, p.ended_at, coalesce(sum(w.idle_cost), 0.0),
    coalesce(sum(w.energy_cost), 0.0), p.box_cost FROM usage_periods p
    LEFT JOIN worker_usage w ON w.period_id = p.period_id
    WHERE p.ended_at >= ? AND p.started_at < ? GROUP BY p.period_id"""
_CURRENCY = "SELECT currency FROM prices ORDER BY effective_from DESC, price_id DESC LIMIT 1"


def cost_report(
    path: str | Path,
    *,
    by: Sequence[str] = GROUP_KEYS,
    since: float | None = None,
    until: float | None = None,
    window_s: float | None = None,
) -> list[dict[str, Any]]:
    """Cost per successful task per group, one dict per group with the same keys in the
    same order: the `by` columns, window_start (only with window_s), tasks, succeeded,
    attempts, unpriced_attempts, gpu_s, cost (direct), overhead and its parts (idle,
    energy, box), total_cost, cost_per_success (with the overhead; None: no verified
    success), direct_cost_per_success, currency.
    """
    unknown = [g for g in by if g not in GROUP_KEYS]
    if unknown:
        raise ConfigError(
            f"cost report: cannot group by {unknown[0]!r}; use task_class and/or tenant"
        )
    if window_s is not None and window_s <= 0:
        raise ConfigError(f"cost report: window {window_s}s is invalid; use a positive number")
    conn = open_reader(path)
    try:
        conn.execute("BEGIN")  # one snapshot for all the queries
        tasks, attempts, currency = _read(conn)
        usage = _usage(conn, since, until)
        conn.execute("COMMIT")
    except sqlite3.Error as exc:
        raise LedgerError(f"ledger {path}: cannot read it ({exc}); try again") from None
    finally:
        conn.close()
    groups = cost_per_success(tasks, attempts, by=by, since=since, until=until, window_s=window_s)
    groups = with_overhead(groups, usage, since=since, until=until, window_s=window_s)
    return [group_row(g, by=by, currency=currency, windowed=window_s is not None) for g in groups]


def _read(conn: sqlite3.Connection) -> tuple[list[TaskRow], list[AttemptRow], str | None]:
    tasks = [
        TaskRow(
            task_id=r[0],
            tenant=r[1],
            created_at=r[2],
            parent_task_id=r[3],
            task_class=r[4],
            status=TaskStatus(r[5]),
            verified=None if r[6] is None else bool(r[6]),
        )
        for r in conn.execute(_TASKS)
    ]
    attempts = [
        AttemptRow(r[0], r[1], r[2], None if r[5] else r[4], attempts=r[3], gpu_s=r[6] or 0.0)
        for r in conn.execute(_ATTEMPTS)
    ]
    attempts += [
        AttemptRow(None, r[1], r[2], r[3], gpu_s=r[4] or 0.0) for r in conn.execute(_TASKLESS)
    ]
    attempts += [
        AttemptRow(task_id=r[0], tenant=r[1], at=r[2], cost=r[3], attempts=0)
        for r in conn.execute(_TOOLS)
    ]
    row = conn.execute(_CURRENCY).fetchone()
    return tasks, attempts, row[0] if row else None


def _usage(conn: sqlite3.Connection, since: float | None, until: float | None) -> list[UsageRow]:
    """The usage periods that reach into [since, until)."""
    lo = -math.inf if since is None else since
    hi = math.inf if until is None else until
    return [
        UsageRow(r[0], r[1], Overhead(idle=r[2], energy=r[3], box=r[4]))
        for r in conn.execute(_USAGE, (lo, hi))
    ]
