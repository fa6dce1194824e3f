"""The ledger's turn sides (migration 0010): where a turn went and why, and an outside turn
priced at its endpoint's prices beside local turns priced by the ledger's price row."""

from __future__ import annotations

import sqlite3
from contextlib import closing
from pathlib import Path

import pytest
from sqlite_utils import Database

from appliance.domain.records import TaskId, TenantId, TurnId, TurnOutcome, TurnRecord, WorkerId
from appliance.ledger import LedgerWriter, open_reader
from appliance.ledger.reports import cost_report
from appliance.ledger.schema import SCHEMA_VERSION, migrations
from tests.integration.test_ledger_writes import P1


def record(turn_id: str, **kw: object) -> TurnRecord:
    fields: dict[str, object] = {
        "turn_id": TurnId(turn_id),
        "tenant": TenantId("acme"),
        "task_id": TaskId("A"),
        "session_id": None,
        "worker": WorkerId("w0"),
        "model": "m",
        "prompt_tokens": 1000,
        "cached_tokens": 400,
        "output_tokens": 100,
        "outcome": TurnOutcome.OK,
        "started_at": 9.0,
        "finished_at": 10.0,
    }
    return TurnRecord(**(fields | kw))  # type: ignore[arg-type]


def test_an_older_ledger_takes_the_side_columns_and_keeps_its_turns(tmp_path: Path) -> None:
    db = tmp_path / "ledger.db"
    with closing(sqlite3.connect(db, isolation_level=None)) as conn:
        migrations.apply(Database(conn), stop_before="0010_turn_sides")
        conn.execute(
            "INSERT INTO turns (turn_id, tenant, model, prompt_tokens, cached_tokens,"
            " fresh_tokens, output_tokens, reasoning_tokens, queue_s, e2e_s, gpu_s, outcome,"
            " started_at, finished_at, tool_cost) VALUES"
            " ('old', 'acme', 'm', 10, 0, 10, 1, 0, 0, 1, 0, 'ok', 0, 1, 0)"
        )
    LedgerWriter.open(db).close()
    with closing(open_reader(db)) as conn:
        assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
        row = conn.execute("SELECT turn_id, endpoint, route_reason FROM turns").fetchone()
    assert tuple(row) == ("old", None, None)


def test_an_outside_turn_keeps_its_own_price_and_both_sides_add_up(tmp_path: Path) -> None:
    db = tmp_path / "ledger.db"
    with LedgerWriter.open(db) as ledger:
        ledger.set_price(P1).result()
        local = ledger.record_turn(record("local")).result()
        outside = record(
            "out",
            worker=None,
            model="big",
            endpoint="frontier",
            route_reason="task class plan -> frontier",
            priced_cost=0.25,
        )
        assert ledger.record_turn(outside).result() == 0.25
    with closing(open_reader(db)) as conn:
        got = conn.execute(
            "SELECT turn_id, endpoint, route_reason, price_id IS NULL, cost FROM turns"
            " ORDER BY turn_id"
        ).fetchall()
    assert [tuple(r) for r in got] == [
        ("local", None, None, 0, pytest.approx(local)),
        ("out", "frontier", "task class plan -> frontier", 1, 0.25),
    ]
    (group,) = cost_report(db)
    assert group["attempts"] == 2 and group["cost"] == pytest.approx(local + 0.25)
