"""A ledger writer in its own process, for the crash and concurrency tests.

    python ledger_writer_proc.py DB PREFIX [--count N] [--synchronous full|normal]

Records turns PREFIX-0, PREFIX-1, ... (forever when --count is 0) and prints each turn id
on stdout, flushed, only after its Future resolved: a printed id is an acknowledged one.
Keeps up to --window writes outstanding so the writer commits real batches.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import deque
from concurrent.futures import Future

from appliance.domain.records import (
    CostMode,
    Price,
    TaskId,
    TenantId,
    TurnId,
    TurnOutcome,
    TurnRecord,
    WorkerId,
)
from appliance.ledger import LedgerWriter


def turn(turn_id: str, i: int) -> TurnRecord:
    now = time.time()
    return TurnRecord(
        turn_id=TurnId(turn_id),
        tenant=TenantId("crash"),
        task_id=TaskId(f"task-{i // 10}"),
        session_id=None,
        worker=WorkerId("w0"),
        model="m",
        prompt_tokens=1000,
        cached_tokens=600,
        output_tokens=50,
        outcome=TurnOutcome.OK,
        started_at=now - 0.5,
        finished_at=now,
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("db")
    ap.add_argument("prefix")
    ap.add_argument("--count", type=int, default=0)
    ap.add_argument("--synchronous", choices=["full", "normal"], default="full")
    ap.add_argument("--window", type=int, default=256)
    args = ap.parse_args()
    ledger = LedgerWriter.open(args.db, synchronous=args.synchronous)
    ledger.set_price(Price(CostMode.TOKENS, 0.0, fresh_per_mtok=1.0)).result()
    out = sys.stdout
    pending: deque[tuple[str, Future[float | None]]] = deque()
    i = 0
    while args.count == 0 or i < args.count or pending:
        if args.count == 0 or i < args.count:
            turn_id = f"{args.prefix}-{i}"
            pending.append((turn_id, ledger.record_turn(turn(turn_id, i))))
            i += 1
            if len(pending) < args.window and (args.count == 0 or i < args.count):
                continue
        done_id, fut = pending.popleft()
        fut.result()  # raises if the write failed: then the id is never printed
        out.write(done_id + "\n")
        out.flush()
    ledger.close()


if __name__ == "__main__":
    main()
