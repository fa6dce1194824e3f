"""Pins in the simulated prefix cache and engine: held blocks stay out of the eviction order,
lapse into LRU at their time, give way (in the residency order) before an allocation would
fail, and change nothing when nobody pins."""

from __future__ import annotations

import copy
import random
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from appliance.domain.block_hash import BlockHasher, HashAlgo
from appliance.perf.latency import LatencyModel
from appliance.perf.profile import bundled_profile
from appliance.sim.core.engine import EngineConfig, SimEngine
from appliance.sim.engine_io import SimRequest
from appliance.sim.kv.cache_request import CacheRequest
from appliance.sim.kv.pins import Pin
from appliance.sim.kv.prefix_cache import PrefixCache
from appliance.sim.kv.residency_hook import AfterTurn, TurnEnd

BS = 4
HASHER = BlockHasher(HashAlgo.SHA256, BS)
LAT = LatencyModel.from_profile(bundled_profile())


def make(rid: str, tokens: list[int], session: str | None = None) -> CacheRequest:
    return CacheRequest(rid, tokens, HASHER, session_id=session)


def admit(cache: PrefixCache, req: CacheRequest) -> tuple[int, ...] | None:
    hit = cache.lookup(req)
    return cache.allocate(req, req.num_tokens - hit.num_tokens, hit, full_sequence_must_fit=True)


def served(
    cache: PrefixCache,
    rid: str,
    tokens: list[int],
    session: str,
    *,
    until_s: float | None = None,
    now: float = 0.0,
) -> CacheRequest:
    """Prefill a request, pin its cached blocks (if `until_s`), free it."""
    req = make(rid, tokens, session)
    assert admit(cache, req) is not None
    if until_s is not None:
        cache.pin(session, req, now_s=now, until_s=until_s)
    cache.free(req)
    return req


def tokens(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def test_a_pin_keeps_blocks_out_of_the_free_queue_and_findable() -> None:
    cache = PrefixCache(11, BS)  # 10 usable blocks
    served(cache, "a", tokens(0, 9), "A", until_s=60.0)  # blocks 1, 2 full, 3 partial
    assert cache.free_block_ids()[:1] == (3,)  # the partial block is free, reused first
    assert 1 not in cache.free_block_ids() and 2 not in cache.free_block_ids()
    assert cache.num_pinned_blocks == 2 and cache.usage == pytest.approx(0.2)
    assert cache.pins == (Pin("A", 2, 0.0, 60.0, seq=1),)
    again = make("a2", tokens(0, 12), "A")
    assert cache.lookup(again).num_tokens == 8


def test_unpin_and_expiry_put_blocks_at_the_lru_tail() -> None:
    cache = PrefixCache(11, BS)
    served(cache, "a", tokens(0, 8), "A", until_s=5.0)  # blocks 1, 2
    served(cache, "b", tokens(100, 8), "B", until_s=9.0)  # blocks 3, 4
    served(cache, "c", tokens(200, 8), "C")  # blocks 5, 6: plain LRU
    assert cache.next_pin_expiry_s() == 5.0
    assert cache.expire_pins(4.9) == []
    assert cache.expire_pins(6.0) == ["A"]
    assert cache.free_block_ids()[-4:] == (6, 5, 2, 1)  # each request's tail block first
    assert cache.unpin("B") and not cache.unpin("B")
    assert cache.free_block_ids()[-2:] == (4, 3)
    assert cache.pin_stats.expired == 1 and cache.pin_stats.resumed == 1
    assert cache.next_pin_expiry_s() is None and cache.num_pinned_blocks == 0


def test_expiry_spares_an_owner_whose_next_request_waits() -> None:
    cache = PrefixCache(11, BS)
    served(cache, "a", tokens(0, 8), "A", until_s=5.0)
    served(cache, "b", tokens(100, 8), "B", until_s=6.0)
    assert cache.expire_pins(7.0, keep={"A"}) == ["B"]
    assert [p.owner for p in cache.pins] == ["A"]
    assert cache.expire_pins(8.0) == ["A"]


def test_a_newer_pin_of_the_same_owner_replaces_the_older() -> None:
    cache = PrefixCache(11, BS)
    served(cache, "a1", tokens(0, 8), "A", until_s=5.0)
    served(cache, "a2", tokens(0, 12), "A", until_s=9.0, now=2.0)  # re-uses blocks 1, 2
    assert [(p.num_blocks, p.until_s) for p in cache.pins] == [(3, 9.0)]
    assert cache.num_pinned_blocks == 3 and cache.pin_stats.replaced == 1
    assert cache.expire_pins(6.0) == []  # the old expiry is gone with the old pin


@pytest.mark.parametrize(
    ("need", "released", "survivor"),
    [
        # Free: 4 blocks (the partial ones and the never-used). Pins: A 2 blocks (until 10),
        # B 2 blocks (until 20). The latest expiry (B) gives way first, then A.
        (4, [], {"A", "B"}),
        (5, ["B"], {"A"}),
        (6, ["B"], {"A"}),
        (8, ["B", "A"], set()),
        (9, [], {"A", "B"}),  # even all pins would not make room: nothing is released
    ],
)
def test_pressure_reclaims_pins_latest_expiry_first(
    need: int, released: list[str], survivor: set[str]
) -> None:
    cache = PrefixCache(9, BS)  # 8 usable blocks
    served(cache, "a", tokens(0, 8), "A", until_s=10.0)
    served(cache, "b", tokens(100, 8), "B", until_s=20.0)
    assert cache.num_free_blocks == 4
    big = make("c", tokens(500, need * BS), "C")
    fits = admit(cache, big) is not None
    assert fits == (need <= 8)
    assert {p.owner for p in cache.pins} == survivor
    assert cache.pin_stats.reclaimed == len(released)


def test_pressure_never_takes_the_requesting_sessions_own_pin() -> None:
    cache = PrefixCache(9, BS)
    served(cache, "a", tokens(0, 8), "A", until_s=10.0)  # A: blocks 1, 2
    served(cache, "b", tokens(100, 8), "B", until_s=20.0)
    # A's next turn: 2 blocks hit (pinned), 5 more to allocate: only B's pin can give way.
    nxt = make("a2", tokens(0, 28), "A")
    assert admit(cache, nxt) is not None
    assert [p.owner for p in cache.pins] == ["A"] and cache.pin_stats.reclaimed == 1


def test_a_custom_order_picks_the_victim() -> None:
    cache = PrefixCache(9, BS, pin_priority=lambda pin, now: pin.until_s)  # earliest first
    served(cache, "a", tokens(0, 8), "A", until_s=10.0)
    served(cache, "b", tokens(100, 8), "B", until_s=20.0)
    assert admit(cache, make("c", tokens(500, 20), "C")) is not None
    assert [p.owner for p in cache.pins] == ["B"]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(1, 16), st.booleans()), max_size=40))
