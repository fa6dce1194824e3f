"""One session's recent turns, read from the ledger file (read-only; it backs the operator's
`GET /admin/v1/sessions/{id}` and works while the appliance writes).

A session is (tenant, session id). Turns of a session the client named carry that id in
`turns.session_id`; a turn without one belongs to the session the router keys by its task,
`task:<task key>`, and is found by its task.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

from appliance.domain.errors import LedgerError
from appliance.ledger.connections import open_reader

TASK_SESSION_PREFIX = "task:"
_TURNS = """SELECT turn_id, started_at, worker, prompt_tokens, cached_tokens, output_tokens,
        ttft_s, e2e_s, cost, outcome
    FROM turns
    WHERE tenant = ? AND (session_id = ? OR (session_id IS NULL AND task_id = ?))
    ORDER BY started_at DESC, turn_id DESC
    LIMIT ?"""
_COLUMNS = (
    "turn_id",
    "started_at",
    "worker",
    "prompt_tokens",
    "cached_tokens",
    "output_tokens",
    "ttft_s",
    "e2e_s",
    "cost",
    "outcome",
)


def session_turns(
    path: str | Path, tenant: str, session_id: str, *, limit: int = 50
) -> list[dict[str, Any]]:
    """The session's newest `limit` attempts, oldest first, one dict per `turns` row."""
    task = session_id.removeprefix(TASK_SESSION_PREFIX)
    task_key = task if session_id.startswith(TASK_SESSION_PREFIX) else None
    conn = open_reader(path)
    try:
        rows = conn.execute(_TURNS, [tenant, session_id, task_key, max(limit, 0)]).fetchall()
    except sqlite3.Error as exc:
        raise LedgerError(f"ledger {path}: cannot read it ({exc}); try again") from None
    finally:
        conn.close()
    return [dict(zip(_COLUMNS, tuple(r), strict=True)) for r in reversed(rows)]
