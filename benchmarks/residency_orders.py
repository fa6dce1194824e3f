"""How far any eviction order can go on a trace: one pooled KV cache, one order per row.

    .venv/bin/python benchmarks/residency_orders.py TRACE [--blocks 4000] [--limit N]

The conversation trace's rows in `appliance replay` stay 1.33-1.37x the optimum whatever
the residency policy. This asks what an order *could* do with what it can know, without
routing, timing or the engine: one cache of `--blocks` blocks (the replay's 8 x 500
pooled), requests in trace order, a request's prefix hit as far as its leading blocks are
cached, then its blocks inserted, then whole idle sessions dropped, lowest first, until the
cache fits (the universal first block stays). Rows, fresh prefill in Mtok and x Belady:

- `lru`: least recently used session first (vLLM's free queue).
- `belady`: per block, the one needed furthest in the future (the replay's optimum).
- `oracle-return`: per session, the one whose next turn is furthest (knows each return).
- `offline-depth`: value density P(return) / E[wait] by the session's depth (turns so far,
  1..4+) and idle time, from the whole trace's statistics (hindsight of the distribution,
  not of any session).
- `offline-features`: the same by everything the trace says of a turn: depth, the gap
  before it, its prompt and output lengths (four or five bands each).
- `online-depth`: the same by depth, learned as the trace goes (what the reaper can know).

The difference between the `offline-*` rows and `belady` is what knowing the distribution
of returns cannot buy: the share of the gap only an oracle closes. Below the rows, the share
of first turns that come back, by band of each feature.
"""

from __future__ import annotations

import argparse
import math
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from appliance.sim.runtime.trace import (
    TRACE_BLOCK_TOKENS,
    TraceRecord,
    conversation_ids,
    load_mooncake,
)

HORIZON_S = 1800.0
"""The reaper's maximum residency: a session not back within it counts as gone."""
MAX_DEPTH = 4
LENGTH_BANDS = (2000, 5000, 10000, 40000)
OUTPUT_BANDS = (100, 300, 600, 1000)
GAP_BANDS = (30.0, 120.0, 300.0, 900.0)


@dataclass
class WaitTable:
    """Return gaps and turn ends per feature key: P(back within the horizon | idle) and
    E[min(remaining wait, horizon) | idle] by counting."""

    gaps: defaultdict[object, list[float]] = field(default_factory=lambda: defaultdict(list))
    ends: Counter[object] = field(default_factory=Counter)

    def density(self, key: object, idle_s: float) -> float:
        gaps = [g for g in self.gaps[key] if idle_s < g <= HORIZON_S]
        gone = max(self.ends[key] - len(self.gaps[key]), 0)
        alive = len(gaps) + gone
        if alive == 0:
            return -idle_s * 1e-9  # nothing known: least recently used first
        p = len(gaps) / alive
        wait_s = (sum(g - idle_s for g in gaps) + gone * (HORIZON_S - idle_s)) / alive
        return p / max(wait_s, 1e-3)


@dataclass
class Trace:
    records: Sequence[TraceRecord]
    sessions: list[str]
    depth: list[int]
    next_return_s: list[float | None]
    previous_gap_s: list[float | None]

    @classmethod
    def load(cls, path: Path, limit: int | None) -> Trace:
        records = load_mooncake(path, limit=limit)
        sessions = conversation_ids(records)
        seen: Counter[str] = Counter()
        depth = []
        for s in sessions:
            seen[s] += 1
            depth.append(seen[s])
        nxt: list[float | None] = [None] * len(records)
        last: dict[str, float] = {}
        for i in range(len(records) - 1, -1, -1):
            nxt[i] = last.get(sessions[i])
            last[sessions[i]] = records[i].timestamp_s
        previous: list[float | None] = [None] * len(records)
        last.clear()
        for i, (s, rec) in enumerate(zip(sessions, records, strict=True)):
            if s in last:
                previous[i] = rec.timestamp_s - last[s]
            last[s] = rec.timestamp_s
        return cls(records, sessions, depth, nxt, previous)


def depth_key(trace: Trace, i: int) -> object:
    return min(trace.depth[i], MAX_DEPTH)


def band(value: float, bands: Sequence[float]) -> int:
    return next((k for k, b in enumerate(bands) if value < b), len(bands))


def features_key(trace: Trace, i: int) -> object:
    rec, gap = trace.records[i], trace.previous_gap_s[i]
    return (
        depth_key(trace, i),
        -1 if gap is None else band(gap, GAP_BANDS),
        band(rec.input_length, LENGTH_BANDS),
        band(rec.output_length, OUTPUT_BANDS),
    )


def first_turn_returns(trace: Trace) -> dict[str, list[tuple[int, float]]]:
    """Per feature, per band: first turns, and the share of them whose session comes back."""
    features = {
        "prompt": (lambda r: r.input_length, LENGTH_BANDS),
        "output": (lambda r: r.output_length, OUTPUT_BANDS),
        "arrival, 10 min": (lambda r: r.timestamp_s, tuple(600.0 * k for k in range(1, 6))),
    }
    out = {}
    for name, (value, bands) in features.items():
        seen, back = Counter[int](), Counter[int]()
        for i, rec in enumerate(trace.records):
            if trace.depth[i] == 1:
                k = band(value(rec), bands)
                seen[k] += 1
                back[k] += trace.next_return_s[i] is not None
        out[name] = [(seen[k], back[k] / seen[k]) for k in sorted(seen)]
    return out


