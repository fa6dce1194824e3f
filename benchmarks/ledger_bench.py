"""Durable turns per second of the ledger writer (a turn counts once its Future resolved,
i.e. its transaction committed), for synchronous=full and normal.

    .venv/bin/python benchmarks/ledger_bench.py [--turns 100000] [--batch-max 1024]
        [--producers 1] [--dir DIR]

Producers are threads submitting TurnRecords as fast as they can while keeping at most
`--window` writes outstanding (like a busy server awaiting its acknowledgements); the
clock runs from the first submit to the last resolved Future. Target: 10,000 turns/s.
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
from collections import deque
from concurrent.futures import Future
from pathlib import Path

from appliance.domain.records import (
    CostMode,
    Price,
    SessionId,
    TaskId,
    TenantId,
    TurnId,
    TurnOutcome,
    TurnRecord,
    WorkerId,
)
from appliance.ledger import Ledger


def make_turn(producer: int, i: int) -> TurnRecord:
    now = time.time()
    return TurnRecord(
        turn_id=TurnId(f"p{producer}-t{i}"),
        tenant=TenantId("bench"),
        task_id=TaskId(f"p{producer}-task{i // 8}"),
        session_id=SessionId(f"p{producer}-s{i // 8}"),
        worker=WorkerId(f"w{i % 4}"),
        model="bench-model",
        prompt_tokens=4000 + i % 1000,
        cached_tokens=3000,
        output_tokens=200,
        reasoning_tokens=50,
        outcome=TurnOutcome.OK,
        started_at=now - 1.5,
        finished_at=now,
        queue_s=0.01,
        ttft_s=0.2,
        e2e_s=1.5,
        gpu_s=1.5,
        predicted_cached_tokens=3000,
    )


def produce(ledger: Ledger, producer: int, n: int, window: int, errors: list[int]) -> None:
    pending: deque[Future[float | None]] = deque()
    for i in range(n):
        pending.append(ledger.record_turn(make_turn(producer, i)))
        if len(pending) >= window and pending.popleft().exception() is not None:
            errors.append(i)
    for fut in pending:
        if fut.exception() is not None:
            errors.append(-1)


def run(
    path: Path, synchronous: str, turns: int, batch_max: int, producers: int, window: int
) -> tuple[int, float, int]:
    ledger = Ledger.open(path, synchronous=synchronous, batch_max=batch_max)  # type: ignore[arg-type]
    ledger.set_price(Price(CostMode.TOKENS, 0.0, fresh_per_mtok=3.0, output_per_mtok=15.0))
    ledger.flush()
    errors: list[int] = []
    per = turns // producers
    threads = [
        threading.Thread(target=produce, args=(ledger, p, per, window, errors))
        for p in range(producers)
    ]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - start
    ledger.close()
    return per * producers, elapsed, len(errors)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--turns", type=int, default=100_000)
    ap.add_argument("--batch-max", type=int, default=1024)
    ap.add_argument("--producers", type=int, default=1)
    ap.add_argument("--window", type=int, default=4096, help="most unacknowledged writes")
    ap.add_argument("--dir", type=Path, default=None, help="where the ledger files go")
    args = ap.parse_args()
    print(
        f"batch_max={args.batch_max} producers={args.producers} window={args.window} "
        f"turns={args.turns}"
    )
    print(f"{'synchronous':<12} {'turns':>8} {'seconds':>8} {'turns/s':>9} {'errors':>6}")
    for synchronous in ("full", "normal"):
        with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
            n, elapsed, errors = run(
                Path(tmp) / "ledger.db",
                synchronous,
                args.turns,
                args.batch_max,
                args.producers,
                args.window,
            )
        print(f"{synchronous:<12} {n:>8} {elapsed:>8.2f} {n / elapsed:>9.0f} {errors:>6}")


if __name__ == "__main__":
    main()
