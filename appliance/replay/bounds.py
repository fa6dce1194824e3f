"""What any placement could achieve: prefill with no cache, an unbounded cache, and the
offline-optimal cache of the replay's total capacity.

Model of the world: a prompt is a chain of full blocks of `block_size` tokens, each key
naming its whole prefix (vLLM hashes a block with its parent's hash). A request reuses the
longest run of leading blocks some cache holds, never its last token (vLLM keeps one token
to compute logits from: at most `(n - 1) // block_size` blocks), and prefills the rest;
afterwards every full block of its prompt is cached. Requests come in trace order, one at
a time, all workers' caches pooled into one:

- no_cache: every prompt token is prefilled.
- unbounded: a cache that never evicts.
- optimal: Belady's MIN on a pooled cache of `capacity_blocks`: when over capacity, evict
  the block whose next use is farthest (never used again first; on ties the deeper block,
  so a cached prefix stays whole), the new blocks included (not caching is allowed). Blocks
  have one size, so this maximises reused blocks; it ignores that running requests pin
  their blocks and that requests overlap in time, so real placements fall short of it.
- optimal_with_host (with a host tier): the same Belady's MIN on the workers' HBM and host
  memory together, one pool of `capacity_blocks + host_blocks`: what any placement and any
  residency policy could reach with the host tier if promotion cost nothing and both tiers
  were one cache. Being pooled, it already assumes what a host tier shared by the box's
  workers allows; what such a tier gains in practice is measured by replaying it (the
  `+pooled-host` rows, `runner.py`), not bounded here.

Beside them, a floor of time to first token (`ttft_floor`): each request prefilled alone on
an idle worker of the GPU profile, every earlier prompt's blocks still cached (the
unbounded cache's hit), in chunks of the engine's token budget, each chunk one step of
`LatencyModel.prefill_s` over what is computed before it. A request never waits less or
finds more cached in a replay, and sharing a step only lengthens it, so no routing,
residency policy or schedule gets a request its first token sooner: the floor's
percentiles bound every row's.

The trace's own statistics (`*.stats.json`) state the same two figures: its total input
tokens and the share of them an unbounded prefix cache serves (`trace_stats_check`).
"""

from __future__ import annotations

import heapq
import json
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from appliance.domain.block_hash import cacheable_blocks
from appliance.domain.percentile import nearest_rank
from appliance.perf.latency import LatencyModel
from appliance.replay.traces import Trace
from appliance.sim.runtime.trace import TRACE_BLOCK_TOKENS, BlockTokens


@dataclass(frozen=True, slots=True)
class Bound:
    fresh_prefill_tokens: int
    cached_tokens: int
    capacity_blocks: int | None = None

    @property
    def hit_ratio(self) -> float:
        total = self.fresh_prefill_tokens + self.cached_tokens
        return self.cached_tokens / total if total else 0.0

    def to_json(self) -> dict[str, object]:
        out = asdict(self)
        out["hit_ratio"] = round(self.hit_ratio, 6)
        return out


