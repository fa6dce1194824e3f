"""A session's turns read back from a real ledger file: its own, newest kept, oldest first."""

from __future__ import annotations

from pathlib import Path

from appliance.domain.records import (
    SessionId,
    TaskId,
    TenantId,
    TurnId,
    TurnOutcome,
    TurnRecord,
    WorkerId,
)
from appliance.ledger import LedgerWriter
from appliance.ledger.session_history import session_turns


def turn(turn_id: str, tenant: str, session: str | None, task: str, at: float) -> TurnRecord:
    return TurnRecord(
        turn_id=TurnId(turn_id),
        tenant=TenantId(tenant),
        task_id=TaskId(task),
        session_id=SessionId(session) if session else None,
        worker=WorkerId("w0"),
        model="m",
        prompt_tokens=100,
        cached_tokens=64,
        output_tokens=8,
        outcome=TurnOutcome.OK,
        started_at=at,
        finished_at=at + 0.5,
        ttft_s=0.1,
        e2e_s=0.5,
    )


def test_a_sessions_turns_and_no_one_elses(tmp_path: Path) -> None:
    db = tmp_path / "ledger.db"
    ledger = LedgerWriter.open(db)
    try:
        for i in range(5):
            ledger.record_turn(turn(f"a{i}", "acme", "s1", "acme/t1", 10.0 + i))
        ledger.record_turn(turn("other-tenant", "bob", "s1", "bob/t1", 12.5))
        ledger.record_turn(turn("other-session", "acme", "s2", "acme/t1", 12.6))
        ledger.record_turn(turn("by-task", "acme", None, "acme/t9", 13.0))
        ledger.flush()
    finally:
        ledger.close()

    rows = session_turns(db, "acme", "s1", limit=3)
    assert [r["turn_id"] for r in rows] == ["a2", "a3", "a4"]
    assert rows[0] | {"cost": None} == {
        "turn_id": "a2",
        "started_at": 12.0,
        "worker": "w0",
        "prompt_tokens": 100,
        "cached_tokens": 64,
        "output_tokens": 8,
        "ttft_s": 0.1,
        "e2e_s": 0.5,
        "cost": None,
        "outcome": "ok",
    }
    assert [r["turn_id"] for r in session_turns(db, "bob", "s1")] == ["other-tenant"]
    # A turn without a session id belongs to the session the router keys by its task.
    assert [r["turn_id"] for r in session_turns(db, "acme", "task:acme/t9")] == ["by-task"]
    assert session_turns(db, "acme", "nope") == []
