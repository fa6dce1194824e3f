"""Prefetches in the simulated engine: a promotion copies a session's host blocks to HBM
before its turn (the turn's TTFT holds only what is left of the copy), a prefill computes
its prefix while the engine has nothing real waiting, neither ever takes room or budget a
real request needs, and an ended branch's own blocks go on every tier."""

from __future__ import annotations

from typing import Any

import pytest

from appliance.domain.block_hash import BlockHasher, HashAlgo
from appliance.perf.latency import CopyDirection, LatencyModel
from appliance.perf.profile import bundled_profile
from appliance.sim.core.engine import EngineConfig, SimEngine
from appliance.sim.engine_io import SimRequest
from appliance.sim.kv.host_tier import HostTier
from appliance.sim.kv.pins import Pin
from appliance.sim.kv.residency_hook import AfterTurn, TurnEnd

BS = 4
HASHER = BlockHasher(HashAlgo.SHA256, BS)
LAT = LatencyModel.from_profile(bundled_profile())


class Release:
    """A residency hook that lets every finished request's blocks go (vLLM's LRU)."""

    def after_turn(self, end: TurnEnd) -> AfterTurn:
        return AfterTurn("release")

    def pin_priority(self, pin: Pin, now: float) -> float:
        return -pin.until_s


def engine(host_blocks: int = 32, **kw: Any) -> SimEngine:
    args: dict[str, Any] = {
        "num_blocks": 17,
        "block_size": BS,
        "max_model_len": 48,
        "max_num_seqs": 4,
        "max_num_batched_tokens": 64,
    }
    host = HostTier(host_blocks) if host_blocks else None
    config = EngineConfig(**{**args, **kw})
    return SimEngine(config, hasher=HASHER, latency=LAT, residency=Release(), host=host)


