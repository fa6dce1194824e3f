"""What the writer stores and when it acknowledges, against real SQLite files."""

from __future__ import annotations

import asyncio
import sqlite3
import time
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest

from appliance.domain.errors import LedgerError
from appliance.domain.records import (
    AdmissionEvent,
    CacheEviction,
    CacheReceipt,
    CacheTier,
    CostMode,
    Price,
    ResidencyEvent,
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
from appliance.ledger import AsyncLedger, LedgerWriter, open_reader
from appliance.ledger.reports import cost_report


@pytest.fixture
def db(tmp_path: Path) -> Path:
    return tmp_path / "ledger.db"


@pytest.fixture
def ledger(db: Path) -> Iterator[LedgerWriter]:
    led = LedgerWriter.open(db)
    yield led
    led.close()


def rows(db: Path, sql: str, *params: Any) -> list[dict[str, Any]]:
    with closing(open_reader(db)) as conn:
        return [dict(r) for r in conn.execute(sql, params)]


def task(task_id: str, created_at: float, **kw: Any) -> TaskRecord:
    return TaskRecord(TaskId(task_id), kw.pop("tenant", TenantId("acme")), created_at, **kw)


def turn(turn_id: str, task_id: str | None, finished_at: float, **kw: Any) -> TurnRecord:
    fields: dict[str, Any] = {
        "turn_id": TurnId(turn_id),
        "tenant": TenantId("acme"),
        "task_id": TaskId(task_id) if task_id else None,
        "session_id": None,
        "worker": WorkerId("w0"),
        "model": "m",
        "prompt_tokens": 1000,
        "cached_tokens": 400,
        "output_tokens": 100,
        "outcome": TurnOutcome.OK,
        "started_at": finished_at - 1.0,
        "finished_at": finished_at,
    }
    return TurnRecord(**(fields | kw))


def event(task_id: str, kind: TaskEventType, at: float, **kw: Any) -> TaskEvent:
    return TaskEvent(TaskId(task_id), kind, at, **kw)


# fresh 2.0, cached 0.5, output 10.0 per million tokens
P1 = Price(CostMode.TOKENS, 0.0, fresh_per_mtok=2.0, cached_per_mtok=0.5, output_per_mtok=10.0)
# from t=1000 all doubled
P2 = Price(CostMode.TOKENS, 1000.0, fresh_per_mtok=4.0, cached_per_mtok=1.0, output_per_mtok=20.0)


def test_a_turn_is_stored_with_its_price_and_cost(ledger: LedgerWriter, db: Path) -> None:
    price_id = ledger.set_price(P1).result()
    t = turn(
        "u1",
        "A",
        10.0,
        session_id=SessionId("s1"),
        reasoning_tokens=7,
        queue_s=0.5,
        ttft_s=0.25,
        e2e_s=1.0,
        gpu_s=0.75,
        predicted_cached_tokens=512,
        tool_cost=0.5,
        parent_task_id=TaskId("P"),
        outcome=TurnOutcome.DISCARDED,
    )
    # 600 fresh*2 + 400 cached*0.5 + (100 out - 7 reasoning)*10 + 7 reasoning*0 (P1 has no
    # reasoning price) = 2330 / 1M = 0.00233, + tool 0.5 = 0.50233
    assert ledger.record_turn(t).result() == pytest.approx(0.50233)
    (row,) = rows(db, "SELECT * FROM turns")
    assert row == {
        "turn_id": "u1",
        "tenant": "acme",
        "task_id": "A",
        "session_id": "s1",
        "parent_task_id": "P",
        "worker": "w0",
        "model": "m",
        "prompt_tokens": 1000,
        "cached_tokens": 400,
        "fresh_tokens": 600,
        "output_tokens": 100,
        "reasoning_tokens": 7,
        "predicted_cached_tokens": 512,
        "queue_s": 0.5,
        "ttft_s": 0.25,
        "e2e_s": 1.0,
        "gpu_s": 0.75,
        "outcome": "discarded",
        "error": None,
        "started_at": 9.0,
        "finished_at": 10.0,
        "tool_cost": 0.5,
        "price_id": price_id,
        "cost": pytest.approx(0.50233),
        "endpoint": None,
        "route_reason": None,
    }


def test_a_turn_before_any_price_is_unpriced(ledger: LedgerWriter, db: Path) -> None:
    assert ledger.record_turn(turn("u1", "A", 10.0)).result() is None
    assert rows(db, "SELECT price_id, cost FROM turns") == [{"price_id": None, "cost": None}]


def test_a_price_change_never_rewrites_history(ledger: LedgerWriter, db: Path) -> None:
    p1 = ledger.set_price(P1).result()
    ledger.record_task(task("A", 100.0, task_class="code")).result()
    ledger.record_turn(turn("old", "A", 500.0)).result()
    before = rows(db, "SELECT * FROM turns")
    p2 = ledger.set_price(P2).result()
    assert p2 != p1
    assert ledger.set_price(P2).result() == p2  # same rates again: no new version
    ledger.record_turn(turn("late", "A", 900.0)).result()  # ended before P2 took effect
    ledger.record_turn(turn("new", "A", 1500.0, outcome=TurnOutcome.FAILED)).result()
    ledger.record_task_event(event("A", TaskEventType.SUCCEEDED, 1600.0, verified=True)).result()

    assert rows(db, "SELECT * FROM turns WHERE turn_id = 'old'") == before
    got = {r["turn_id"]: r for r in rows(db, "SELECT turn_id, price_id, cost FROM turns")}
    # 0.0024 at P1 (old, late); 0.0048 at P2 (new)
    assert got["old"] == {"turn_id": "old", "price_id": p1, "cost": pytest.approx(0.0024)}
    assert got["late"] == {"turn_id": "late", "price_id": p1, "cost": pytest.approx(0.0024)}
    assert got["new"] == {"turn_id": "new", "price_id": p2, "cost": pytest.approx(0.0048)}
    assert len(rows(db, "SELECT * FROM prices")) == 2
    # One verified success: 0.0024 + 0.0024 + 0.0048 = 0.0096 per success.
    assert cost_report(db) == [
        {
            "task_class": "code",
            "tenant": "acme",
            "tasks": 1,
            "succeeded": 1,
            "attempts": 3,
            "unpriced_attempts": 0,
            "gpu_s": 0.0,
            "cost": pytest.approx(0.0096),
            "overhead": 0.0,
            "overhead_idle": 0.0,
            "overhead_energy": 0.0,
            "overhead_box": 0.0,
            "total_cost": pytest.approx(0.0096),
            "cost_per_success": pytest.approx(0.0096),
            "direct_cost_per_success": pytest.approx(0.0096),
            "currency": "USD",
        }
    ]


def test_cost_report_rolls_fan_out_into_the_root(ledger: LedgerWriter, db: Path) -> None:
    ledger.set_price(P1)
    ledger.record_task(task("R", 100.0, task_class="code"))
    ledger.record_task(task("R1", 101.0, parent_task_id=TaskId("R"), task_class="sub"))
    ledger.record_task(task("R2", 102.0, parent_task_id=TaskId("R"), task_class="sub"))
    ledger.record_task(task("X", 103.0, task_class="code"))
    ledger.record_turn(turn("r", "R", 110.0))  # 0.0024
    ledger.record_turn(turn("r1", "R1", 111.0))  # 0.0024
    # discarded branch, cached 0 / fresh 1000: 1000*2 + 100*10 = 3000 / 1M = 0.003
    ledger.record_turn(turn("r2", "R2", 112.0, cached_tokens=0, outcome=TurnOutcome.DISCARDED))
    ledger.record_turn(turn("x", "X", 113.0, outcome=TurnOutcome.FAILED))  # 0.0024
    ledger.record_task_event(event("R1", TaskEventType.SUCCEEDED, 120.0, verified=True))
    ledger.record_task_event(event("R2", TaskEventType.CANCELLED, 121.0))
    ledger.record_task_event(event("R", TaskEventType.SUCCEEDED, 122.0, verified=True))
    ledger.record_task_event(event("X", TaskEventType.FAILED, 123.0))
    ledger.flush()
    # roots R and X; one success; 0.0024 + 0.0024 + 0.003 + 0.0024 = 0.0102
    (row,) = cost_report(db)
    assert (row["task_class"], row["tasks"], row["succeeded"], row["attempts"]) == ("code", 2, 1, 4)
    assert row["cost_per_success"] == pytest.approx(0.0102)
    (row,) = cost_report(db, by=("tenant",), since=103.0)  # only X's tree: no success
    assert (row["tasks"], row["cost"], row["cost_per_success"]) == (1, pytest.approx(0.0024), None)
    assert cost_report(db, since=200.0) == []


def test_terminal_states_are_final(ledger: LedgerWriter, db: Path) -> None:
    ledger.record_task(task("A", 1.0)).result()
    ledger.record_task_event(event("A", TaskEventType.TOOL_STARTED, 2.0, tool_class="pytest"))
    ledger.record_task_event(
        event("A", TaskEventType.SUCCEEDED, 3.0, verified=True, evidence="ci#12")
    ).result()
    with pytest.raises(LedgerError, match="already succeeded"):
        ledger.record_task_event(event("A", TaskEventType.FAILED, 4.0)).result()
    with pytest.raises(LedgerError, match="record the task first"):
        ledger.record_task_event(event("nope", TaskEventType.CANCELLED, 4.0)).result()
    (row,) = rows(db, "SELECT status, verified, evidence, finished_at FROM tasks")
    assert row == {"status": "succeeded", "verified": 1, "evidence": "ci#12", "finished_at": 3.0}
    assert [r["type"] for r in rows(db, "SELECT type FROM task_events ORDER BY event_id")] == [
        "tool_started",
        "succeeded",
    ]


def test_a_rejected_write_fails_alone(ledger: LedgerWriter, db: Path) -> None:
    futures = [
        ledger.record_turn(turn("a", "T", 1.0)),
        ledger.record_turn(turn("a", "T", 2.0)),  # duplicate id
        ledger.record_task(task("T", 0.0)),
        ledger.record_task(task("T", 0.5)),  # duplicate id
        ledger.record_turn(turn("b", "T", 3.0)),
    ]
    outcomes = [f.exception(timeout=10) for f in futures]
    assert [type(e).__name__ if e else None for e in outcomes] == [
        None,
        "LedgerError",
        None,
        "LedgerError",
        None,
    ]
    assert "UNIQUE" in str(outcomes[1])
    assert [r["turn_id"] for r in rows(db, "SELECT turn_id FROM turns ORDER BY turn_id")] == [
        "a",
        "b",
    ]


def hold_write_lock(db: Path) -> sqlite3.Connection:
    other = sqlite3.connect(db, isolation_level=None)
    other.execute("BEGIN IMMEDIATE")
    return other


def test_a_future_resolves_only_after_the_commit(ledger: LedgerWriter, db: Path) -> None:
    other = hold_write_lock(db)  # another process-like writer holds the lock
    first = ledger.record_turn(turn("first", None, 1.0))
    time.sleep(0.3)  # the writer took `first` and waits for the lock
    withdrawn = ledger.record_turn(turn("withdrawn", None, 2.0))
    assert withdrawn.cancel()  # not picked up yet: cancelling withdraws it
    kept = ledger.record_turn(turn("kept", None, 3.0))
    assert not first.done() and not kept.done()
    assert rows(db, "SELECT turn_id FROM turns") == []
    other.execute("COMMIT")
    other.close()
    first.result(timeout=10)
    kept.result(timeout=10)
    assert [r["turn_id"] for r in rows(db, "SELECT turn_id FROM turns ORDER BY turn_id")] == [
        "first",
        "kept",
    ]


def test_a_lock_held_past_the_busy_timeout_fails_the_batch(db: Path) -> None:
    with LedgerWriter.open(db, busy_timeout_s=0.2) as ledger:
        other = hold_write_lock(db)
        with pytest.raises(LedgerError, match="cannot start a write transaction"):
            ledger.record_turn(turn("lost", None, 1.0)).result(timeout=10)
        other.execute("ROLLBACK")
        other.close()
        ledger.record_turn(turn("next", None, 2.0)).result(timeout=10)
    assert [r["turn_id"] for r in rows(db, "SELECT turn_id FROM turns")] == ["next"]


def test_close_commits_what_was_queued_then_refuses(db: Path) -> None:
    ledger = LedgerWriter.open(db, batch_max=7)  # many small batches
    futures = [ledger.record_turn(turn(f"t{i}", None, float(i))) for i in range(500)]
    ledger.close()
    assert all(f.done() and f.exception() is None for f in futures)
    assert rows(db, "SELECT count(*) AS n FROM turns") == [{"n": 500}]
    with pytest.raises(LedgerError, match="closed"):
        ledger.record_turn(turn("late", None, 1.0))
    ledger.close()  # idempotent


def test_sessions_receipts_and_decisions(ledger: LedgerWriter, db: Path) -> None:
    s = SessionRecord(SessionId("s1"), TenantId("acme"), 1.0, task_id=TaskId("A"))
    ledger.record_session(s)
    ledger.record_session(
        SessionRecord(
            SessionId("s1"), TenantId("acme"), 9.0, worker=WorkerId("w1"), last_active_at=5.0
        )
    )
    receipt = CacheReceipt(
        "ab12",
        4096,
        "m",
        "vllm-0.11/bs16/sha256_cbor",
        "acme",
        WorkerId("w1"),
        CacheTier.GPU,
        created_at=2.0,
        last_used_at=2.0,
    )
    ledger.record_cache_receipt(receipt)
    ledger.record_cache_receipt(CacheReceipt(**{**_fields(receipt), "last_used_at": 7.0}))
    ledger.record_cache_receipt(CacheReceipt(**{**_fields(receipt), "last_used_at": 3.0}))
    ledger.record_cache_receipt(CacheReceipt(**{**_fields(receipt), "tier": CacheTier.HOST}))
    ledger.record_residency_event(
        ResidencyEvent(
            6.0, SessionId("s1"), WorkerId("w1"), "demote", "idle 30s", 4096, CacheTier.HOST
        )
    )
    ledger.record_admission_event(
        AdmissionEvent(0.5, TenantId("acme"), "deny", "over budget", TaskId("A"), queue_depth=3)
    )
    ledger.flush()
    assert rows(db, "SELECT * FROM sessions") == [
        {
            "session_id": "s1",
            "tenant": "acme",
            "task_id": "A",
            "worker": "w1",
            "created_at": 1.0,
            "last_active_at": 5.0,
        },
    ]
    got = rows(db, "SELECT tier, created_at, last_used_at FROM cache_receipts ORDER BY tier")
    assert got == [
        {"tier": "gpu", "created_at": 2.0, "last_used_at": 7.0},  # never moves back
        {"tier": "host", "created_at": 2.0, "last_used_at": 2.0},
    ]
    assert rows(db, "SELECT action, reason, tokens, tier FROM residency_events") == [
        {"action": "demote", "reason": "idle 30s", "tokens": 4096, "tier": "host"}
    ]
    assert rows(db, "SELECT decision, reason, queue_depth FROM admission_events") == [
        {"decision": "deny", "reason": "over budget", "queue_depth": 3}
    ]


def test_an_eviction_marks_its_receipt_until_the_prefix_is_cached_again(
    ledger: LedgerWriter, db: Path
) -> None:
    receipt = CacheReceipt("ab12", 4096, "m", "rt", "acme", WorkerId("w1"), CacheTier.GPU, 2.0, 2.0)
    ledger.record_cache_receipt(receipt)
    other = CacheReceipt(**{**_fields(receipt), "worker": WorkerId("w2")})
    ledger.record_cache_receipt(other)
    for at, cause in ((5.0, "lru"), (6.0, "pressure")):  # the first eviction stands
        eviction = CacheEviction("ab12", "m", "rt", "acme", WorkerId("w1"), at, cause)
        ledger.record_cache_eviction(eviction)
    ledger.record_residency_event(
        ResidencyEvent(
            5.0,
            SessionId("acme/s"),
            WorkerId("w1"),
            "evicted",
            "lru: ...",
            96,
            CacheTier.GPU,
            figures_json='{"kind": "lru"}',
        )
    )
    ledger.flush()
    query = "SELECT worker, evicted_at, evicted_cause FROM cache_receipts ORDER BY worker"
    assert rows(db, query) == [
        {"worker": "w1", "evicted_at": 5.0, "evicted_cause": "lru"},
        {"worker": "w2", "evicted_at": None, "evicted_cause": None},
    ]
    assert rows(db, "SELECT action, figures FROM residency_events") == [
        {"action": "evicted", "figures": '{"kind": "lru"}'}
    ]
    ledger.record_cache_receipt(CacheReceipt(**{**_fields(receipt), "last_used_at": 9.0}))
    ledger.flush()
    assert rows(db, query)[0] == {"worker": "w1", "evicted_at": None, "evicted_cause": None}


def test_a_receipt_keeps_the_newest_cache_generation_it_was_renewed_in(
    ledger: LedgerWriter, db: Path
) -> None:
    first = CacheReceipt("ab12", 4096, "m", "rt", "acme", WorkerId("w1"), CacheTier.GPU, 2.0, 2.0)
    ledger.record_cache_receipt(first)
    ledger.record_cache_eviction(CacheEviction("ab12", "m", "rt", "acme", first.worker, 3.0, "lru"))
    ledger.flush()
    query = "SELECT token_count, generation, evicted_cause FROM cache_receipts"
    assert rows(db, query) == [{"token_count": 4096, "generation": 0, "evicted_cause": "lru"}]
    # Cached again after two resets of the worker's cache, then a late write of the first.
    again = {**_fields(first), "generation": 2, "token_count": 4160, "last_used_at": 9.0}
    ledger.record_cache_receipt(CacheReceipt(**again))
    ledger.record_cache_receipt(first)
    ledger.flush()
    assert rows(db, query) == [{"token_count": 4096, "generation": 2, "evicted_cause": None}]


def _fields(receipt: CacheReceipt) -> dict[str, Any]:
    return {name: getattr(receipt, name) for name in receipt.__slots__}


def test_the_async_wrapper_acknowledges_and_survives_cancellation(db: Path) -> None:
    async def main() -> None:
        aledger = AsyncLedger(LedgerWriter.open(db))
        await aledger.set_price(P1)
        await aledger.record_task(task("A", 1.0))
        assert await aledger.record_turn(turn("u1", "A", 2.0)) == pytest.approx(0.0024)
        other = hold_write_lock(db)
        aledger.ledger.record_turn(turn("u0", "A", 1.5))  # the writer takes it and stalls
        await asyncio.sleep(0.2)
        # u2 now waits in the queue; cancelling its awaiter must not withdraw it.
        waiting = asyncio.create_task(aledger.record_turn(turn("u2", "A", 3.0)))
        await asyncio.sleep(0.1)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        other.execute("COMMIT")
        other.close()
        await aledger.flush()
        await aledger.close()

    asyncio.run(main())
    # The cancelled caller's turn was still recorded.
    assert [r["turn_id"] for r in rows(db, "SELECT turn_id FROM turns ORDER BY turn_id")] == [
        "u0",
        "u1",
        "u2",
    ]
