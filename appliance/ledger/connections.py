"""Opening the ledger file: the one write connection (checked, migrated, WAL) and read
connections (`mode=ro`), which in WAL mode never block the writer nor wait for it."""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path
from typing import Literal

from appliance.domain.errors import LedgerError
from appliance.ledger import schema

Synchronous = Literal["full", "normal"]


def open_writer_connection(
    path: Path, *, synchronous: Synchronous, busy_timeout_s: float
) -> sqlite3.Connection:
    """Check, create if missing, migrate. Nothing is written to an existing file before it
    passed the header and version checks."""
    if synchronous not in ("full", "normal"):
        raise LedgerError(f"ledger synchronous={synchronous!r} is invalid; use full or normal")
    schema.check_header(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise LedgerError(
            f"ledger {path}: cannot create its directory {path.parent} ({exc.strerror}); "
            "choose a writable data dir or ledger.path"
        ) from None
    try:
        # isolation_level=None: we issue BEGIN IMMEDIATE / COMMIT ourselves.
        conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    except sqlite3.Error as exc:
        raise _cannot_open(path, exc) from None
    try:
        conn.execute(f"PRAGMA busy_timeout = {int(busy_timeout_s * 1000)}")
        schema.check_version(conn, path)
        mode = _enable_wal(conn, busy_timeout_s)
        if mode != "wal":
            raise LedgerError(
                f"ledger {path}: the file system refused WAL mode (got {mode}); "
                "put the ledger on a local disk"
            )
        conn.execute(f"PRAGMA synchronous = {synchronous.upper()}")
        # Keep the -wal file from growing without bound between checkpoints.
        conn.execute("PRAGMA journal_size_limit = 67108864")
        schema.migrate(conn)
    except LedgerError:
        conn.close()
        raise
    except sqlite3.Error as exc:
        conn.close()
        raise _cannot_open(path, exc) from None
    return conn


def _enable_wal(conn: sqlite3.Connection, busy_timeout_s: float) -> str:
    # Switching to WAL needs a moment alone with the file. While another process opening it
    # holds a lock, SQLite answers with the old mode, or, when that process is about to
    # write (it holds the reserved lock), with "database is locked" at once rather than
    # wait for it: ask again.
    deadline = time.monotonic() + busy_timeout_s
    while True:
        try:
            mode = str(conn.execute("PRAGMA journal_mode = WAL").fetchone()[0])
        except sqlite3.OperationalError as exc:
            if exc.sqlite_errorcode & 0xFF != sqlite3.SQLITE_BUSY or time.monotonic() > deadline:
                raise
        else:
            if mode == "wal" or time.monotonic() > deadline:
                return mode
        time.sleep(0.02)


def _cannot_open(path: Path, exc: sqlite3.Error) -> LedgerError:
    return LedgerError(
        f"ledger {path}: cannot open it for writing ({exc}); check that its directory "
        "exists and is writable"
    )


def open_reader(path: str | Path, *, busy_timeout_s: float = 5.0) -> sqlite3.Connection:
    """A read-only connection (rows as sqlite3.Row) to an existing ledger of a schema this
    build knows. Readers see the last committed state and never block the writer."""
    path = Path(path).expanduser().absolute()
    if not path.exists():
        raise LedgerError(f"ledger {path} does not exist; pass the path of an existing ledger")
    # No check_header() here: closing any other descriptor of the database file would drop
    # this process's POSIX locks, the writer's included. A read-only connection cannot harm
    # a file that is not SQLite; check_version() below refuses it in one line.
    try:
        conn = sqlite3.connect(
            f"{path.as_uri()}?mode=ro", uri=True, check_same_thread=False, isolation_level=None
        )
    except sqlite3.Error as exc:
        raise LedgerError(f"ledger {path}: cannot open it to read ({exc})") from None
    try:
        conn.execute(f"PRAGMA busy_timeout = {int(busy_timeout_s * 1000)}")
        try:
            conn.execute("PRAGMA schema_version").fetchone()
        except sqlite3.DatabaseError:
            raise LedgerError(
                f"ledger {path} is not an SQLite database; move the file away or point "
                "ledger.path (or --db) at another file"
            ) from None
        done = schema.check_version(conn, path)
    except BaseException:
        conn.close()
        raise
    if not done:
        conn.close()
        raise LedgerError(f"ledger {path} is empty (no schema yet); open it with the appliance")
    conn.row_factory = sqlite3.Row
    return conn