def offline_table(trace: Trace, key: Callable[[Trace, int], object]) -> WaitTable:
    table = WaitTable()
    for i, rec in enumerate(trace.records):
        k = key(trace, i)
        table.ends[k] += 1
        nxt = trace.next_return_s[i]
        if nxt is not None:
            table.gaps[k].append(nxt - rec.timestamp_s)
    return table


def by_session(
    trace: Trace,
    blocks: int,
    score: Callable[[int, float], float],
    learn: WaitTable | None = None,
    key: Callable[[Trace, int], object] = depth_key,
) -> int:
    """Blocks hit when whole idle sessions are dropped lowest `score(last request, now)`
    first; `learn`: a table fed as the trace goes (returns as they happen)."""
    owner: dict[int, str] = {}
    held: defaultdict[str, set[int]] = defaultdict(set)
    last_request: dict[str, int] = {}
    hits = 0
    for i, rec in enumerate(trace.records):
        s, now = trace.sessions[i], rec.timestamp_s
        hits += _prefix_hit(rec.hash_ids, owner)
        if learn is not None:
            if s in last_request:
                j = last_request[s]
                learn.gaps[key(trace, j)].append(now - trace.records[j].timestamp_s)
            learn.ends[key(trace, i)] += 1
        last_request[s] = i
        for b in rec.hash_ids:
            previous = owner.get(b)
            if previous is not None and previous != s:
                held[previous].discard(b)
            owner[b] = s
            held[s].add(b)
        if len(owner) > blocks:
            _drop(owner, held, s, blocks, lambda o, now=now: score(last_request[o], now))
    return hits


def _prefix_hit(hash_ids: Sequence[int], cached: dict[int, str]) -> int:
    n = 0
    for b in hash_ids:
        if b not in cached:
            break
        n += 1
    return n


def _drop(
    owner: dict[int, str],
    held: defaultdict[str, set[int]],
    current: str,
    blocks: int,
    score: Callable[[str], float],
) -> None:
    size = len(owner)
    for o in sorted((o for o in held if held[o] and o != current), key=score):
        if size <= blocks:
            return
        dropped = held.pop(o)
        if 0 in dropped:  # every request shares block 0: the current one keeps it
            dropped.discard(0)
            owner[0] = current
            held[current].add(0)
        for b in dropped:
            del owner[b]
        size -= len(dropped)


def belady(trace: Trace, blocks: int) -> int:
    """Per block, drop the one needed furthest ahead (ties: any)."""
    next_use: list[list[float]] = [[]] * len(trace.records)
    later: dict[int, float] = {}
    for i in range(len(trace.records) - 1, -1, -1):
        next_use[i] = [later.get(b, math.inf) for b in trace.records[i].hash_ids]
        for b in trace.records[i].hash_ids:
            later[b] = i
    cached: dict[int, float] = {}
    hits = 0
    for i, rec in enumerate(trace.records):
        hits += _prefix_hit(rec.hash_ids, cached)  # type: ignore[arg-type]
        for b, nxt in zip(rec.hash_ids, next_use[i], strict=True):
            cached[b] = nxt
        if len(cached) > blocks:
            for b in sorted(cached, key=cached.__getitem__)[blocks:]:
                del cached[b]
    return hits


def rows(trace: Trace, blocks: int) -> dict[str, int]:
    recs = trace.records

    def lru(i: int, now: float) -> float:
        return recs[i].timestamp_s

    def oracle(i: int, now: float) -> float:
        nxt = trace.next_return_s[i]
        return -math.inf if nxt is None else -(nxt - now)

    def density(table: WaitTable, key: Callable[[Trace, int], object]) -> Callable[..., float]:
        return lambda i, now: table.density(key(trace, i), now - recs[i].timestamp_s)

    online = WaitTable()
    return {
        "lru": by_session(trace, blocks, lru),
        "belady": belady(trace, blocks),
        "oracle-return": by_session(trace, blocks, oracle),
        "offline-depth": by_session(
            trace, blocks, density(offline_table(trace, depth_key), depth_key)
        ),
        "offline-features": by_session(
            trace, blocks, density(offline_table(trace, features_key), features_key)
        ),
        "online-depth": by_session(trace, blocks, density(online, depth_key), online),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("trace", type=Path)
    parser.add_argument("--blocks", type=int, default=4000)
    parser.add_argument("--limit", type=int, default=None)
    args = parser.parse_args()
    trace = Trace.load(args.trace, args.limit)
    total = sum(len(r.hash_ids) for r in trace.records)
    started = time.perf_counter()
    result = rows(trace, args.blocks)
    optimum = total - result["belady"]
    print(f"{len(trace.records)} requests, {args.blocks} blocks of {TRACE_BLOCK_TOKENS} pooled")
    print(f"{'order':<22} {'hit':>6} {'fresh Mtok':>10} {'x belady':>8}")
    for name, hits in result.items():
        fresh = total - hits
        mtok = fresh * TRACE_BLOCK_TOKENS / 1e6
        print(f"{name:<22} {hits / total:>6.1%} {mtok:>10.2f} {fresh / optimum:>8.3f}")
    print("first turns that come back, by band (first turns, share):")
    for name, cells in first_turn_returns(trace).items():
        print(f"  {name}: " + ", ".join(f"{n} {p:.0%}" for n, p in cells))
    print(f"wall {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
