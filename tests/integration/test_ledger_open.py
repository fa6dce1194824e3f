"""Opening a ledger: the schema is created once by named migrations, and every file the
ledger cannot use is refused with one clear line and left exactly as it was."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
import threading
from contextlib import closing
from pathlib import Path

import pytest

from appliance.domain.errors import LedgerError
from appliance.ledger import LedgerWriter, open_reader
from appliance.ledger.reports import cost_report
from appliance.ledger.schema import KNOWN, MIGRATION_SET, SCHEMA_VERSION

INTERFACE_TABLES = {
    "tasks",
    "sessions",
    "turns",
    "cache_receipts",
    "residency_events",
    "admission_events",
    "prices",
}
HELPER = Path(__file__).with_name("ledger_writer_proc.py")


def applied_rows(db: Path) -> list[tuple[str, str, str]]:
    with closing(sqlite3.connect(db)) as conn:
        return conn.execute(
            "SELECT migration_set, name, applied_at FROM _sqlite_migrations ORDER BY id"
        ).fetchall()


def files_in(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.is_file()}


def assert_one_line(exc: LedgerError, *fragments: str) -> None:
    assert "\n" not in exc.message
    for fragment in fragments:
        assert fragment in exc.message, (fragment, exc.message)


def test_a_new_ledger_has_the_interface_tables_wal_and_its_version(tmp_path: Path) -> None:
    db = tmp_path / "sub" / "dir" / "ledger.db"  # missing directories are created
    LedgerWriter.open(db).close()
    with closing(sqlite3.connect(db)) as conn:
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        assert tables >= INTERFACE_TABLES
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == len(KNOWN)
    assert [(s, n) for s, n, _ in applied_rows(db)] == [(MIGRATION_SET, n) for n in KNOWN]


def test_migrations_are_applied_once(tmp_path: Path) -> None:
    db = tmp_path / "ledger.db"
    LedgerWriter.open(db).close()
    first = applied_rows(db)
    for _ in range(3):
        LedgerWriter.open(db).close()
    assert applied_rows(db) == first  # same rows, same applied_at: nothing re-ran


def test_processes_opening_a_new_ledger_at_once_apply_each_migration_once(tmp_path: Path) -> None:
    db = tmp_path / "ledger.db"
    procs = [
        subprocess.Popen(
            [sys.executable, str(HELPER), str(db), f"p{i}", "--count", "20"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(4)
    ]
    outputs = [p.communicate(timeout=60) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0, 0], [err for _, err in outputs]
    assert [n for _, n, _ in applied_rows(db)] == KNOWN
    with closing(open_reader(db)) as conn:
        assert conn.execute("SELECT count(*) FROM turns").fetchone()[0] == 80


def test_opening_waits_out_another_process_about_to_write(tmp_path: Path) -> None:
    """The race behind the concurrent open: while another connection holds the reserved
    lock of a file still in rollback mode, SQLite refuses the switch to WAL at once, without
    waiting; the open asks again until the lock is gone."""
    db = tmp_path / "ledger.db"
    other = sqlite3.connect(db, isolation_level=None, check_same_thread=False)
    other.execute("BEGIN IMMEDIATE")  # the reserved lock, as a process opening it takes
    release = threading.Timer(0.3, lambda: other.execute("COMMIT"))
    release.start()
    try:
        LedgerWriter.open(db).close()
    finally:
        release.join()
        other.close()
    assert [n for _, n, _ in applied_rows(db)] == KNOWN


def test_an_empty_file_is_an_empty_ledger(tmp_path: Path) -> None:
    db = tmp_path / "ledger.db"
    db.touch()
    LedgerWriter.open(db).close()
    assert [n for _, n, _ in applied_rows(db)] == KNOWN


@pytest.mark.parametrize(
    "content",
    [
        b"turn_id,cost\nt1,0.5\n",  # a text file
        b"SQLite format 2\x00" + bytes(200),  # almost the magic
        b"\x00" * 4096,  # zeros
        b"SQLite",  # shorter than the header
    ],
)
def test_a_file_that_is_not_sqlite_is_refused_and_untouched(tmp_path: Path, content: bytes) -> None:
    db = tmp_path / "ledger.db"
    db.write_bytes(content)
    with pytest.raises(LedgerError) as err:
        LedgerWriter.open(db)
    assert_one_line(err.value, str(db), "not an SQLite database", "move the file away")
    assert err.value.exit_code == 2
    assert files_in(tmp_path) == {"ledger.db": content}  # no -wal, no -shm, same bytes
    with pytest.raises(LedgerError, match="not an SQLite database"):
        open_reader(db)
    with pytest.raises(LedgerError, match="not an SQLite database"):
        cost_report(db)
    assert files_in(tmp_path) == {"ledger.db": content}


def test_a_damaged_sqlite_file_is_refused_and_untouched(tmp_path: Path) -> None:
    db = tmp_path / "ledger.db"
    content = b"SQLite format 3\x00" + bytes(range(256)) * 16  # the magic, then garbage
    db.write_bytes(content)
    with pytest.raises(LedgerError) as err:
        LedgerWriter.open(db)
    assert_one_line(err.value, str(db), "cannot be read", "move the damaged file away")
    assert db.read_bytes() == content


def test_a_ledger_of_a_newer_build_is_refused_and_untouched(tmp_path: Path) -> None:
    db = tmp_path / "ledger.db"
    LedgerWriter.open(db).close()
    with closing(sqlite3.connect(db)) as conn, conn:
        conn.execute(
            "INSERT INTO _sqlite_migrations (migration_set, name, applied_at) VALUES (?, ?, ?)",
            [MIGRATION_SET, "0099_from_the_future", "2031-01-01 00:00:00+00:00"],
        )
    before = db.read_bytes()
    with pytest.raises(LedgerError) as err:
        LedgerWriter.open(db)
    assert_one_line(err.value, str(db), "newer appliance", "0099_from_the_future", "upgrade")
    assert db.read_bytes() == before
    with pytest.raises(LedgerError, match="newer appliance"):
        cost_report(db)
    assert db.read_bytes() == before
    assert [n for _, n, _ in applied_rows(db)] == [*KNOWN, "0099_from_the_future"]


def test_a_newer_user_version_is_refused(tmp_path: Path) -> None:
    db = tmp_path / "ledger.db"
    LedgerWriter.open(db).close()
    with closing(sqlite3.connect(db)) as conn:
        conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    before = db.read_bytes()
    with pytest.raises(LedgerError, match="newer appliance"):
        LedgerWriter.open(db)
    assert db.read_bytes() == before


def test_a_database_of_another_program_is_refused_and_untouched(tmp_path: Path) -> None:
    db = tmp_path / "ledger.db"
    with closing(sqlite3.connect(db)) as conn, conn:
        conn.execute("CREATE TABLE photos (id INTEGER PRIMARY KEY, path TEXT)")
    before = db.read_bytes()
    with pytest.raises(LedgerError) as err:
        LedgerWriter.open(db)
    assert_one_line(err.value, str(db), "another program", "photos")
    assert db.read_bytes() == before


def test_a_directory_is_refused(tmp_path: Path) -> None:
    with pytest.raises(LedgerError, match="is a directory"):
        LedgerWriter.open(tmp_path)


@pytest.mark.parametrize("below", ["ledger.db", "deeper/ledger.db"])
def test_a_directory_that_cannot_exist_is_refused(tmp_path: Path, below: str) -> None:
    # Tests run as root, so permissions stop nothing: put the ledger under a regular file.
    (tmp_path / "afile").write_text("I am a file")
    db = tmp_path / "afile" / below
    with pytest.raises(LedgerError) as err:
        LedgerWriter.open(db)
    assert_one_line(err.value, str(db), "cannot create its directory", "writable")
    assert (tmp_path / "afile").read_text() == "I am a file"


def test_a_directory_sqlite_cannot_write_is_refused() -> None:
    db = Path("/proc/appliance-ledger-test.db")  # /proc takes no new files, even from root
    with pytest.raises(LedgerError) as err:
        LedgerWriter.open(db)
    assert_one_line(err.value, str(db), "cannot open it for writing", "writable")


def test_reading_a_missing_ledger_creates_nothing(tmp_path: Path) -> None:
    db = tmp_path / "missing.db"
    with pytest.raises(LedgerError, match="does not exist"):
        open_reader(db)
    with pytest.raises(LedgerError, match="does not exist"):
        cost_report(db)
    assert not db.exists()


def test_bad_open_arguments_are_ledger_errors(tmp_path: Path) -> None:
    with pytest.raises(LedgerError, match="synchronous"):
        LedgerWriter.open(tmp_path / "a.db", synchronous="off")  # type: ignore[arg-type]
    with pytest.raises(LedgerError, match="batch_max"):
        LedgerWriter.open(tmp_path / "b.db", batch_max=0)