def test_invariants_under_random_pins(ops: list[tuple[int, int, bool]]) -> None:
    """Pinned blocks are never free and keep their hash; every reference is a pin's (no
    request runs between ops), and their count is what `num_pinned_blocks` says after every
    op (it keeps its count between changes); an admission fails only if it would also fail
    with every other session's pins released, and then releases none."""
    cache = PrefixCache(13, BS)
    now = 0.0
    for k, (session, n, pin) in enumerate(ops):
        now += 1.0
        cache.expire_pins(now)
        owner = f"s{session}"
        req = make(f"r{k}", [session * 1000 + i for i in range(n)], owner)
        before = copy.deepcopy(cache)
        if admit(cache, req) is None:
            assert cache.pins == before.pins
            for other in [p.owner for p in before.pins if p.owner != owner]:
                before.unpin(other)
            assert admit(before, make(f"r{k}", req.all_token_ids, owner)) is None
            continue
        if pin:
            cache.pin(owner, req, now_s=now, until_s=now + 3.0)
        cache.free(req)
        held: dict[int, int] = {}
        for p in cache.pins:
            for b in cache._pins[p.owner][1]:  # the mechanism's own record
                held[b.block_id] = held.get(b.block_id, 0) + 1
                assert b.block_hash is not None
        assert not set(cache.free_block_ids()) & set(held)
        assert cache.ref_counts() == {i: held.get(i, 0) for i in cache.ref_counts()}
        assert cache.num_pinned_blocks == len(held)


# --- the engine ---


class FixedHold:
    """Pins every finished request for `ttl_s` (None: never), records what it saw."""

    def __init__(self, ttl_s: float | None) -> None:
        self.ttl_s = ttl_s
        self.seen: list[TurnEnd] = []

    def after_turn(self, end: TurnEnd) -> AfterTurn:
        self.seen.append(end)
        return AfterTurn() if self.ttl_s is None else AfterTurn("hold", end.now_s + self.ttl_s)

    def pin_priority(self, pin: Pin, now: float) -> float:
        return -pin.until_s