def block_keys(
    trace: Trace,
    block_size: int,
    blocks: BlockTokens | None = None,
    *,
    from_tokens: bool = False,
) -> list[tuple[int, ...]]:
    """Per record, keys of its prompt's full blocks. At the trace's own block size a key
    chains the hash ids (the tokens of an id are fixed, so that is the same identity);
    else, or `from_tokens`, the prompt's tokens are built (`BlockTokens`) and chained block
    by block."""
    out: list[tuple[int, ...]] = []
    if block_size == TRACE_BLOCK_TOKENS and not from_tokens:
        for rec in trace.records:
            out.append(_chain(rec.hash_ids[: rec.input_length // block_size]))
        return out
    tokens = blocks or BlockTokens()
    for rec in trace.records:
        prompt = tokens.prompt(rec.hash_ids, rec.input_length)
        full = len(prompt) // block_size
        out.append(
            _chain(tuple(prompt[i * block_size : (i + 1) * block_size]) for i in range(full))
        )
    return out


def _chain(parts: Iterable[object]) -> tuple[int, ...]:
    key = 0
    keys = []
    for part in parts:
        key = hash((key, part))
        keys.append(key)
    return tuple(keys)


def no_cache(prompt_tokens: Sequence[int]) -> Bound:
    return Bound(sum(prompt_tokens), 0)


def unbounded(
    prompt_tokens: Sequence[int],
    keys: Sequence[tuple[int, ...]],
    bs: int,
    hits: Sequence[int] | None = None,
) -> Bound:
    """`hits`: the requests' `unbounded_hits`, when already counted."""
    cached = sum(unbounded_hits(prompt_tokens, keys, bs) if hits is None else hits)
    return Bound(sum(prompt_tokens) - cached, cached)


def unbounded_hits(
    prompt_tokens: Sequence[int], keys: Sequence[tuple[int, ...]], bs: int
) -> list[int]:
    """Per request, the tokens a cache that never evicts serves it."""
    seen: set[int] = set()
    hits = []
    for n, ks in zip(prompt_tokens, keys, strict=True):
        hits.append(_leading(ks, cacheable_blocks(n, bs), seen) * bs)
        seen.update(ks)
    return hits


@dataclass(frozen=True, slots=True)
class TtftFloor:
    """Nearest-rank percentiles of the requests' `prefill_alone_s` (see the module)."""

    p50_s: float
    p95_s: float
    p99_s: float

    def to_json(self) -> dict[str, float]:
        return {k: round(v, 4) for k, v in asdict(self).items()}


def prefill_alone_s(
    latency: LatencyModel, prompt_tokens: int, cached_tokens: int, chunk_tokens: int
) -> float:
    """A prompt's prefill alone on an idle worker: steps of at most `chunk_tokens`."""
    seconds, done = 0.0, cached_tokens
    while done < prompt_tokens:
        n = min(chunk_tokens, prompt_tokens - done)
        seconds += latency.prefill_s(n, done)
        done += n
    return seconds


def ttft_floor(
    trace: Trace, hits: Sequence[int], latency: LatencyModel, chunk_tokens: int
) -> TtftFloor:
    """The floor of `trace`'s requests (`hits`: their `unbounded_hits`)."""
    prompts = [r.input_length for r in trace.records]
    floors = [
        prefill_alone_s(latency, n, c, chunk_tokens) for n, c in zip(prompts, hits, strict=True)
    ]
    return TtftFloor(*(nearest_rank(floors, q) or 0.0 for q in (0.5, 0.95, 0.99)))


def optimal(
    prompt_tokens: Sequence[int], keys: Sequence[tuple[int, ...]], bs: int, capacity_blocks: int
) -> Bound:
    """Belady's MIN on one pooled cache of `capacity_blocks` blocks."""
    never = len(keys)
    next_use: list[list[int]] = [[] for _ in keys]
    last: dict[int, int] = {}
    for i in range(len(keys) - 1, -1, -1):
        next_use[i] = [last.get(k, never) for k in keys[i]]
        for k in keys[i]:
            last[k] = i
    cache: dict[int, int] = {}
    heap: list[tuple[int, int, int]] = []  # (-next use, -depth, key): farthest, deepest first
    cached = 0
    for i, (n, ks) in enumerate(zip(prompt_tokens, keys, strict=True)):
        cached += _leading(ks, cacheable_blocks(n, bs), cache) * bs
        for depth, (k, use) in enumerate(zip(ks, next_use[i], strict=True)):
            cache[k] = use
            heapq.heappush(heap, (-use, -depth, k))
        while len(cache) > capacity_blocks:
            use, _, k = heapq.heappop(heap)
            if cache.get(k) == -use:
                del cache[k]
    return Bound(sum(prompt_tokens) - cached, cached, capacity_blocks)


def _leading(ks: tuple[int, ...], cap: int, present: set[int] | dict[int, int]) -> int:
    n = 0
    for k in ks[:cap]:
        if k not in present:
            break
        n += 1
    return n


def compute_bounds(
    trace: Trace,
    block_size: int,
    capacity_blocks: int,
    keys: list[tuple[int, ...]] | None = None,
    *,
    host_blocks: int = 0,
    hits: Sequence[int] | None = None,
) -> dict[str, Bound]:
    """The bounds at `capacity_blocks` of HBM pooled, and with `host_blocks` (pooled) of
    host memory, `optimal_with_host` too (`hits`: the requests' `unbounded_hits`, when
    already counted)."""
    prompts = [r.input_length for r in trace.records]
    ks = keys if keys is not None else block_keys(trace, block_size)
    out = {
        "no_cache": no_cache(prompts),
        "unbounded": unbounded(prompts, ks, block_size, hits),
        "optimal": optimal(prompts, ks, block_size, capacity_blocks),
    }
    if host_blocks > 0:
        both = capacity_blocks + host_blocks
        out["optimal_with_host"] = optimal(prompts, ks, block_size, both)
    return out


def trace_stats_check(stats_path: Path, bounds: dict[str, Bound]) -> dict[str, object]:
    """The replay's no-cache and unbounded-cache prefill against the trace's statistics:
    `total_input_tokens`, and `(1 - prefix_hit_token_ratio_infinite_cache)` of it."""
    stats = json.loads(stats_path.read_text())
    out: dict[str, object] = {"file": str(stats_path)}
    total = stats.get("total_input_tokens")
    if isinstance(total, int):
        out["no_cache"] = _compare(total, bounds["no_cache"].fresh_prefill_tokens)
        ratio = stats.get("prefix_hit_token_ratio_infinite_cache")
        if isinstance(ratio, float):
            expected = round(total * (1.0 - ratio))
            out["unbounded"] = _compare(expected, bounds["unbounded"].fresh_prefill_tokens)
    return out


def _compare(expected: int, replayed: int) -> dict[str, object]:
    error = (replayed - expected) / expected if expected else 0.0
    return {
        "expected_fresh_tokens": expected,
        "replayed_fresh_tokens": replayed,
        "relative_error": round(error, 6),
        "within_1pct": abs(error) <= 0.01,
    }
