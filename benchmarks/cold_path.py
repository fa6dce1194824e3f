"""How much slower the router's decision code runs when it has not run for a while.

    .venv/bin/python benchmarks/cold_path.py [--repeat 100]

A router sees one turn every few to tens of milliseconds, and between turns the CPU runs
other things (the workers, the client, on a shared host other machines), which push the
router's code and data out of the CPU caches. This measures three pieces of the router's
own per-turn work, each the way the router runs it, back to back ("hot") and after a pause:

- `route`: the routing policy choosing between two workers (pure Python);
- `parse`: orjson parsing a 60 kB chat body (C, memory-bound);
- `lookup`: 500 block hashes checked against a 26k-hash set (the KV index's lookup);
- `commit`: one turn row through the ledger writer until acknowledged (its thread, SQLite
  WAL, `synchronous=full`, in a temporary directory on this disk): what a non-streamed
  answer waits for before it leaves, since nothing is acknowledged before it is durable.

Pauses: `sleep N ms` (the process is idle), and `spin 20 ms` (the process keeps its CPU
busy in a loop that touches almost no memory: if the code is still cold afterwards, what
evicted it ran beside the process, not instead of it). Each figure is the median of
`--repeat` calls in microseconds. `router_overhead.py` runs this first and keeps the result
with its figures, since it says how much a router's own time on this machine is the cost of
coming back cold.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import orjson

from appliance.domain.records import TenantId, TurnId, TurnOutcome, TurnRecord, WorkerId
from appliance.ledger import LedgerWriter
from appliance.perf.latency import LatencyModel
from appliance.perf.profile import bundled_profile
from appliance.policy.routing import RouteRequest, WorkerView, route
from appliance.policy.routing.core import default_profile

PAUSES: tuple[tuple[str, float, bool], ...] = (
    ("hot", 0.0, False),
    ("sleep 1 ms", 0.001, False),
    ("sleep 5 ms", 0.005, False),
    ("sleep 20 ms", 0.020, False),
    ("spin 20 ms", 0.020, True),
)


def workloads(rng: random.Random) -> dict[str, Callable[[], Any]]:
    cost = LatencyModel.from_profile(bundled_profile())
    profile = default_profile()
    w0, w1 = WorkerId("w0"), WorkerId("w1")
    views = [
        WorkerView(w0, frozenset({"m"}), resident_tokens=7_800, queue_s=0.02, queued_share=0.6),
        WorkerView(w1, frozenset({"m"}), resident_tokens=0, queue_s=0.01, queued_share=0.4),
    ]
    request = RouteRequest("m", 8_200, w0)
    words = [f"w{rng.randrange(50_000)}" for _ in range(9_000)]
    body = orjson.dumps(
        {
            "model": "m",
            "messages": [
                {"role": "system", "content": " ".join(words[:6_000])},
                {"role": "user", "content": " ".join(words[6_000:])},
            ],
            "max_tokens": 16,
        }
    )
    resident = {rng.getrandbits(64) for _ in range(26_000)}
    chain = rng.sample(sorted(resident), 500)
    return {
        "route": lambda: route(request, views, cost, profile),
        "parse": lambda: orjson.loads(body),
        "lookup": lambda: resident.issuperset(chain),
    }


@contextmanager
def durable_turn() -> Iterator[Callable[[], Any]]:
    """A call that writes one turn row and waits for its commit, while the ledger is open."""
    ids = itertools.count()
    with tempfile.TemporaryDirectory() as d, LedgerWriter.open(Path(d) / "ledger.db") as ledger:

        def commit() -> Any:
            now = time.time()
            turn = TurnRecord(
                TurnId(f"t{next(ids)}"),
                TenantId("bench"),
                None,
                None,
                WorkerId("w0"),
                "m",
                8_200,
                7_800,
                16,
                TurnOutcome.OK,
                now,
                now,
            )
            return ledger.record_turn(turn).result()

        yield commit


def _pause(seconds: float, spin: bool) -> None:
    if spin:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            pass
    elif seconds:
        time.sleep(seconds)


def measure(repeat: int = 100, seed: int = 7) -> dict[str, dict[str, float]]:
    """Median microseconds per call of each workload after each pause."""
    with durable_turn() as commit:
        calls = workloads(random.Random(seed)) | {"commit": commit}
        return _medians(calls, repeat)


def _medians(calls: dict[str, Callable[[], Any]], repeat: int) -> dict[str, dict[str, float]]:
    figures: dict[str, dict[str, float]] = {}
    for name, call in calls.items():
        for _ in range(20):  # warm: the first calls also allocate
            call()
        row = {}
        for label, seconds, spin in PAUSES:
            times = []
            for _ in range(repeat):
                _pause(seconds, spin)
                t0 = time.perf_counter()
                call()
                times.append((time.perf_counter() - t0) * 1e6)
            row[label] = round(statistics.median(times), 1)
        figures[name] = row
    return figures


def table(figures: dict[str, dict[str, float]]) -> str:
    labels = [label for label, _, _ in PAUSES]
    lines = [
        "| call | " + " | ".join(labels) + " |",
        "|---|" + "---|" * len(labels),
    ]
    for name, row in figures.items():
        hot = row["hot"] or 1e-9
        cells = [
            f"{row[label]:.1f}" + ("" if label == "hot" else f" (x{row[label] / hot:.1f})")
            for label in labels
        ]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=100)
    ap.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = ap.parse_args()
    figures = measure(args.repeat)
    print(json.dumps(figures, indent=2) if args.json else table(figures))


if __name__ == "__main__":
    main()
