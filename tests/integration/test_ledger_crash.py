"""A writer process killed with SIGKILL mid-stream loses no acknowledged write, leaves a
sound file, and readers in other threads never see an error while it writes."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from contextlib import closing
from pathlib import Path

import pytest

from appliance.domain.records import TaskId, TenantId, TurnId, TurnOutcome, TurnRecord
from appliance.ledger import LedgerWriter, open_reader
from appliance.ledger.reports import cost_report

HELPER = Path(__file__).with_name("ledger_writer_proc.py")
ROOT = Path(__file__).resolve().parents[2]


def start_writer(db: Path, prefix: str, *, synchronous: str = "full") -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(HELPER), str(db), prefix, "--synchronous", synchronous],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )


def read_acks(proc: subprocess.Popen[str], n: int, timeout_s: float = 60.0) -> list[str]:
    """Read acknowledged ids until there are `n` of them."""
    assert proc.stdout is not None
    acks: list[str] = []
    deadline = time.monotonic() + timeout_s
    while len(acks) < n:
        line = proc.stdout.readline()
        if not line:
            pytest.fail(f"writer exited early: {proc.wait()} {proc.stderr and proc.stderr.read()}")
        acks.append(line.rstrip("\n"))
        assert time.monotonic() < deadline, "writer too slow"
    return acks


def kill(proc: subprocess.Popen[str]) -> list[str]:
    """SIGKILL the writer; return the complete lines it printed before it died."""
    os.kill(proc.pid, signal.SIGKILL)
    assert proc.wait(timeout=30) == -signal.SIGKILL
    assert proc.stdout is not None
    rest = proc.stdout.read()
    proc.stdout.close()
    if proc.stderr is not None:
        proc.stderr.close()
    lines = rest.split("\n")
    return lines[:-1]  # the last piece has no newline: it may be cut off


def new_turn(turn_id: str) -> TurnRecord:
    return TurnRecord(
        turn_id=TurnId(turn_id),
        tenant=TenantId("after"),
        task_id=TaskId("after"),
        session_id=None,
        worker=None,
        model="m",
        prompt_tokens=10,
        cached_tokens=0,
        output_tokens=1,
        outcome=TurnOutcome.OK,
        started_at=1.0,
        finished_at=2.0,
    )


@pytest.mark.parametrize("synchronous", ["full", "normal"])
def test_sigkill_mid_stream_loses_no_acknowledged_turn(tmp_path: Path, synchronous: str) -> None:
    db = tmp_path / "ledger.db"
    proc = start_writer(db, "k", synchronous=synchronous)
    acked = read_acks(proc, 3000)
    acked += kill(proc)

    conn = sqlite3.connect(db)
    stored = {r[0] for r in conn.execute("SELECT turn_id FROM turns")}
    assert conn.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
    conn.close()
    missing = [t for t in acked if t not in stored]
    assert not missing, f"{len(missing)} acknowledged turns lost, e.g. {missing[:3]}"
    assert len(stored) >= len(acked) >= 3000

    # The file takes new writes after the crash.
    with LedgerWriter.open(db) as ledger:
        futures = [ledger.record_turn(new_turn(f"after-{i}")) for i in range(100)]
        for fut in futures:
            fut.result(timeout=30)
    with closing(open_reader(db)) as conn:
        assert conn.execute("SELECT count(*) FROM turns").fetchone()[0] == len(stored) + 100
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"


def test_readers_never_see_an_error_while_another_process_writes(tmp_path: Path) -> None:
    db = tmp_path / "ledger.db"
    proc = start_writer(db, "r")
    read_acks(proc, 1)  # the schema exists from here on
    errors: list[BaseException] = []
    seen: dict[int, list[int]] = {}
    stop = threading.Event()

    def reader(n: int) -> None:
        counts = seen.setdefault(n, [])
        while not stop.is_set():
            try:
                if n == 0:  # one reader runs the full report the CLI runs
                    rows = cost_report(db)
                    counts.append(sum(r["attempts"] for r in rows))
                    continue
                conn = open_reader(db)
                try:
                    for _ in range(20):
                        counts.append(conn.execute("SELECT count(*) FROM turns").fetchone()[0])
                        conn.execute("SELECT sum(cost), max(finished_at) FROM turns").fetchone()
                finally:
                    conn.close()
            except Exception as exc:
                errors.append(exc)

    # Drain the writer's stdout while the readers run, or its pipe fills and it stalls.
    drained: list[str] = []
    drainer = threading.Thread(target=lambda: drained.extend(proc.stdout or []), daemon=True)
    drainer.start()
    readers = [threading.Thread(target=reader, args=(n,)) for n in range(4)]
    for t in readers:
        t.start()
    time.sleep(3.0)
    stop.set()
    for t in readers:
        t.join(timeout=30)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    drainer.join(timeout=30)

    assert errors == [], f"{len(errors)} reader errors, first: {errors[0]!r}"
    for n, counts in seen.items():
        assert counts, f"reader {n} read nothing"
        assert counts == sorted(counts), f"reader {n} saw the row count go down"
        assert counts[-1] > counts[0], f"reader {n} never saw the writer make progress"
    assert max(c[-1] for c in seen.values()) > 1000
