"""Residency baselines in the replay: a hand-made trace where a TTL pin keeps a session's
prefix across its tool wait that LRU loses under pressure, and where the pin lapses."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from appliance.replay import render_table, run_replay
from appliance.replay.runner import make_setup

BLOCK = 512


def write_trace(path: Path, rows: list[tuple[float, list[int], int]]) -> Path:
    lines = [
        {"timestamp": int(t * 1000), "input_length": n, "output_length": 1, "hash_ids": ids}
        for t, ids, n in rows
    ]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


@pytest.fixture(scope="module")
def tool_wait(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One worker of 16 blocks. A's first turn (3 full blocks and a partial one) ends in a
    tool call at t=0; B's at t=2; C, a 12-block prompt of another session, arrives at t=4,
    while both wait; A's next turn re-sends A's 3 full blocks at t=8.

    LRU (vLLM's free queue): C takes the 10 never-used or partial blocks, then evicts from
    the LRU end: A's blocks, tail first (3rd, 2nd), so A's next turn finds only its 1st
    block: 512 cached tokens. ttl-pin: A and B are pinned; C is 2 blocks short, so pins
    give way latest expiry first (Continuum): B's goes, A's stays, and A's next turn finds
    all 3 blocks: 1536 cached tokens."""
    return write_trace(
        tmp_path_factory.mktemp("residency") / "tool_wait.jsonl",
        [
            (0.0, [1, 2, 3, 4], 4 * BLOCK - 100),
            (2.0, [11, 12, 13, 14], 4 * BLOCK - 100),
            (4.0, list(range(21, 33)), 12 * BLOCK - 100),
            (8.0, [1, 2, 3, 5, 6], 5 * BLOCK - 100),
        ],
    )


@pytest.fixture(scope="module")
def report(tool_wait: Path) -> dict:
    setup, _ = make_setup(workers=1, hbm_gib=1.0)
    assert setup.kv_blocks_per_worker == 16 and setup.block_size == BLOCK
    return run_replay(
        tool_wait,
        policies=["round-robin"],
        residencies=["lru", "ttl-pin", "ttl-pin:1"],
        workers=1,
        hbm_gib=1.0,
    )


def test_rows_are_named_routing_plus_residency(report: dict) -> None:
    assert list(report["policies"]) == [
        "round-robin",
        "round-robin+ttl-pin",
        "round-robin+ttl-pin:1",
    ]
    table = render_table(report)
    assert "round-robin+ttl-pin " in table and "round-robin+ttl-pin:1 " in table


def test_ttl_pin_keeps_the_prefix_lru_loses(report: dict) -> None:
    lru, pin = report["policies"]["round-robin"], report["policies"]["round-robin+ttl-pin"]
    # Only A's second turn can hit anything.
    assert lru["cached_tokens"] == 1 * BLOCK
    assert pin["cached_tokens"] == 3 * BLOCK
    assert lru["pins"] == 0 and lru["residency_by_reason"] == {"least recently used goes first": 4}
    # Every turn of a trace is pinned (no tool markers); B's pin gave way for C, A resumed
    # its own; C's and A's last pins stand at the end.
    assert pin["pins"] == 4 and pin["pins_reclaimed"] == 1 and pin["pins_resumed"] == 1
    assert pin["pins_expired"] == 0
    assert lru["preemptions"] == pin["preemptions"] == 0
    assert pin["fresh_prefill_tokens"] == lru["fresh_prefill_tokens"] - 2 * BLOCK


def test_a_lapsed_pin_is_ordinary_lru(report: dict) -> None:
    """With a 1 s TTL, A's pin lapses before C comes: its blocks are appended to the LRU end
    when it lapses (at the next step, B's), ahead of B's; C evicts A's tail as LRU does."""
    lru, short = report["policies"]["round-robin"], report["policies"]["round-robin+ttl-pin:1"]
    assert short["cached_tokens"] == lru["cached_tokens"] == 1 * BLOCK
    assert short["pins"] == 4 and short["pins_expired"] == 3 and short["pins_reclaimed"] == 0
    assert short["residency_by_reason"] == {"pinned for the N s TTL": 4}


def test_unknown_residency_is_refused(tool_wait: Path) -> None:
    with pytest.raises(ValueError, match="unknown residency policy 'mru'"):
        run_replay(tool_wait, policies=["round-robin"], residencies=["mru"], workers=1)
    with pytest.raises(ValueError, match="named twice"):
        run_replay(tool_wait, policies=["round-robin"], residencies=["lru", "lru"], workers=1)
