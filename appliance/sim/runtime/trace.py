"""Mooncake traces (FAST'25 release) as arrivals for the simulated engines.

Model of the world (/work/shared/traces/README.md): one JSON object a line with
`timestamp` (ms from the trace start), `input_length`, `output_length` and `hash_ids`, each
id standing for one 512-token block; the same id is the same 512 tokens, so a request whose
ids begin with another's re-sends that prefix. Here block id `b` becomes a fixed
pseudo-random block: its first two tokens spell `b` in base `vocab_size` (so different ids
never collide), the other 510 are a window of a seeded random token pool chosen by a
multiplicative hash of `b`. The prompt is the blocks in order, the last one trimmed to
`input_length`. Prompts are built lazily, one per arrival, so a 12k-request replay never
holds every prompt at once.

The trace has no session ids; `conversation_ids` recovers them: a request whose ids extend
an earlier request's ids (the longest such) is that conversation's next turn.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from appliance.sim.engine_io import DEFAULT_VOCAB_SIZE, SimRequest
from appliance.sim.runtime.virtual import Arrival

TRACE_BLOCK_TOKENS = 512
"""Tokens per Mooncake hash id."""


@dataclass(frozen=True, slots=True)
class TraceRecord:
    index: int
    timestamp_s: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def load_mooncake(path: str | Path, *, limit: int | None = None) -> list[TraceRecord]:
    """Read a Mooncake jsonl trace (the first `limit` lines, if given)."""
    return [record for record, _ in read_mooncake(path, limit=limit)]


def read_mooncake(
    path: str | Path, *, limit: int | None = None
) -> list[tuple[TraceRecord, dict[str, Any]]]:
    """Each line's record beside its raw fields (for fields beyond the format's four)."""
    out: list[tuple[TraceRecord, dict[str, Any]]] = []
    with Path(path).open() as f:
        for line in f:
            if limit is not None and len(out) >= limit:
                break
            if not line.strip():
                continue
            row = json.loads(line)
            ids = tuple(int(x) for x in row["hash_ids"])
            n = int(row["input_length"])
            if not ids or not 0 < n <= len(ids) * TRACE_BLOCK_TOKENS:
                raise ValueError(
                    f"{path}:{len(out) + 1}: input_length {n} does not fit "
                    f"{len(ids)} blocks of {TRACE_BLOCK_TOKENS}"
                )
            t = float(row["timestamp"]) / 1000.0
            out.append((TraceRecord(len(out), t, n, int(row["output_length"]), ids), row))
    return out


class BlockTokens:
    """Block id -> its fixed tokens, and whole prompts built from them."""

    def __init__(
        self,
        *,
        vocab_size: int = DEFAULT_VOCAB_SIZE,
        seed: int = 0,
        block_tokens: int = TRACE_BLOCK_TOKENS,
        pool_tokens: int = 1 << 16,
    ) -> None:
        if block_tokens < 3 or pool_tokens <= block_tokens:
            raise ValueError("need block_tokens >= 3 and a pool larger than a block")
        rng = random.Random(seed)
        self.vocab_size = vocab_size
        self.block_tokens = block_tokens
        self._pool = [rng.randrange(vocab_size) for _ in range(pool_tokens)]
        self._span = pool_tokens - block_tokens

    def _extend(self, out: list[int], block_id: int) -> None:
        v = self.vocab_size
        if block_id >= v * v or block_id < 0:
            raise ValueError(f"block id {block_id} does not fit two tokens of {v}")
        out.append(block_id % v)
        out.append(block_id // v)
        off = (block_id * 2654435761) % self._span
        out.extend(self._pool[off : off + self.block_tokens - 2])

    def tokens(self, block_id: int) -> list[int]:
        out: list[int] = []
        self._extend(out, block_id)
        return out

    def prompt(self, hash_ids: Sequence[int], input_length: int) -> list[int]:
        out: list[int] = []
        for block_id in hash_ids:
            self._extend(out, block_id)
        del out[input_length:]
        return out


def conversation_ids(records: Sequence[TraceRecord]) -> list[str]:
    """A conversation id per record: `conv-<index of its first turn>`.

    A turn's last block is usually partial, so the next turn, whose block at that place is
    full, carries a new id there: a request continues the latest earlier request whose ids
    *less the last one* (two ids at least, since every request shares block 0) begin its
    own ids. On the conversation trace this finds the statistics' chains (3,974
    continuations vs 3,975, 2,012 chains of two turns or more, the longest 43)."""
    owner: dict[int, str] = {}  # chain key of an earlier request's ids less the last
    out: list[str] = []
    for rec in records:
        keys = []
        key = 0
        for block_id in rec.hash_ids:
            key = hash((key, block_id))  # ints hash the same in every process
            keys.append(key)
        session = next((owner[k] for k in reversed(keys[1:]) if k in owner), f"conv-{rec.index}")
        out.append(session)
        if len(keys) >= 3:
            owner[keys[-2]] = session
    return out


def trace_arrivals(
    records: Iterable[TraceRecord],
    blocks: BlockTokens,
    *,
    sessions: Sequence[str] | None = None,
    time_scale: float = 1.0,
    id_prefix: str = "req-",
) -> Iterator[Arrival]:
    """One `Arrival` per record, its prompt built only when the driver reaches it.
    `time_scale` < 1 compresses the trace's time; `sessions` (by record index) become the
    requests' session ids."""
    for rec in records:
        t = rec.timestamp_s * time_scale
        yield Arrival(
            t,
            SimRequest(
                request_id=f"{id_prefix}{rec.index}",
                prompt_token_ids=blocks.prompt(rec.hash_ids, rec.input_length),
                max_tokens=max(rec.output_length, 1),
                session_id=sessions[rec.index] if sessions is not None else None,
                arrival_s=t,
            ),
        )
