"""The box's usage periods in a real ledger file: stored with their overhead priced at the
version in effect at their end, all or nothing, migrated into an older ledger, and spread
by `cost_report` over the groups by GPU-seconds, figures worked out by hand."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from contextlib import closing
from dataclasses import replace
from pathlib import Path

import pytest
from sqlite_utils import Database

from appliance.domain.errors import LedgerError
from appliance.domain.records import (
    CostMode,
    Price,
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
from appliance.domain.usage import UsagePeriod, WorkerUsage
from appliance.ledger import LedgerWriter, open_reader
from appliance.ledger.reports import cost_report
from appliance.ledger.rows import load_prices
from appliance.ledger.schema import SCHEMA_VERSION, migrations

W0, W1 = WorkerId("w0"), WorkerId("w1")
# 0.001 per GPU-second, 0.30 per kWh, 3.60 per box-hour (0.001 per box-second).
GPU = Price(CostMode.GPU_SECONDS, 0.0, gpu_second=0.001, energy_per_kwh=0.3, box_per_hour=3.6)


@pytest.fixture
def ledger(tmp_path: Path) -> Iterator[LedgerWriter]:
    with LedgerWriter.open(tmp_path / "ledger.db") as writer:
        writer.set_price(GPU).result()
        yield writer


def period(start: float, end: float, *workers: WorkerUsage) -> UsagePeriod:
    return UsagePeriod(start, end, workers)


def turn(n: int, task: str, tenant: str, gpu_s: float, at: float) -> TurnRecord:
    t = TenantId(tenant)
    return TurnRecord(
        TurnId(f"u{n}"),
        t,
        TaskId(task),
        None,
        W0,
        "m",
        10,
        0,
        1,
        TurnOutcome.OK,
        at,
        at + 1.0,
        gpu_s=gpu_s,
    )


def test_a_period_is_stored_priced_and_acknowledged_with_its_cost(ledger: LedgerWriter) -> None:
    # 100 s: w0 awake 100 GPU-s, 40 busy, 36,000 J; w1 (2 GPUs) awake 200, none busy, no power.
    cost = ledger.record_usage(
        period(
            1000.0,
            1100.0,
            WorkerUsage(W0, 1, awake_s=100.0, busy_s=40.0, energy_j=36_000.0),
            WorkerUsage(W1, 2, awake_s=200.0, busy_s=0.0),
        )
    ).result()
    # idle (60 + 200) * 0.001 = 0.26; energy 0.01 kWh * 0.3 = 0.003; box 100 s * 0.001 = 0.1
    assert (cost.idle, cost.energy, cost.box) == pytest.approx((0.26, 0.003, 0.1))
    with closing(open_reader(ledger.path)) as conn:
        (p,) = conn.execute("SELECT * FROM usage_periods").fetchall()
        workers = conn.execute("SELECT * FROM worker_usage ORDER BY worker").fetchall()
    assert (p["started_at"], p["ended_at"], p["price_id"]) == (1000.0, 1100.0, 1)
    assert p["box_cost"] == pytest.approx(0.1)
    assert [tuple(w)[1:6] for w in workers] == [
        ("w0", 1, 100.0, 40.0, 36_000.0),
        ("w1", 2, 200.0, 0.0, None),
    ]
    assert [(w["idle_cost"], w["energy_cost"]) for w in workers] == [
        pytest.approx((0.06, 0.003)),
        pytest.approx((0.2, 0.0)),
    ]


def test_a_period_is_priced_at_the_version_in_effect_at_its_end(ledger: LedgerWriter) -> None:
    tokens = Price(CostMode.TOKENS, 2000.0, fresh_per_mtok=1.0)
    dearer = Price(CostMode.GPU_SECONDS, 3000.0, gpu_second=0.002, box_per_hour=7.2)
    ledger.set_price(tokens).result()
    ledger.set_price(dearer).result()
    w = WorkerUsage(W0, 1, awake_s=10.0, busy_s=0.0)
    before = ledger.record_usage(period(1989.0, 1999.0, w)).result()
    during = ledger.record_usage(period(2990.0, 2999.0, w)).result()
    after = ledger.record_usage(period(2995.0, 3005.0, w)).result()
    assert (before.idle, before.box) == pytest.approx((0.01, 0.01))
    assert (during.total, during.price_id) == (0.0, 2)  # tokens mode: the list is the price
    assert (after.idle, after.box) == pytest.approx((0.02, 0.02))


def test_a_new_energy_or_box_price_is_a_new_version(ledger: LedgerWriter) -> None:
    assert ledger.set_price(replace(GPU, effective_from=50.0)).result() == 1  # the same rates
    box = Price(CostMode.GPU_SECONDS, 60.0, gpu_second=0.001, energy_per_kwh=0.3, box_per_hour=4)
    assert ledger.set_price(box).result() == 2
    with closing(open_reader(ledger.path)) as conn:
        assert [(p.energy_per_kwh, p.box_per_hour) for p in load_prices(conn)] == [
            (0.3, 3.6),
            (0.3, 4.0),
        ]


def test_a_period_whose_rows_cannot_all_be_written_leaves_none(ledger: LedgerWriter) -> None:
    twice = WorkerUsage(W0, 1, awake_s=1.0, busy_s=0.0)
    with pytest.raises(LedgerError, match="write rejected"):
        ledger.record_usage(period(0.0, 1.0, twice, twice)).result()
    ledger.record_usage(period(1.0, 2.0, twice)).result()
    with closing(open_reader(ledger.path)) as conn:
        periods = conn.execute("SELECT started_at FROM usage_periods").fetchall()
        assert [tuple(r) for r in periods] == [(1.0,)]
        assert conn.execute("SELECT count(*) FROM worker_usage").fetchone()[0] == 1


def test_the_report_spreads_the_overhead_by_gpu_seconds(ledger: LedgerWriter) -> None:
    for task_id, tenant, at in (("a", "acme", 10.0), ("b", "beta", 20.0)):
        ledger.record_task(TaskRecord(TaskId(task_id), TenantId(tenant), at, task_class="c"))
    ledger.record_turn(turn(1, "a", "acme", 10.0, 11.0))  # 10 GPU-s: 0.01
    ledger.record_turn(turn(2, "b", "beta", 30.0, 21.0))  # 30 GPU-s: 0.03
    ledger.record_task_event(TaskEvent(TaskId("a"), TaskEventType.SUCCEEDED, 30.0, verified=True))
    # [0, 100): w0 awake 100, busy 40, 36,000 J: idle 0.06 + energy 0.003 + box 0.1 = 0.163
    w = WorkerUsage(W0, 1, awake_s=100.0, busy_s=40.0, energy_j=36_000.0)
    ledger.record_usage(period(0.0, 100.0, w)).result()
    acme, beta = cost_report(ledger.path)
    # acme used 10 of 40 GPU-s: a quarter of each part; beta three quarters.
    assert acme["gpu_s"] == 10.0 and beta["gpu_s"] == 30.0
    assert (acme["overhead_idle"], acme["overhead_energy"], acme["overhead_box"]) == (
        pytest.approx((0.015, 0.00075, 0.025))
    )
    assert acme["overhead"] == pytest.approx(0.04075)
    assert beta["overhead"] == pytest.approx(0.12225)
    assert acme["cost"] == pytest.approx(0.01)
    assert acme["total_cost"] == pytest.approx(0.05075)
    assert acme["cost_per_success"] == pytest.approx(0.05075)  # 1 success
    assert acme["direct_cost_per_success"] == pytest.approx(0.01)
    assert beta["cost_per_success"] is None  # no success
    # From t=15: beta's root alone, and the period's part from 15 on: 85 % of 0.163.
    (later,) = cost_report(ledger.path, since=15.0)
    assert later["tenant"] == "beta" and later["overhead"] == pytest.approx(0.85 * 0.163)
    # Until t=15: acme alone, and 15 % of it.
    (earlier,) = cost_report(ledger.path, until=15.0)
    assert earlier["tenant"] == "acme" and earlier["overhead"] == pytest.approx(0.15 * 0.163)


def test_an_older_ledger_takes_the_usage_tables_and_keeps_its_prices(tmp_path: Path) -> None:
    db = tmp_path / "ledger.db"
    with closing(sqlite3.connect(db, isolation_level=None)) as conn:
        migrations.apply(Database(conn), stop_before="0009_box_usage")
        conn.execute(
            "INSERT INTO prices (effective_from, mode, currency, fresh_per_mtok, cached_per_mtok,"
            " output_per_mtok, reasoning_per_mtok, gpu_second)"
            " VALUES (0, 'gpu_seconds', 'USD', 0, 0, 0, 0, 0.002)"
        )
    with LedgerWriter.open(db) as ledger:
        with closing(ledger.reader()) as conn:
            (old,) = load_prices(conn)
        assert (old.gpu_second, old.energy_per_kwh, old.box_per_hour) == (0.002, 0.0, 0.0)
        w = WorkerUsage(W0, 1, awake_s=10.0, busy_s=4.0, energy_j=3_600_000.0)
        cost = ledger.record_usage(period(0.0, 10.0, w)).result()
        assert (cost.idle, cost.energy, cost.box) == pytest.approx((0.012, 0.0, 0.0))
    with closing(sqlite3.connect(db)) as conn:
        assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
