"""The ledger's schema as named migrations, and the checks that run before SQLite may touch
a file: a file that is not SQLite, a ledger of a newer build or a database of another
program is refused with one line and left byte-for-byte as it was.

Schema changes only by appending a new named migration below; never edit an applied one.
Times are Unix seconds (REAL); money is in the currency of the turn's price row.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence
from pathlib import Path

from sqlite_utils import Database
from sqlite_utils.migrations import Migrations

from appliance.domain.errors import LedgerError
from appliance.ledger.rebuilds import TASKS_WITH_DONE

SQLITE_MAGIC = b"SQLite format 3\x00"
MIGRATION_SET = "appliance_ledger"
MIGRATIONS_TABLE = Migrations.migrations_table

migrations = Migrations(MIGRATION_SET)


def _run(db: Database, statements: Sequence[str]) -> None:
    # One statement at a time: executescript() would COMMIT the migration's transaction.
    for sql in statements:
        db.execute(sql)


_INITIAL_STATEMENTS = (
    """CREATE TABLE tasks (
                task_id TEXT PRIMARY KEY,
                tenant TEXT NOT NULL,
                parent_task_id TEXT,
                task_class TEXT,
                status TEXT NOT NULL DEFAULT 'open'
                    CHECK (status IN ('open', 'succeeded', 'failed', 'cancelled')),
                verified INTEGER CHECK (verified IN (0, 1)),
                evidence TEXT,
                created_at REAL NOT NULL,
                finished_at REAL,
                deadline_at REAL,
                budget REAL,
                max_children INTEGER
            )""",
    "CREATE INDEX tasks_parent ON tasks (parent_task_id)",
    "CREATE INDEX tasks_created ON tasks (created_at)",
    """CREATE TABLE task_events (
                event_id INTEGER PRIMARY KEY,
                task_id TEXT NOT NULL,
                type TEXT NOT NULL CHECK (type IN
                    ('succeeded', 'failed', 'cancelled', 'tool_started', 'tool_finished')),
                at REAL NOT NULL,
                verified INTEGER CHECK (verified IN (0, 1)),
                evidence TEXT,
                tool_class TEXT,
                expected_s REAL
            )""",
    "CREATE INDEX task_events_task ON task_events (task_id, at)",
    """CREATE TABLE sessions (
                session_id TEXT PRIMARY KEY,
                tenant TEXT NOT NULL,
                task_id TEXT,
                worker TEXT,
                created_at REAL NOT NULL,
                last_active_at REAL
            )""",
    """CREATE TABLE prices (
                price_id INTEGER PRIMARY KEY,
                effective_from REAL NOT NULL,
                mode TEXT NOT NULL CHECK (mode IN ('tokens', 'gpu_seconds')),
                currency TEXT NOT NULL,
                fresh_per_mtok REAL NOT NULL,
                cached_per_mtok REAL NOT NULL,
                output_per_mtok REAL NOT NULL,
                reasoning_per_mtok REAL NOT NULL,
                gpu_second REAL NOT NULL
            )""",
    """CREATE TABLE turns (
                turn_id TEXT PRIMARY KEY,
                tenant TEXT NOT NULL,
                task_id TEXT,
                session_id TEXT,
                parent_task_id TEXT,
                worker TEXT,
                model TEXT NOT NULL,
                prompt_tokens INTEGER NOT NULL,
                cached_tokens INTEGER NOT NULL,
                fresh_tokens INTEGER NOT NULL,
                output_tokens INTEGER NOT NULL,
                reasoning_tokens INTEGER NOT NULL,
                predicted_cached_tokens INTEGER,
                queue_s REAL NOT NULL,
                ttft_s REAL,
                e2e_s REAL NOT NULL,
                gpu_s REAL NOT NULL,
                outcome TEXT NOT NULL
                    CHECK (outcome IN ('ok', 'failed', 'cancelled', 'discarded')),
                error TEXT,
                started_at REAL NOT NULL,
                finished_at REAL NOT NULL,
                tool_cost REAL NOT NULL,
                price_id INTEGER REFERENCES prices (price_id),
                cost REAL
            )""",
    "CREATE INDEX turns_task ON turns (task_id)",
    "CREATE INDEX turns_finished ON turns (finished_at)",
    """CREATE TABLE cache_receipts (
                receipt_id INTEGER PRIMARY KEY,
                prefix_digest TEXT NOT NULL,
                token_count INTEGER NOT NULL,
                model TEXT NOT NULL,
                runtime_identity TEXT NOT NULL,
                tenant_domain TEXT NOT NULL,
                worker TEXT NOT NULL,
                tier TEXT NOT NULL CHECK (tier IN ('gpu', 'host', 'disk')),
                created_at REAL NOT NULL,
                last_used_at REAL NOT NULL,
                UNIQUE (prefix_digest, model, runtime_identity, tenant_domain, worker, tier)
            )""",
    """CREATE TABLE residency_events (
                event_id INTEGER PRIMARY KEY,
                at REAL NOT NULL,
                session_id TEXT NOT NULL,
                worker TEXT,
                action TEXT NOT NULL,
                reason TEXT NOT NULL,
                tokens INTEGER NOT NULL,
                tier TEXT
            )""",
    "CREATE INDEX residency_events_session ON residency_events (session_id, at)",
    """CREATE TABLE admission_events (
                event_id INTEGER PRIMARY KEY,
                at REAL NOT NULL,
                tenant TEXT NOT NULL,
                task_id TEXT,
                decision TEXT NOT NULL,
                reason TEXT NOT NULL,
                queue_depth INTEGER
            )""",
    "CREATE INDEX admission_events_at ON admission_events (at)",
    "PRAGMA user_version = 1",
)
"""The first schema: tasks and their events, sessions, prices, turns, cache receipts,
residency and admission events (the CREATE texts are kept as first applied)."""


@migrations(name="0001_initial")
def _initial(db: Database) -> None:
    _run(db, _INITIAL_STATEMENTS)


@migrations(name="0002_route_decisions")
def _route_decisions(db: Database) -> None:
    _run(
        db,
        [
            """CREATE TABLE route_decisions (
                turn_id TEXT PRIMARY KEY,
                at REAL NOT NULL,
                worker TEXT,
                reason TEXT NOT NULL,
                candidates TEXT NOT NULL
            )""",
            "CREATE INDEX route_decisions_at ON route_decisions (at)",
            "PRAGMA user_version = 2",
        ],
    )


@migrations(name="0003_turns_by_session")
def _turns_by_session(db: Database) -> None:
    _run(
        db,
        [
            "CREATE INDEX turns_session ON turns (tenant, session_id, started_at)",
            "PRAGMA user_version = 3",
        ],
    )


@migrations(name="0004_live_residency")
def _live_residency(db: Database) -> None:
    _run(
        db,
        [
            "ALTER TABLE residency_events ADD COLUMN figures TEXT",
            "ALTER TABLE cache_receipts ADD COLUMN evicted_at REAL",
            "ALTER TABLE cache_receipts ADD COLUMN evicted_cause TEXT",
            "PRAGMA user_version = 4",
        ],
    )


@migrations(name="0005_receipt_generation")
def _receipt_generation(db: Database) -> None:
    # The worker's cache generation a receipt was made in (NULL: written before it was kept).
    _run(
        db,
        [
            "ALTER TABLE cache_receipts ADD COLUMN generation INTEGER",
            "PRAGMA user_version = 5",
        ],
    )


@migrations(name="0006_tool_costs")
def _tool_costs(db: Database) -> None:
    # What a finished tool cost, in the ledger's currency (the task's attempted cost).
    _run(
        db,
        [
            "ALTER TABLE task_events ADD COLUMN cost REAL NOT NULL DEFAULT 0",
            "PRAGMA user_version = 6",
        ],
    )


@migrations(name="0007_worker_power")
def _worker_power(db: Database) -> None:
    # The worker reaper's sleeps, stops and wakes: GPU-seconds per state per worker.
    _run(
        db,
        [
            """CREATE TABLE worker_power_events (
                event_id INTEGER PRIMARY KEY,
                at REAL NOT NULL,
                worker TEXT NOT NULL,
                action TEXT NOT NULL,
                from_state TEXT NOT NULL,
                to_state TEXT NOT NULL,
                duration_s REAL NOT NULL,
                state_s REAL NOT NULL,
                gpus INTEGER NOT NULL,
                reason TEXT NOT NULL
            )""",
            "CREATE INDEX worker_power_events_worker ON worker_power_events (worker, at)",
            "PRAGMA user_version = 7",
        ],
    )


@migrations(name="0008_one_turn_tasks_done")
def _one_turn_tasks_done(db: Database) -> None:
    # A one-turn task (a turn without X-Task-ID) closes `done` when its turn ends.
    _run(db, TASKS_WITH_DONE)


@migrations(name="0009_box_usage")
def _box_usage(db: Database) -> None:
    # The box's awake time and energy per period and worker, priced as overhead; the
    # energy and box prices beside the others (0: what ledgers before them charged).
    _run(
        db,
        [
            "ALTER TABLE prices ADD COLUMN energy_per_kwh REAL NOT NULL DEFAULT 0",
            "ALTER TABLE prices ADD COLUMN box_per_hour REAL NOT NULL DEFAULT 0",
            """CREATE TABLE usage_periods (
                period_id INTEGER PRIMARY KEY,
                started_at REAL NOT NULL,
                ended_at REAL NOT NULL,
                price_id INTEGER REFERENCES prices (price_id),
                box_cost REAL NOT NULL,
                CHECK (ended_at >= started_at)
            )""",
            "CREATE INDEX usage_periods_ended ON usage_periods (ended_at)",
            """CREATE TABLE worker_usage (
                period_id INTEGER NOT NULL REFERENCES usage_periods (period_id),
                worker TEXT NOT NULL,
                gpus INTEGER NOT NULL,
                awake_s REAL NOT NULL,
                busy_s REAL NOT NULL,
                energy_j REAL,
                idle_cost REAL NOT NULL,
                energy_cost REAL NOT NULL,
                PRIMARY KEY (period_id, worker)
            )""",
            "PRAGMA user_version = 9",
        ],
    )


@migrations(name="0010_turn_sides")
def _turn_sides(db: Database) -> None:
    # Where a turn went (`endpoint`: an outside endpoint's name; NULL: the local box) and why
    # (`route_reason`: the escalation rule that chose its side; NULL: ledgers before it).
    _run(
        db,
        [
            "ALTER TABLE turns ADD COLUMN endpoint TEXT",
            "ALTER TABLE turns ADD COLUMN route_reason TEXT",
            "PRAGMA user_version = 10",
        ],
    )


KNOWN = [m.name for m in migrations._migrations]
SCHEMA_VERSION = len(KNOWN)  # PRAGMA user_version after the last migration


def check_header(path: Path) -> None:
    """Refuse an existing file that is not SQLite before SQLite opens (and maybe rewrites)
    it. An empty file is an empty database to SQLite and is accepted."""
    if path.is_dir():
        raise LedgerError(f"ledger {path} is a directory; point ledger.path at a file")
    try:
        with path.open("rb") as f:
            head = f.read(len(SQLITE_MAGIC))
    except (FileNotFoundError, NotADirectoryError):
        return  # not there yet: creating it (or its directory) is checked next
    except OSError as exc:
        raise LedgerError(
            f"ledger {path}: cannot read it ({exc.strerror}); check its permissions"
        ) from None
    if head and head != SQLITE_MAGIC:
        raise LedgerError(
            f"ledger {path} is not an SQLite database; move the file away or point "
            "ledger.path (or --db) at another file"
        )


def applied(conn: sqlite3.Connection) -> list[str]:
    """Names of this ledger's applied migrations, read without writing anything."""
    has_table = conn.execute(
        "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", [MIGRATIONS_TABLE]
    ).fetchone()
    if not has_table:
        return []
    rows = conn.execute(
        f"SELECT name FROM [{MIGRATIONS_TABLE}] WHERE migration_set = ? ORDER BY rowid",
        [MIGRATION_SET],
    )
    return [r[0] for r in rows]


