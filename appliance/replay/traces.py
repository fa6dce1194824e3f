"""Traces to replay: Mooncake jsonl and Azure csv, as one record list with sessions.

Model of the world (shared/traces/README.md): a Mooncake line is one request with its
arrival (`timestamp`, ms), `input_length`, `output_length` and `hash_ids`, one id per
512-token block, the same id the same tokens. An Azure line has `TIMESTAMP`,
`ContextTokens` and `GeneratedTokens` and no prefix information: each request gets block
ids no other request uses, so nothing is shared. Block ids become tokens through
`appliance.sim.runtime.trace.BlockTokens`.

Sessions come from an explicit field when a line has one (`session_id`, `conversation_id`,
`chat_id`; Azure: a `SessionId` column), else from prefix chains
(`appliance.sim.runtime.trace.conversation_ids`, which says how).
Records keep the file's order, which must be the arrival order.
"""

from __future__ import annotations

import csv
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from appliance.sim.runtime.trace import (
    TRACE_BLOCK_TOKENS,
    TraceRecord,
    conversation_ids,
    read_mooncake,
)

SESSION_FIELDS = ("session_id", "conversation_id", "chat_id", "SessionId", "session")


@dataclass(frozen=True, slots=True)
class Trace:
    path: Path
    format: str
    """"mooncake" or "azure"."""
    records: list[TraceRecord]
    sessions: list[str]
    """Session id per record (by index)."""
    session_source: str
    """"explicit", "prefix-chains" or "none" (one session per request)."""

    @property
    def span_s(self) -> float:
        return self.records[-1].timestamp_s - self.records[0].timestamp_s if self.records else 0.0

    @property
    def input_tokens(self) -> int:
        return sum(r.input_length for r in self.records)

    @property
    def output_tokens(self) -> int:
        return sum(r.output_length for r in self.records)

    def summary(self) -> dict[str, object]:
        return {
            "path": str(self.path),
            "format": self.format,
            "requests": len(self.records),
            "sessions": len(set(self.sessions)),
            "session_source": self.session_source,
            "span_s": round(self.span_s, 3),
            "input_tokens": self.input_tokens,
            "output_tokens": self.output_tokens,
        }


def load_trace(path: str | Path, *, limit: int | None = None) -> Trace:
    """Read a trace by its suffix: .jsonl (Mooncake) or .csv (Azure)."""
    p = Path(path)
    if p.suffix == ".csv":
        return load_azure(p, limit=limit)
    if p.suffix in (".jsonl", ".json"):
        return load_mooncake_trace(p, limit=limit)
    raise ValueError(f"{p}: unknown trace format (expected .jsonl Mooncake or .csv Azure)")


def load_mooncake_trace(path: Path, *, limit: int | None = None) -> Trace:
    rows = read_mooncake(path, limit=limit)
    records = [record for record, _ in rows]
    explicit = [None if (sid := _session_field(row)) is None else str(sid) for _, row in rows]
    _check_order(path, records)
    if records and all(s is not None for s in explicit):
        return Trace(path, "mooncake", records, [s or "" for s in explicit], "explicit")
    return Trace(path, "mooncake", records, conversation_ids(records), "prefix-chains")


def load_azure(path: Path, *, limit: int | None = None) -> Trace:
    records: list[TraceRecord] = []
    sessions: list[str] = []
    source = "none"
    t0: datetime | None = None
    next_id = 0
    with path.open(newline="") as f:
        for row in csv.DictReader(f):
            if limit is not None and len(records) >= limit:
                break
            ts = datetime.fromisoformat(_trim_fraction(row["TIMESTAMP"].strip()))
            t0 = t0 or ts
            n = int(row["ContextTokens"])
            blocks = -(-n // TRACE_BLOCK_TOKENS)
            ids = tuple(range(next_id, next_id + blocks))
            next_id += blocks
            i = len(records)
            t = (ts - t0).total_seconds()
            records.append(TraceRecord(i, t, n, int(row["GeneratedTokens"]), ids))
            sid = _session_field(row)
            source = "explicit" if sid is not None else source
            sessions.append(str(sid) if sid is not None else f"req-{i}")
    _check_order(path, records)
    return Trace(path, "azure", records, sessions, source)


def _session_field(row: dict[str, object]) -> object | None:
    for name in SESSION_FIELDS:
        value = row.get(name)
        if value not in (None, ""):
            return value
    return None


def _trim_fraction(stamp: str) -> str:
    """Azure writes 7 fractional digits; keep microseconds."""
    head, dot, frac = stamp.partition(".")
    return f"{head}.{frac[:6]}" if dot else head


def _check_order(path: Path, records: Sequence[TraceRecord]) -> None:
    for prev, rec in itertools.pairwise(records):
        if rec.timestamp_s < prev.timestamp_s:
            raise ValueError(f"{path}: line {rec.index + 1} arrives before the line above it")


def trace_stats_file(path: Path) -> Path | None:
    """The `*.stats.json` written beside a trace, if any."""
    stats = path.with_name(path.stem + ".stats.json")
    return stats if stats.is_file() else None