def tokens(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def drain(e: SimEngine, now: float) -> float:
    while e.has_unfinished_requests():
        result = e.step(now)
        now = result.idle_until_s if result.idle_until_s is not None else now + result.duration_s
    return now


def served(e: SimEngine, prompt: list[int], now: float = 0.0, session: str = "A") -> float:
    e.add_request(SimRequest(f"warm{now}", prompt, 1, session_id=session), now)
    return drain(e, now)


def host_only(e: SimEngine, prompt: list[int]) -> float:
    """Serve `prompt` for session A, then clear the GPU's prefix cache: only the host has it."""
    now = served(e, prompt)
    assert e.reset_prefix_cache()
    e.cache.take_events()
    return now


def prefix(prompt: list[int], session: str = "A") -> SimRequest:
    return SimRequest("last", prompt, 1, session_id=session)


def test_a_promotion_copies_the_host_part_and_pins_it_for_the_session() -> None:
    e = engine()
    prompt = tokens(0, 30)  # 7 whole blocks
    now = host_only(e, prompt)
    assert e.prefetches.probe(prefix(prompt)) == (0, 28)
    start = e.prefetches.start(prefix(prompt), now, prefill=False, hold_s=30.0)
    assert start is not None and (start.gpu_tokens, start.host_tokens) == (0, 28)
    first = e.step(now)
    copy_s = LAT.kv_copy_s(28, CopyDirection.H2D)
    assert first.idle_until_s == pytest.approx(now + copy_s)
    now = drain(e, now)
    assert e.prefetches.probe(prefix(prompt)) == (28, 0)
    assert [p.owner for p in e.cache.pins] == ["A"]
    (done,) = e.prefetches.take_done()
    assert (done.end, done.restored_tokens, done.prefill_tokens) == ("completed", 28, 0)
    e.add_request(SimRequest("next", [*prompt, 7, 8], 1, session_id="A"), now + 1)
    out = e.step(now + 1).outputs[0]
    assert (out.num_cached_tokens, out.num_host_cached_tokens) == (28, 0)
    assert not e.cache.pins  # the turn took the pin over


def test_a_turn_that_comes_during_the_copy_waits_only_for_the_rest_of_it() -> None:
    e = engine()
    prompt = tokens(0, 30)
    now = host_only(e, prompt)
    e.prefetches.start(prefix(prompt), now, prefill=False, hold_s=30.0)
    copy_s = LAT.kv_copy_s(28, CopyDirection.H2D)
    e.step(now)
    arrive = now + copy_s / 2
    e.add_request(SimRequest("next", [*prompt, 7, 8], 1, session_id="A"), arrive)
    assert e.stats.num_waiting == 1
    idle = e.step(arrive)  # nothing to do but wait for the copy
    assert idle.idle_until_s == pytest.approx(now + copy_s)
    assert idle.idle_until_s is not None
    out = e.step(idle.idle_until_s).outputs[0]
    assert (out.num_cached_tokens, out.num_host_cached_tokens) == (28, 0)


def test_a_prefill_computes_the_prefix_in_an_idle_engine_and_produces_no_output() -> None:
    e = engine(host_blocks=0)
    prompt = tokens(0, 30)
    assert e.prefetches.start(prefix(prompt), 0.0, prefill=True, hold_s=30.0) is not None
    steps = []
    now = 0.0
    while e.has_unfinished_requests():
        steps.append(e.step(now))
        now += steps[-1].duration_s
    assert all(not s.outputs for s in steps)
    assert sum(s.num_scheduled_tokens for s in steps) == 28
    (done,) = e.prefetches.take_done()
    assert done.prefill_tokens == 28 and done.prefill_s == pytest.approx(LAT.prefill_s(28))
    e.add_request(SimRequest("next", [*prompt, 7, 8], 1, session_id="A"), now)
    assert e.step(now).outputs[0].num_cached_tokens == 28
    assert e.stats.request_success_total["length"] == 1  # the prefetch never finished as one


def test_a_prefill_stops_where_it_is_when_its_turn_comes() -> None:
    e = engine(host_blocks=0, max_num_batched_tokens=64)
    e.prefetches.max_tokens_per_step = 8
    prompt = tokens(0, 30)
    e.prefetches.start(prefix(prompt), 0.0, prefill=True, hold_s=30.0)
    first = e.step(0.0)
    assert first.num_scheduled_tokens == 8
    e.add_request(SimRequest("next", [*prompt, 7, 8], 1, session_id="A"), first.duration_s)
    (done,) = e.prefetches.take_done()
    assert (done.end, done.restored_tokens) == ("stopped", 8)
    out = e.step(first.duration_s).outputs[0]
    assert out.num_cached_tokens == 8


def test_a_prefill_waits_while_a_real_request_waits() -> None:
    e = engine(host_blocks=0, max_num_batched_tokens=16)
    e.prefetches.start(prefix(tokens(0, 30)), 0.0, prefill=True, hold_s=30.0)
    e.add_request(SimRequest("real", tokens(500, 40), 1), 0.0)
    first = e.step(0.0)
    assert first.scheduled == {"real": 16}  # the real request first, and alone


def test_a_real_request_short_of_room_cancels_a_prefetch_before_any_pin_gives_way() -> None:
    e = engine(host_blocks=0, num_blocks=13)  # 12 usable blocks
    e.prefetches.max_tokens_per_step = 16
    e.prefetches.start(prefix(tokens(0, 40)), 0.0, prefill=True, hold_s=30.0)
    now = e.step(0.0).duration_s  # 4 blocks taken by the prefetch; the request needs 10
    e.add_request(SimRequest("real", tokens(500, 40), 1), now)
    e.step(now)
    (done,) = e.prefetches.take_done()
    assert done.end == "cancelled" and e.stats.num_preemptions_total == 0
    drain(e, now)
    assert e.stats.request_success_total["length"] == 1


def test_an_ended_branch_leaves_its_parents_blocks_and_nothing_of_its_own() -> None:
    e = engine()
    parent = tokens(0, 12)  # 3 blocks
    now = served(e, parent, session="P")
    child = [*parent, *tokens(100, 14)]  # 3 of the parent's blocks, then 3 of its own
    e.prefetches.start(prefix(child, "P.1"), now, prefill=True, hold_s=30.0)
    now = drain(e, now)
    assert [p.owner for p in e.cache.pins] == ["P.1"]
    hashes = HASHER.hash_blocks(child)
    own = hashes[3:6]
    assert e.host is not None and all(h in e.host for h in own)
    e.release_session("P.1", own, now)
    assert not e.cache.pins
    cached = set(e.cache.cached_blocks().values())
    assert all(h in cached for h in hashes[:3]) and not any(h in cached for h in own)
    assert all(h in e.host for h in hashes[:3]) and not any(h in e.host for h in own)