def check_version(conn: sqlite3.Connection, path: Path) -> list[str]:
    """Raise LedgerError unless the file is empty or a ledger this build can read and
    migrate; returns the applied migration names. Needs an autocommit connection."""
    try:
        # One read transaction: another process may commit a migration between statements.
        conn.execute("BEGIN")
        try:
            done = applied(conn)
            version = conn.execute("PRAGMA user_version").fetchone()[0]
            tables = [
                r[0]
                for r in conn.execute(
                    "SELECT name FROM sqlite_master WHERE type = 'table' "
                    "AND name NOT LIKE 'sqlite_%' ORDER BY name"
                )
            ]
        finally:
            conn.execute("COMMIT")
    except sqlite3.DatabaseError as exc:
        raise LedgerError(
            f"ledger {path} cannot be read ({exc}); move the damaged file away "
            "or point ledger.path at another file"
        ) from None
    newer = [name for name in done if name not in KNOWN]
    if newer or version > SCHEMA_VERSION:
        what = f"migration {newer[0]}" if newer else f"schema version {version}"
        raise LedgerError(
            f"ledger {path} was written by a newer appliance ({what} is unknown to this "
            "build); upgrade the appliance or point ledger.path at another file"
        )
    if not done and tables:
        raise LedgerError(
            f"ledger {path} is an SQLite database of another program (tables: "
            f"{', '.join(tables[:5])}); point ledger.path at a new file"
        )
    return done


def migrate(conn: sqlite3.Connection) -> list[str]:
    """Apply the pending migrations, each in its own transaction together with the record of
    it. BEGIN IMMEDIATE takes the write lock before `pending` is read, so two processes
    opening a new ledger at once cannot both apply the same migration. Needs a connection
    in autocommit mode (isolation_level=None). Returns the names it applied."""
    db = Database(conn, recursive_triggers=False, execute_plugins=False)
    done: list[str] = []
    while True:
        conn.execute("BEGIN IMMEDIATE")
        try:
            pending = migrations.pending(db)
            if pending:
                # Inside our transaction sqlite-utils' atomic() nests as a savepoint.
                migrations.apply(db, stop_before=[m.name for m in pending[1:]])
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise
        if not pending:
            return done
        done.append(pending[0].name)
