"""The ledger's one writer: a thread that drains a queue and commits batches.

Why one thread: SQLite allows one writer at a time; a single owner of the write connection
never waits on a lock it could have avoided, and batching many writes into one
`BEGIN IMMEDIATE ... COMMIT` pays one fsync for up to `batch_max` writes. Batches form
by themselves: whatever queued up while the last commit ran goes into the next one, so an
idle ledger commits each write at once and a busy one commits large batches.

A write is acknowledged when its Future resolves, which happens only after the COMMIT of
its transaction returned. A write that fails (a duplicate id, a closed task) fails alone;
the others in its batch still commit. Cancelling a Future before the writer reached it
withdraws the write.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import sqlite3
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

from appliance.domain.errors import LedgerError, LedgerUnavailable
from appliance.domain.records import (
    AdmissionEvent,
    CacheEviction,
    CacheReceipt,
    Price,
    PriceId,
    ResidencyEvent,
    RouteDecisionRecord,
    SessionRecord,
    TaskEvent,
    TaskRecord,
    TaskStatus,
    TurnRecord,
    WorkerPowerEvent,
    can_transition,
)
from appliance.domain.usage import PeriodCost, UsagePeriod
from appliance.ledger import rows
from appliance.ledger.connections import Synchronous, open_reader, open_writer_connection
from appliance.policy.costs import PriceBook, turn_cost
from appliance.policy.overhead import price_period

log = logging.getLogger(__name__)

T = TypeVar("T")
_Item = tuple[Callable[[Any], Any] | None, Any, Future[Any]]
_STOP: Any = object()


class LedgerWriter:
    """The write side of the ledger file. Thread-safe: any thread may call record_*."""

    def __init__(self, conn: sqlite3.Connection, path: Path, *, batch_max: int) -> None:
        self.path = path
        self._conn = conn
        self._batch_max = batch_max
        self._prices = PriceBook(rows.load_prices(conn))
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._lock = threading.Lock()  # orders "closed?" checks against the stop marker
        self._closed = False
        self.failing: str | None = None
        """Why the last write transaction failed (a full disk, an I/O error), until one
        commits again: the appliance then refuses new work rather than lose its records."""
        self._thread = threading.Thread(target=self._run, name="ledger-writer", daemon=True)
        self._thread.start()

    @classmethod
    def open(
        cls,
        path: str | Path,
        *,
        synchronous: Synchronous = "full",
        batch_max: int = 1024,
        busy_timeout_s: float = 5.0,
    ) -> LedgerWriter:
        """Open (create, migrate) the ledger at `path` and start its writer thread.
        Raises LedgerError, leaving an unusable file untouched."""
        if batch_max < 1:
            raise LedgerError(f"ledger batch_max={batch_max} is invalid; use 1 or more")
        path = Path(path).expanduser().absolute()
        conn = open_writer_connection(path, synchronous=synchronous, busy_timeout_s=busy_timeout_s)
        return cls(conn, path, batch_max=batch_max)

    # -- the writes ------------------------------------------------------------------------

    def record_task(self, task: TaskRecord) -> Future[None]:
        return self._submit(self._write_task, task)

    def record_task_event(self, event: TaskEvent) -> Future[None]:
        return self._submit(self._write_task_event, event)

    def record_session(self, session: SessionRecord) -> Future[None]:
        return self._submit(self._write_session, session)

    def record_turn(self, turn: TurnRecord) -> Future[float | None]:
        return self._submit(self._write_turn, turn)

    def record_cache_receipt(self, receipt: CacheReceipt) -> Future[None]:
        return self._submit(self._write_receipt, receipt)

    def record_cache_eviction(self, eviction: CacheEviction) -> Future[None]:
        return self._submit(self._write_eviction, eviction)

    def record_residency_event(self, event: ResidencyEvent) -> Future[None]:
        return self._submit(self._write_residency, event)

    def record_worker_power(self, event: WorkerPowerEvent) -> Future[None]:
        return self._submit(self._write_worker_power, event)

    def record_admission_event(self, event: AdmissionEvent) -> Future[None]:
        return self._submit(self._write_admission, event)

    def record_route_decision(self, decision: RouteDecisionRecord) -> Future[None]:
        return self._submit(self._write_route_decision, decision)

    def record_usage(self, period: UsagePeriod) -> Future[PeriodCost]:
        """One usage period of the box and its workers, priced at the version in effect at
        its end (policy/overhead.py); resolves to that cost once committed."""
        return self._submit(self._write_usage, period)

    def set_price(self, price: Price) -> Future[PriceId]:
        return self._submit(self._write_price, price)

    def probe(self) -> Future[None]:
        """A write of nothing new (the schema version, set to itself): it commits only when
        the file takes writes again, and then clears `failing`."""
        return self._submit(self._write_probe, None)

    def barrier(self) -> Future[None]:
        """Resolves once every write queued before it has committed (or failed)."""
        return self._submit(None, None)

    def flush(self, timeout_s: float | None = None) -> None:
        try:
            self.barrier().result(timeout_s)
        except TimeoutError:
            raise LedgerError(
                f"ledger {self.path}: writes not committed within {timeout_s}s; "
                "the disk may be stalled"
            ) from None

    def reader(self) -> sqlite3.Connection:
        """A new read-only connection to this ledger (close it when done)."""
        return open_reader(self.path)

    def close(self) -> None:
        """Commit everything queued, stop the writer, close the file. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._queue.put(_STOP)
        self._thread.join()
        self._conn.close()

    def __enter__(self) -> LedgerWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _submit(self, fn: Callable[[T], Any] | None, arg: T) -> Future[Any]:
        fut: Future[Any] = Future()
        with self._lock:
            if self._closed:
                raise LedgerError(f"ledger {self.path} is closed; no more writes")
            self._queue.put((fn, arg, fut))
        return fut

    # -- the writer thread -----------------------------------------------------------------

    def _run(self) -> None:
        stop = False
        while not stop:
            batch: list[_Item] = []
            item = self._queue.get()
            while True:
                if item is _STOP:
                    stop = True  # nothing can be queued after the marker
                    break
                batch.append(item)
                if len(batch) >= self._batch_max:
                    break
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
            if batch:
                try:
                    self._commit(batch)
                except BaseException:  # a bug must not leave callers waiting forever
                    log.exception("ledger %s: writer failed", self.path)
                    self._fail_unresolved(batch)
                    with contextlib.suppress(sqlite3.Error):
                        self._conn.execute("ROLLBACK")

    def _fail_unresolved(self, batch: list[_Item]) -> None:
        for _, _, fut in batch:
            if not fut.done():
                fut.set_exception(LedgerError(f"ledger {self.path}: internal error; see the log"))

    def _commit(self, batch: list[_Item]) -> None:
        live = [w for w in batch if w[2].set_running_or_notify_cancel()]
        if not live:
            return
        results: list[Any] = [None] * len(live)
        errors: list[BaseException | None] = [None] * len(live)
        conn = self._conn
        try:
            conn.execute("BEGIN IMMEDIATE")
        except sqlite3.Error as exc:
            self._fail_all(live, f"cannot start a write transaction ({exc})")
            return
        for i, (fn, arg, _) in enumerate(live):
            if fn is None:
                continue
            try:
                results[i] = fn(arg)
            except sqlite3.Error as exc:
                errors[i] = LedgerError(f"ledger {self.path}: write rejected ({exc})")
                if not conn.in_transaction:  # a disk or memory error ended the transaction
                    self._after_rollback(live, f"write transaction aborted ({exc})")
                    return
            except Exception as exc:  # a bad record fails its own write, not the batch
                errors[i] = exc
        try:
            conn.execute("COMMIT")
        except sqlite3.Error as exc:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            self._after_rollback(live, f"commit failed ({exc})")
            return
        if any(fn is not None for fn, _, _ in live):
            self.failing = None
        for (_, _, fut), result, error in zip(live, results, errors, strict=True):
            if error is None:
                fut.set_result(result)
            else:
                fut.set_exception(error)

    def _after_rollback(self, live: list[_Item], why: str) -> None:
        try:  # forget price versions that were not committed
            self._prices = PriceBook(rows.load_prices(self._conn))
        except sqlite3.Error:
            log.exception("ledger %s: cannot reload prices", self.path)
        self._fail_all(live, why)

    def _fail_all(self, live: list[_Item], why: str) -> None:
        log.error("ledger %s: %s; %d writes failed", self.path, why, len(live))
        self.failing = why
        for _, _, fut in live:
            fut.set_exception(LedgerUnavailable(f"ledger {self.path}: {why}; the write was lost"))

    # Each _write_* runs on the writer thread inside the open transaction.

    def _write_probe(self, _: None) -> None:
        version = int(self._conn.execute("PRAGMA user_version").fetchone()[0])
        self._conn.execute(f"PRAGMA user_version = {version}")

    def _write_task(self, task: TaskRecord) -> None:
        self._conn.execute(rows.INSERT_TASK, rows.task_params(task))

    def _write_task_event(self, event: TaskEvent) -> None:
        new = event.type.terminal_status
        if new is not None:
            row = self._conn.execute(
                "SELECT status FROM tasks WHERE task_id = ?", [event.task_id]
            ).fetchone()
            if row is None:
                raise LedgerError(
                    f"task {event.task_id} is not in the ledger; record the task first"
                )
            if not can_transition(TaskStatus(row[0]), new):
                raise LedgerError(
                    f"task {event.task_id} is already {row[0]}; it cannot become {new}"
                )
            self._conn.execute(
                rows.CLOSE_TASK,
                (new.value, event.verified, event.evidence, event.at, event.task_id),
            )
        self._conn.execute(rows.INSERT_TASK_EVENT, rows.task_event_params(event))

    def _write_session(self, session: SessionRecord) -> None:
        self._conn.execute(rows.UPSERT_SESSION, rows.session_params(session))

    def _write_turn(self, turn: TurnRecord) -> float | None:
        if turn.priced_cost is not None:  # an outside endpoint's turn, at its prices
            cost, price_id = turn.priced_cost + turn.tool_cost, None
        else:
            price = self._prices.at(turn.finished_at)
            cost = turn_cost(turn, price) if price is not None else None
            price_id = price.price_id if price is not None else None
        self._conn.execute(rows.INSERT_TURN, rows.turn_params(turn, price_id, cost))
        return cost

    def _write_receipt(self, receipt: CacheReceipt) -> None:
        self._conn.execute(rows.UPSERT_RECEIPT, rows.receipt_params(receipt))

    def _write_eviction(self, eviction: CacheEviction) -> None:
        self._conn.execute(rows.MARK_EVICTED, rows.eviction_params(eviction))

    def _write_residency(self, event: ResidencyEvent) -> None:
        self._conn.execute(rows.INSERT_RESIDENCY, rows.residency_params(event))

    def _write_worker_power(self, event: WorkerPowerEvent) -> None:
        self._conn.execute(rows.INSERT_WORKER_POWER, rows.worker_power_params(event))

    def _write_admission(self, event: AdmissionEvent) -> None:
        self._conn.execute(rows.INSERT_ADMISSION, rows.admission_params(event))

    def _write_route_decision(self, decision: RouteDecisionRecord) -> None:
        self._conn.execute(rows.INSERT_ROUTE_DECISION, rows.route_decision_params(decision))

    def _write_usage(self, period: UsagePeriod) -> PeriodCost:
        """The period's row and its workers' rows, all or none (a savepoint)."""
        cost = price_period(self._prices.at(period.ended_at), period)
        conn = self._conn
        conn.execute("SAVEPOINT usage")
        try:
            cur = conn.execute(
                rows.INSERT_USAGE_PERIOD,
                (period.started_at, period.ended_at, cost.price_id, cost.box),
            )
            params = rows.worker_usage_params(int(cur.lastrowid or 0), period, cost)
            conn.executemany(rows.INSERT_WORKER_USAGE, params)
        except sqlite3.Error:
            if conn.in_transaction:
                conn.execute("ROLLBACK TO usage")
                conn.execute("RELEASE usage")
            raise
        conn.execute("RELEASE usage")
        return cost

    def _write_price(self, price: Price) -> PriceId:
        latest = self._prices.latest()
        if latest is not None and latest.price_id is not None and latest.same_rates(price):
            return latest.price_id
        cur = self._conn.execute(rows.INSERT_PRICE, rows.price_params(price))
        price_id = PriceId(int(cur.lastrowid or 0))
        self._prices.add(replace(price, price_id=price_id))
        return price_id
