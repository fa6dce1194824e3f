"""Trace loading, session grouping and the offline bounds of the replay, including the check
that the replayed no-cache and unbounded-cache figures match the trace's own statistics."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest

from appliance.replay.bounds import (
    block_keys,
    compute_bounds,
    no_cache,
    optimal,
    trace_stats_check,
    unbounded,
)
from appliance.replay.traces import load_trace, trace_stats_file
from tests.paths import AZURE, MOONCAKE

ROOT = Path(__file__).resolve().parents[2]


def write_jsonl(path: Path, rows: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def row(t_ms: int, ids: list[int], n: int | None = None, out: int = 10, **extra: object):
    return {
        "timestamp": t_ms,
        "input_length": n if n is not None else 512 * len(ids),
        "output_length": out,
        "hash_ids": ids,
        **extra,
    }


# --- loading ------------------------------------------------------------------------------


def test_mooncake_sessions_come_from_prefix_chains(tmp_path: Path) -> None:
    """A turn continues the latest request whose ids less the last (a trimmed block the
    next turn re-hashes) begin its ids; block 0 alone, shared by all, links nothing."""
    path = write_jsonl(
        tmp_path / "t.jsonl",
        [
            row(0, [0, 1, 2], 1300),
            row(0, [0, 3, 4], 1300),
            row(1000, [0, 1, 5, 6], 1800),  # continues #0
            row(2000, [0, 3, 4, 7]),  # continues #1
            row(3000, [0, 8]),  # shares block 0 only: a new conversation
            row(4000, [0, 1, 5, 6, 9]),  # continues #2
            row(5000, [0, 8, 10]),  # #4 less its last id is [0]: too short to link
        ],
    )
    trace = load_trace(path)
    assert trace.format == "mooncake" and trace.session_source == "prefix-chains"
    assert trace.sessions == ["conv-0", "conv-1", "conv-0", "conv-1", "conv-4", "conv-0", "conv-6"]
    assert trace.records[2].timestamp_s == 1.0
    assert trace.input_tokens == 1300 + 1300 + 1800 + 2048 + 1024 + 2560 + 1536
    assert len(load_trace(path, limit=2).records) == 2


def test_mooncake_explicit_session_field_wins(tmp_path: Path) -> None:
    path = write_jsonl(
        tmp_path / "t.jsonl",
        [row(0, [0, 1], session_id="a"), row(5, [0, 1, 2], session_id="b")],
    )
    trace = load_trace(path)
    assert trace.session_source == "explicit"
    assert trace.sessions == ["a", "b"]


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        ([row(10, [0]), row(5, [1])], "arrives before"),
        ([row(0, [0, 1], n=2000)], "does not fit"),
    ],
)
def test_mooncake_bad_lines_are_refused(tmp_path: Path, rows, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        load_trace(write_jsonl(tmp_path / "bad.jsonl", rows))


def test_azure_rows_get_private_blocks_and_relative_times(tmp_path: Path) -> None:
    path = tmp_path / "a.csv"
    path.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:17:03.9799600,1100,10\n"
        "2023-11-16 18:17:04.4799600,512,3\n"
    )
    trace = load_trace(path)
    assert trace.format == "azure" and trace.session_source == "none"
    assert [r.hash_ids for r in trace.records] == [(0, 1, 2), (3,)]
    assert trace.records[1].timestamp_s == pytest.approx(0.5)
    assert trace.sessions == ["req-0", "req-1"]
    bounds = compute_bounds(trace, 512, 100)
    assert bounds["unbounded"].fresh_prefill_tokens == 1612  # nothing shared


def test_unknown_trace_suffix(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown trace format"):
        load_trace(tmp_path / "trace.parquet")


# --- bounds ---------------------------------------------------------------------------

BS = 4


def test_no_cache_and_unbounded_follow_vllm_rules() -> None:
    prompts = [8, 8, 9, 12]
    keys = [(1, 2), (1, 2), (1, 2), (1, 2, 3)]
    assert no_cache(prompts).fresh_prefill_tokens == 37
    b = unbounded(prompts, keys, BS)
    # #2: 8 tokens, at most (8-1)//4 = 1 block; #3: 9 tokens, 2 blocks; #4: 12 tokens, 2
    # blocks (block 3 is new anyway).
    assert b.cached_tokens == 4 + 8 + 8
    assert b.fresh_prefill_tokens == 37 - 20
    assert b.hit_ratio == pytest.approx(20 / 37)


def test_belady_keeps_the_block_used_soonest() -> None:
    prompts = [5, 5, 5, 5, 5]
    keys = [(1,), (2,), (1,), (3,), (2,)]
    # Capacity 1: after #2 (key 2) Belady keeps 1 (next use #3) over 2 (next use #5);
    # LRU would keep 2 and miss #3.
    b = optimal(prompts, keys, BS, capacity_blocks=1)
    assert b.cached_tokens == 4
    assert optimal(prompts, keys, BS, capacity_blocks=2).cached_tokens == 8
    assert optimal(prompts, keys, BS, capacity_blocks=100) == optimal(
        prompts, keys, BS, capacity_blocks=100
    )
    big = optimal(prompts, keys, BS, capacity_blocks=100)
    assert big.cached_tokens == unbounded(prompts, keys, BS).cached_tokens


def test_belady_evicts_children_before_their_shared_prefix() -> None:
    prompts = [9, 9, 9]
    keys = [(1, 2), (1, 3), (1, 2)]
    # Capacity 2: key 1 is used by every request; the optimal keeps 1 and 2 (used by #3).
    b = optimal(prompts, keys, BS, capacity_blocks=2)
    assert b.cached_tokens == 4 + 8
    assert b.capacity_blocks == 2


def test_block_keys_from_ids_and_from_tokens_name_the_same_blocks(tmp_path: Path) -> None:
    path = write_jsonl(
        tmp_path / "t.jsonl",
        [row(0, [0, 1, 2], 1300), row(1, [0, 1, 2, 5], 1800), row(2, [0, 7], 700), row(3, [9])],
    )
    trace = load_trace(path)
    by_ids = block_keys(trace, 512)
    by_tokens = block_keys(trace, 512, from_tokens=True)
    assert [len(k) for k in by_ids] == [2, 3, 1, 1]
    assert [len(k) for k in by_tokens] == [2, 3, 1, 1]
    for a, b in ((by_ids, by_tokens), (by_tokens, by_ids)):
        pairs = {(x, y) for ka, kb in zip(a, b, strict=True) for x, y in zip(ka, kb, strict=True)}
        assert len({x for x, _ in pairs}) == len(pairs)  # one-to-one
    # At a finer block size the first turn's trimmed tail (1300 tokens) is shared too.
    fine = block_keys(trace, 256)
    assert fine[0] == fine[1][:5]
    assert by_ids[0] == by_ids[1][:2]


def test_trace_stats_check(tmp_path: Path) -> None:
    prompts = [8, 8]
    bounds = {"no_cache": no_cache(prompts), "unbounded": unbounded(prompts, [(1,), (1,)], BS)}
    stats = tmp_path / "t.stats.json"
    stats.write_text(
        json.dumps({"total_input_tokens": 16, "prefix_hit_token_ratio_infinite_cache": 0.3})
    )
    check = trace_stats_check(stats, bounds)
    assert check["no_cache"]["within_1pct"] is True
    assert check["unbounded"]["expected_fresh_tokens"] == 11
    assert check["unbounded"]["replayed_fresh_tokens"] == 12
    assert check["unbounded"]["within_1pct"] is False


# --- the real traces ------------------------------------------------------------------


def test_mooncake_bounds_match_the_trace_statistics() -> None:
    """No cache: every input token (exact). Unbounded: the statistics' 37.4% of input tokens
    an infinite prefix cache serves, within 1% (here vLLM's rules: full blocks only, never
    the last token)."""
    trace = load_trace(MOONCAKE)
    stats_path = trace_stats_file(MOONCAKE)
    assert stats_path is not None
    stats = json.loads(stats_path.read_text())
    assert len(trace.records) == stats["rows"]
    chains = stats["chains_by_prefix_extension"]
    assert abs(len(set(trace.sessions)) - chains["n_chains"]) <= 1  # 8,057 vs 8,056
    per_session = Counter(trace.sessions)
    assert max(per_session.values()) == chains["chain_len"]["max"]
    assert sum(1 for n in per_session.values() if n > 1) == chains["n_multi_request_chains"]
    bounds = compute_bounds(trace, 512, 8 * 1781)
    check = trace_stats_check(stats_path, bounds)
    assert check["no_cache"]["relative_error"] == 0.0
    assert check["unbounded"]["within_1pct"] is True
    assert abs(check["unbounded"]["relative_error"]) < 0.001
    assert bounds["unbounded"].hit_ratio == pytest.approx(0.3736, abs=0.001)
    # Belady on 8 x 111 GiB pooled keeps everything the trace reuses; on 8 x 4 GiB it
    # cannot (and it still beats a cache of 8 GiB).
    assert bounds["optimal"] == replace(bounds["unbounded"], capacity_blocks=8 * 1781)
    prompts = [r.input_length for r in trace.records]
    keys = block_keys(trace, 512)
    small = optimal(prompts, keys, 512, 8 * 64).fresh_prefill_tokens
    smaller = optimal(prompts, keys, 512, 2 * 64).fresh_prefill_tokens
    assert bounds["unbounded"].fresh_prefill_tokens < small < smaller
    assert smaller < bounds["no_cache"].fresh_prefill_tokens


def test_azure_trace_loads_with_its_statistics() -> None:
    trace = load_trace(AZURE)
    stats = json.loads(AZURE.with_name(AZURE.stem + ".stats.json").read_text())
    assert len(trace.records) == stats["rows"]
    assert trace.input_tokens == stats["total_input_tokens"]
    assert trace.output_tokens == stats["total_output_tokens"]
    assert trace.span_s == pytest.approx(stats["time_span_s"], abs=0.1)