def engine(residency: Any = None, **kw: Any) -> SimEngine:
    """`kw`: `EngineConfig` fields over these defaults."""
    args: dict[str, Any] = {
        "num_blocks": 17,
        "block_size": BS,
        "max_model_len": 48,
        "max_num_seqs": 4,
        "max_num_batched_tokens": 32,
    }
    config = EngineConfig(**{**args, **kw})
    return SimEngine(config, hasher=HASHER, latency=LAT, residency=residency)


def drain(e: SimEngine, now: float) -> float:
    while e.has_unfinished_requests():
        now += e.step(now).duration_s
    return now


def test_engine_pins_a_finished_turn_and_resumes_it_for_the_next() -> None:
    hold = FixedHold(10.0)
    e = engine(hold)
    e.add_request(SimRequest("t0", tokens(0, 10), 2, session_id="A"), 0.0)
    now = drain(e, 0.0)
    (end,) = hold.seen
    # 10 prompt + 2 generated tokens, the last not yet computed: 2 full cached blocks.
    assert end.request.request_id == "t0" and end.resident_tokens == 8
    assert e.stats.pins_total == 1 and e.stats.pinned_blocks == 2
    e.add_request(SimRequest("t1", [*tokens(0, 10), 7, 7, 7], 1, session_id="A"), now)
    result = e.step(now)
    assert result.outputs[0].num_cached_tokens == 8
    assert e.stats.pins_resumed_total == 1


def test_engine_expires_pins_at_the_first_step_after_their_time() -> None:
    e = engine(FixedHold(1.0))
    e.add_request(SimRequest("t0", tokens(0, 10), 2, session_id="A"), 0.0)
    now = drain(e, 0.0)
    assert e.stats.pinned_blocks == 2
    e.add_request(SimRequest("x", tokens(500, 6), 1, session_id="B"), now + 0.5)
    drain(e, now + 0.5)  # before A's TTL: A stays pinned
    assert e.stats.pins_expired_total == 0
    e.add_request(SimRequest("y", tokens(900, 6), 1, session_id="C"), now + 2.0)
    e.step(now + 2.0)
    assert e.stats.pins_expired_total >= 1 and "A" not in {p.owner for p in e.cache.pins}


def test_pins_never_cause_a_preemption() -> None:
    e = engine(FixedHold(1000.0), num_blocks=9, max_model_len=32)  # 8 usable blocks
    for k in range(3):  # three finished sessions, each pinning 2 blocks
        e.add_request(SimRequest(f"p{k}", tokens(100 * k, 9), 1, session_id=f"s{k}"), 0.0)
        drain(e, 0.0)
    assert e.stats.pinned_blocks == 6
    e.add_request(SimRequest("big", tokens(1000, 24), 8, session_id="big"), 1.0)
    drain(e, 1.0)
    assert e.stats.num_preemptions_total == 0 and e.stats.request_success_total["length"] == 4
    assert e.stats.pins_reclaimed_total >= 2


def test_a_hook_that_never_holds_changes_nothing() -> None:
    """Random sessions through two engines, one with a never-holding hook: every step alike."""
    rng = random.Random(7)
    plain, hooked = engine(), engine(FixedHold(None))
    now = 0.0
    for k in range(40):
        session = rng.randrange(5)
        prompt = tokens(session * 50, rng.randint(3, 30))
        max_tokens = rng.randint(1, 6)
        for e in (plain, hooked):
            e.add_request(
                SimRequest(f"r{k}", list(prompt), max_tokens, session_id=f"s{session}"), now
            )
        a, b = plain.step(now), hooked.step(now)
        assert (a.duration_s, a.scheduled, a.preempted, a.events) == (
            b.duration_s,
            b.scheduled,
            b.preempted,
            b.events,
        )
        assert [(o.request_id, o.new_token_ids, o.num_cached_tokens) for o in a.outputs] == [
            (o.request_id, o.new_token_ids, o.num_cached_tokens) for o in b.outputs
        ]
        now += a.duration_s
    assert plain.cache.free_block_ids() == hooked.cache.free_block_ids()
    assert hooked.stats.pins_total == 0 and len(hooked._residency.seen) > 0  # type: ignore[union-attr]
