"""The virtual-time driver (timing, ordering, routing, determinism, speed) and the Mooncake
trace loader."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from appliance.domain.block_hash import BlockHasher, HashAlgo
from appliance.perf.latency import LatencyModel
from appliance.perf.profile import bundled_profile
from appliance.sim.core.engine import EngineConfig, SimEngine
from appliance.sim.engine_io import SimRequest, StepResult
from appliance.sim.runtime.engine_views import EngineView, round_robin, session_hash
from appliance.sim.runtime.trace import (
    TRACE_BLOCK_TOKENS,
    BlockTokens,
    TraceRecord,
    conversation_ids,
    load_mooncake,
    trace_arrivals,
)
from appliance.sim.runtime.virtual import Arrival, replay
from tests.paths import MOONCAKE as TRACE

LAT = LatencyModel.from_profile(bundled_profile())
BS = 16


def engines(n: int, **kw: Any) -> list[SimEngine]:
    """`kw`: `EngineConfig` fields over these defaults."""
    args: dict[str, Any] = {
        "num_blocks": 2048,
        "block_size": BS,
        "max_model_len": 8192,
        "max_num_batched_tokens": 2048,
    }
    config = EngineConfig(**{**args, **kw})
    hasher = BlockHasher(HashAlgo.SHA256, config.block_size)
    return [SimEngine(config, hasher=hasher, latency=LAT) for _ in range(n)]


def workload(seed: int, n: int = 300, span_s: float = 600.0) -> list[Arrival]:
    """Sessions that re-send their growing history, Poisson-ish arrivals."""
    rng = random.Random(seed)
    system = [rng.randrange(32000) for _ in range(200)]
    histories: dict[str, list[int]] = {}
    out = []
    t = 0.0
    for i in range(n):
        t += rng.expovariate(n / span_s)
        sid = f"s{rng.randrange(20)}"
        hist = histories.setdefault(sid, list(system))
        hist += [rng.randrange(32000) for _ in range(rng.randrange(20, 600))]
        del hist[4000:]
        req = SimRequest(f"r{i}", list(hist), rng.randrange(1, 200), session_id=sid, arrival_s=t)
        out.append(Arrival(t, req))
    return out


def P(fresh: int, reused: int = 0) -> float:
    return LAT.prefill_s(fresh, reused)


def D(batch: int, context: int) -> float:
    return LAT.decode_step_s(batch, context)


# --- timing and ordering ---


def test_a_lone_request_sees_the_latency_model() -> None:
    r = SimRequest("a", list(range(100)), 3)
    result = replay(engines(1), [Arrival(5.0, r)])
    (rec,) = result.records
    assert rec.first_token_s == pytest.approx(5.0 + P(100))
    assert rec.ttft_s == pytest.approx(P(100))
    assert rec.finish_s == pytest.approx(5.0 + P(100) + D(1, 101) + D(1, 102))
    assert (rec.output_tokens, rec.finish_reason, rec.worker) == (3, "length", 0)
    assert result.end_s == pytest.approx(rec.finish_s)


@pytest.mark.parametrize("fraction", [0.5, 1.0])
def test_a_request_arriving_during_a_step_joins_the_next_one(fraction: float) -> None:
    a = SimRequest("a", list(range(100)), 5)
    b = SimRequest("b", list(range(500, 564)), 1)
    t_b = P(100) * fraction
    result = replay(engines(1), [Arrival(0.0, a), Arrival(t_b, b)])
    rec_b = result.records[1]
    # Step 2 (starting when a's prefill ends) decodes a and prefills b.
    assert rec_b.first_token_s == pytest.approx(P(100) + P(64) + D(1, 101))


def test_on_step_sees_every_step_with_its_events() -> None:
    seen: list[tuple[int, float, StepResult]] = []
    arrivals = [Arrival(0.0, SimRequest("a", list(range(40)), 2), worker=1)]
    replay(engines(2), arrivals, on_step=lambda i, t, r: seen.append((i, t, r)))
    assert [i for i, _, _ in seen] == [1, 1]
    assert seen[0][1] == pytest.approx(P(40))
    assert seen[0][2].events, "the prefill stores blocks"


# --- routing ---


def test_round_robin_session_hash_and_explicit_workers() -> None:
    reqs = [SimRequest(f"r{i}", [i + 1] * 8, 1, session_id=f"s{i % 3}") for i in range(9)]
    rr = replay(engines(4), [Arrival(float(i), r) for i, r in enumerate(reqs)], round_robin())
    assert [r.worker for r in rr.records] == [0, 1, 2, 3, 0, 1, 2, 3, 0]
    sh = replay(engines(4), [Arrival(float(i), r) for i, r in enumerate(reqs)], session_hash())
    by_session: dict[str | None, set[int]] = {}
    for rec, rq in zip(sh.records, reqs, strict=True):
        by_session.setdefault(rq.session_id, set()).add(rec.worker)
    assert all(len(w) == 1 for w in by_session.values())
    fixed = replay(engines(3), [Arrival(0.0, reqs[0], worker=2)], round_robin())
    assert fixed.records[0].worker == 2


def test_a_router_sees_each_engine_and_bad_routes_fail() -> None:
    views_seen: list[list[EngineView]] = []

    def least_loaded(req: SimRequest, views: Any) -> int:
        views_seen.append(list(views))
        return min(views, key=lambda v: (v.num_running + v.num_waiting, v.index)).index

    arrivals = [Arrival(0.0, SimRequest(f"r{i}", [i + 1] * 64, 50)) for i in range(3)]
    result = replay(engines(2), arrivals, least_loaded)
    assert [r.worker for r in result.records] == [0, 1, 0]
    assert [v.num_waiting + v.num_running for v in views_seen[2]] == [1, 1]
    with pytest.raises(ValueError, match="engine 5"):
        replay(engines(2), arrivals[:1], lambda r, v: 5)
    with pytest.raises(ValueError, match="time order"):
        replay(engines(1), [Arrival(1.0, arrivals[0].request), Arrival(0.5, arrivals[1].request)])


# --- determinism and speed ---


def _summary(seed: int) -> tuple[Any, ...]:
    result = replay(engines(4), workload(seed), session_hash())
    return tuple(result.records), tuple(result.engine_stats), result.end_s, result.num_steps


def test_the_same_workload_replays_identically() -> None:
    first, again, other = _summary(3), _summary(3), _summary(4)
    assert first == again
    assert first[0] != other[0]
    records = first[0]
    assert all(r.finish_reason == "length" for r in records)
    assert sum(r.cached_tokens for r in records) > 0, "sessions should hit their history"


# --- the Mooncake trace ---


def test_block_tokens_are_fixed_per_id_and_distinct_across_ids() -> None:
    blocks, again = BlockTokens(seed=1), BlockTokens(seed=1)
    assert blocks.tokens(7) == again.tokens(7)
    assert len(blocks.tokens(7)) == TRACE_BLOCK_TOKENS
    assert len({tuple(blocks.tokens(i)) for i in range(2000)}) == 2000
    assert all(0 <= t < blocks.vocab_size for i in range(50) for t in blocks.tokens(i * 7919))
    prompt = blocks.prompt((3, 9, 4), 1100)
    assert len(prompt) == 1100
    assert prompt[:512] == blocks.tokens(3) and prompt[1024:] == blocks.tokens(4)[:76]


def test_load_mooncake_and_recover_conversations(tmp_path: Path) -> None:
    rows = [
        {"timestamp": 0, "input_length": 1100, "output_length": 5, "hash_ids": [0, 1, 2]},
        {"timestamp": 250, "input_length": 1000, "output_length": 0, "hash_ids": [0, 3]},
        # continues request 0: its ids less the last (a partial block) begin these
        {"timestamp": 1000, "input_length": 1800, "output_length": 9, "hash_ids": [0, 1, 4, 5]},
        {"timestamp": 1500, "input_length": 2200, "output_length": 9, "hash_ids": [0, 1, 4, 6, 7]},
    ]
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    records = load_mooncake(path)
    assert records[1] == TraceRecord(1, 0.25, 1000, 0, (0, 3))
    assert load_mooncake(path, limit=2) == records[:2]
    assert conversation_ids(records) == ["conv-0", "conv-1", "conv-0", "conv-0"]
    arrivals = trace_arrivals(records, BlockTokens(), sessions=conversation_ids(records))
    first = next(arrivals)
    assert (first.time_s, first.request.request_id, first.request.max_tokens) == (0.0, "req-0", 5)
    rest = list(arrivals)
    assert rest[0].request.max_tokens == 1  # output_length 0 still generates one token
    assert rest[1].request.prompt_token_ids[:1024] == rest[2].request.prompt_token_ids[:1024]
    path.write_text(json.dumps({**rows[0], "input_length": 2000}) + "\n")
    with pytest.raises(ValueError, match="does not fit"):
        load_mooncake(path)


def test_the_real_trace_replays_with_prefix_hits() -> None:
    records = load_mooncake(TRACE, limit=150)
    sessions = conversation_ids(records)
    bs = TRACE_BLOCK_TOKENS
    fleet = engines(
        2, block_size=bs, num_blocks=2000, max_model_len=131072, max_num_batched_tokens=8192
    )
    result = replay(fleet, trace_arrivals(records, BlockTokens(), sessions=sessions))
    assert len(result.records) == 150
    assert all(r.finish_s is not None for r in result.records)
    assert sum(r.cached_tokens for r in result.records) > 0
