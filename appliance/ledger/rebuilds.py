"""Migrations that rebuild a table (appliance/ledger/schema.py registers them): SQLite cannot
alter a column's CHECK, so the table is created anew, its rows copied column by column,
the old one dropped, the new one renamed and its indexes made again, all in the
migration's one transaction. Every row keeps every value.
"""

from __future__ import annotations

TASKS_WITH_DONE = (
    """CREATE TABLE tasks_new (
                task_id TEXT PRIMARY KEY,
                tenant TEXT NOT NULL,
                parent_task_id TEXT,
                task_class TEXT,
                status TEXT NOT NULL DEFAULT 'open'
                    CHECK (status IN ('open', 'succeeded', 'failed', 'cancelled', 'done')),
                verified INTEGER CHECK (verified IN (0, 1)),
                evidence TEXT,
                created_at REAL NOT NULL,
                finished_at REAL,
                deadline_at REAL,
                budget REAL,
                max_children INTEGER
            )""",
    """INSERT INTO tasks_new (task_id, tenant, parent_task_id, task_class, status, verified,
                evidence, created_at, finished_at, deadline_at, budget, max_children)
            SELECT task_id, tenant, parent_task_id, task_class, status, verified, evidence,
                created_at, finished_at, deadline_at, budget, max_children FROM tasks""",
    "DROP TABLE tasks",
    "ALTER TABLE tasks_new RENAME TO tasks",
    "CREATE INDEX tasks_parent ON tasks (parent_task_id)",
    "CREATE INDEX tasks_created ON tasks (created_at)",
    """CREATE TABLE task_events_new (
                event_id INTEGER PRIMARY KEY,
                task_id TEXT NOT NULL,
                type TEXT NOT NULL CHECK (type IN ('succeeded', 'failed', 'cancelled',
                    'tool_started', 'tool_finished', 'done')),
                at REAL NOT NULL,
                verified INTEGER CHECK (verified IN (0, 1)),
                evidence TEXT,
                tool_class TEXT,
                expected_s REAL,
                cost REAL NOT NULL DEFAULT 0
            )""",
    """INSERT INTO task_events_new (event_id, task_id, type, at, verified, evidence,
                tool_class, expected_s, cost)
            SELECT event_id, task_id, type, at, verified, evidence, tool_class, expected_s,
                cost FROM task_events""",
    "DROP TABLE task_events",
    "ALTER TABLE task_events_new RENAME TO task_events",
    "CREATE INDEX task_events_task ON task_events (task_id, at)",
    "PRAGMA user_version = 8",
)
"""Tasks and their events rebuilt, every row kept: SQLite cannot alter a CHECK, and `done`
joins the statuses and event types."""
