"""The host tier of the simulated engine (vLLM's native CPU offloading): prompt blocks are
copied to host as they are computed, a GPU miss continues in the host tier, the host tier
is LRU, its events say medium "CPU", a host hit is loaded within the request's TTFT, and a
held session can be demoted to host or evicted first."""

from __future__ import annotations

import random
from typing import Any

import pytest

from appliance.domain.block_hash import BlockHasher, HashAlgo, event_block_hash
from appliance.domain.kv_events import BlockRemoved, BlockStored, KvEvent
from appliance.perf.latency import CopyDirection, LatencyModel
from appliance.perf.profile import bundled_profile
from appliance.sim.core.engine import EngineConfig, SimEngine
from appliance.sim.engine_io import SimRequest
from appliance.sim.kv.cache_request import CacheRequest
from appliance.sim.kv.host_tier import HostSession, HostTier
from appliance.sim.kv.pins import Pin
from appliance.sim.kv.prefix_cache import PrefixCache
from appliance.sim.kv.residency_hook import AfterTurn, TurnEnd
from appliance.sim.runtime.virtual import Arrival, replay

BS = 4
HASHER = BlockHasher(HashAlgo.SHA256, BS)
LAT = LatencyModel.from_profile(bundled_profile())


def hashes(*blocks: int) -> list[bytes]:
    """Stand-in block hashes (the host tier only compares them)."""
    return [bytes([b]) * 32 for b in blocks]


def cpu(events: list[KvEvent]) -> list[KvEvent]:
    return [e for e in events if getattr(e, "medium", None) == "CPU"]


def tokens(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


# --- the host tier alone ---


def test_a_store_skips_held_hashes_and_evicts_the_least_recently_used() -> None:
    tier = HostTier(3)
    assert tier.store(hashes(1, 2)) == hashes(1, 2)
    assert tier.store(hashes(2, 3)) == hashes(3)  # 2 is held already
    assert tier.store(hashes(4)) == hashes(4)
    assert tier.hashes() == tuple(hashes(2, 3, 4))  # 1 went: least recently used
    assert tier.stats.stored == 4 and tier.stats.evicted == 1


def test_a_touch_keeps_a_prefix_longer_than_its_tail() -> None:
    tier = HostTier(4)
    tier.store(hashes(1, 2, 3, 4))
    tier.touch(hashes(2, 3))
    assert tier.hashes() == tuple(hashes(1, 4, 3, 2))  # the first touched ends most recent
    tier.store(hashes(5, 6))
    assert tier.lookup(hashes(2, 3, 4)) == 2 and 1 not in [h[0] for h in tier.hashes()]


def test_a_store_larger_than_the_whole_tier_stores_nothing() -> None:
    tier = HostTier(2)
    tier.store(hashes(1))
    assert tier.store(hashes(2, 3, 4)) is None
    assert tier.hashes() == tuple(hashes(1))


def test_events_announce_each_stored_block_and_each_eviction_with_medium_cpu() -> None:
    tier = HostTier(2)
    sink: list[KvEvent] = []
    tier.store(hashes(1, 2), sink=sink)
    tier.store(hashes(3, 4), sink=sink)
    one, two, three, four = (event_block_hash(h) for h in hashes(1, 2, 3, 4))
    placeholder = {"parent_block_hash": None, "token_ids": (), "block_size": 0, "group_idx": 0}
    assert sink == [
        BlockStored(block_hashes=(one,), medium="CPU", **placeholder),
        BlockStored(block_hashes=(two,), medium="CPU", **placeholder),
        BlockRemoved(block_hashes=(one, two), medium="CPU", group_idx=0),
        BlockStored(block_hashes=(three,), medium="CPU", **placeholder),
        BlockStored(block_hashes=(four,), medium="CPU", **placeholder),
    ]


def test_a_shared_tier_reports_each_eviction_to_the_engine_that_stored_the_block() -> None:
    tier = HostTier(2)
    a: list[KvEvent] = []
    b: list[KvEvent] = []
    tier.store(hashes(1), sink=a)
    tier.store(hashes(2, 3), sink=b)  # evicts a's block
    gone = BlockRemoved(block_hashes=(event_block_hash(hashes(1)[0]),), medium="CPU", group_idx=0)
    assert a[-1] == gone
    assert not any(isinstance(e, BlockRemoved) for e in b)


def test_a_priority_hook_orders_evictions_by_session() -> None:
    """Most blocks go first here: the largest session's, though it was used last."""
    seen: list[HostSession] = []

    def largest_first(s: HostSession, now: float) -> float:
        seen.append(s)
        return -s.num_blocks

    tier = HostTier(4, priority=largest_first)
    tier.now_s = 1.0
    tier.store(hashes(1), owner="small")
    tier.now_s = 2.0
    tier.store(hashes(2, 3, 4), owner="big")
    tier.store(hashes(5), owner="new")
    assert tier.lookup(hashes(1)) == 1 and tier.lookup(hashes(2)) == 0
    assert HostSession("big", 3, 2.0) in seen and HostSession("small", 1, 1.0) in seen


class _ScanModel:
    """The ranked tier as a list in LRU order, each eviction a pass over all of it."""

    def __init__(self, size: int, rank: Any) -> None:
        self.size, self.rank, self.now = size, rank, 0.0
        self.order: list[tuple[bytes, str | None]] = []
        self.last_used: dict[str | None, float] = {}

    def store(self, offered: list[bytes], owner: str | None) -> None:
        held = {h for h, _ in self.order}
        new = [h for h in dict.fromkeys(offered) if h not in held]
        over = len(self.order) + len(new) - self.size
        if over > 0:
            by_owner: dict[str | None, list[bytes]] = {}
            for h, o in self.order:
                by_owner.setdefault(o, []).append(h)
            sessions = [
                HostSession(o, len(hs), self.last_used.get(o, 0.0)) for o, hs in by_owner.items()
            ]
            ranked = sorted(sessions, key=lambda s: self.rank(s, self.now))  # stable
            victims = [h for s in ranked for h in by_owner[s.owner] if h not in offered][:over]
            if len(victims) < over:
                return  # the offered ones are never evicted: no room, nothing stored
            self.order = [(h, o) for h, o in self.order if h not in victims]
        self.order += [(h, owner) for h in new]
        if new:
            self.last_used[owner] = self.now

    def touch(self, hs: list[bytes], owner: str | None) -> None:
        for h in reversed(hs):
            if any(x == h for x, _ in self.order):
                self.order = [(x, o) for x, o in self.order if x != h] + [(h, owner)]
        self.last_used[owner] = self.now


def test_a_ranked_eviction_takes_what_a_pass_over_the_tier_would() -> None:
    """The tier keeps its blocks by owner; a model that groups them anew at each eviction
    agrees with it on every order, store after store."""
    weight = {None: 2, "a": 0, "b": 3, "c": 1}
    ranks = [
        lambda s, now: weight[s.owner] - s.last_used_s / 50,
        lambda s, now: s.num_blocks % 3,  # many ties: the tier's order decides them
    ]
    for seed in range(40):
        rng, rank = random.Random(seed), ranks[seed % 2]
        tier, model = HostTier(24, priority=rank), _ScanModel(24, rank)
        for step in range(200):
            tier.now_s = model.now = step / 2
            hs = hashes(*(rng.randrange(60) for _ in range(rng.randrange(1, 12))))
            owner = rng.choice([None, "a", "b", "c"])
            if rng.random() < 0.5:
                tier.store(hs, owner=owner)
                model.store(hs, owner)
            else:
                tier.touch(hs, owner=owner)
                model.touch(hs, owner)
            assert tier.hashes() == tuple(h for h, _ in model.order), (seed, step)


# --- in the prefix cache ---


def test_prompt_blocks_are_copied_to_host_as_they_are_computed_and_decode_blocks_not() -> None:
    cache = PrefixCache(20, BS, host=HostTier(16))
    req = CacheRequest("a", tokens(0, 14), HASHER)  # 3 full prompt blocks
    hit = cache.lookup(req)
    assert cache.allocate(req, 8, hit) is not None  # a first chunk of 2 blocks
    assert cache.host is not None and cache.host.lookup(req.block_hashes) == 2
    assert cache.allocate(req, 6) is not None
    assert cache.host.lookup(req.block_hashes) == 3
    req.append_output([7, 7])  # the output fills block 4
    assert cache.allocate(req, 2) is not None
    assert len(req.block_hashes) == 4 and len(cache.host) == 3  # not the output's block
    events = cache.take_events()
    gpu = [e for e in events if e not in cpu(events)]
    assert events == gpu + cpu(events)  # the host tier's events come after the GPU's
    assert [e.block_hashes for e in cpu(events)] == [
        (event_block_hash(h),) for h in req.block_hashes[:3]
    ]


def test_a_host_eviction_steps_later_is_published_with_that_steps_events() -> None:
    cache = PrefixCache(20, BS, host=HostTier(3))
    first = CacheRequest("a", tokens(0, 13), HASHER)  # 3 full prompt blocks fill the tier
    assert cache.allocate(first, 13, cache.lookup(first)) is not None
    assert len(cpu(cache.take_events())) == 3  # stored: taken with this step's events
    later = CacheRequest("b", tokens(100, 9), HASHER)  # 2 more: the 2 oldest go
    assert cache.allocate(later, 9, cache.lookup(later)) is not None
    [removed] = [e for e in cpu(cache.take_events()) if isinstance(e, BlockRemoved)]
    stored_first = {event_block_hash(h) for h in first.block_hashes[:2]}  # "a" still runs
    assert set(removed.block_hashes) == stored_first


def test_a_finished_request_keeps_its_prefix_longer_than_its_tail_in_the_host_tier() -> None:
    cache = PrefixCache(20, BS, host=HostTier(3))
    first = CacheRequest("a", tokens(0, 13), HASHER)
    assert cache.allocate(first, 13, cache.lookup(first)) is not None
    cache.free(first)  # its end makes its blocks the most recently used, its first last
    cache.take_events()
    later = CacheRequest("b", tokens(100, 9), HASHER)
    assert cache.allocate(later, 9, cache.lookup(later)) is not None
    [removed] = [e for e in cpu(cache.take_events()) if isinstance(e, BlockRemoved)]
    assert set(removed.block_hashes) == {event_block_hash(h) for h in first.block_hashes[1:3]}


def test_a_lookup_leaves_the_host_tier_order_alone() -> None:
    tier = HostTier(4)
    cache = PrefixCache(20, BS, host=tier)
    first = CacheRequest("a", tokens(0, 9), HASHER)
    assert cache.allocate(first, 9, cache.lookup(first)) is not None
    cache.free(first)
    other = CacheRequest("b", tokens(100, 9), HASHER)
    assert cache.allocate(other, 9, cache.lookup(other)) is not None
    cache.free(other)
    order = tier.hashes()
    again = CacheRequest("a2", tokens(0, 9), HASHER)
    cache.lookup(again)  # vLLM's connector looks up without touching
    assert tier.hashes() == order


def test_a_lookup_continues_past_the_gpu_hit_into_the_host_tier() -> None:
    cache = PrefixCache(7, BS, host=HostTier(16))  # 6 usable blocks
    first = CacheRequest("a", tokens(0, 20), HASHER)  # 5 full blocks
    assert cache.allocate(first, 20, cache.lookup(first)) is not None
    cache.free(first)
    other = CacheRequest("b", tokens(500, 12), HASHER)  # takes a's 5th and 4th block
    assert cache.allocate(other, 12, cache.lookup(other)) is not None
    again = CacheRequest("a2", tokens(0, 21), HASHER)
    hit = cache.lookup(again)
    assert hit.num_tokens == 12 and len(hit.block_ids) == 3
    # The 4th and 5th blocks come from the host tier (the 6th, partial, holds the last token).
    assert hit.num_host_tokens == 8


def test_a_host_hit_takes_gpu_blocks_and_is_cached_there_when_the_load_completes() -> None:
    cache = PrefixCache(9, BS, host=HostTier(16))
    first = CacheRequest("a", tokens(0, 16), HASHER)
    assert cache.allocate(first, 16, cache.lookup(first)) is not None
    cache.free(first)
    assert cache.reset()  # the GPU forgets, the host tier keeps
    cache.take_events()
    again = CacheRequest("a2", tokens(0, 18), HASHER)
    hit = cache.lookup(again)
    assert (hit.num_tokens, hit.num_host_tokens) == (0, 16)
    free = cache.num_free_blocks
    assert cache.allocate(again, 16, hit, delay_cache_blocks=True) is not None
    assert cache.num_free_blocks == free - 4 and not cache.cached_blocks()
    cache.complete_load(again)
    assert len(cache.cached_blocks()) == 4
    (stored,) = [e for e in cache.take_events() if isinstance(e, BlockStored)]
    assert stored.medium == "GPU" and len(stored.block_hashes) == 4
    assert cache.stats.hits == 0  # the local prefix-cache counters count GPU hits only


# --- in the engine ---


def engine(residency: Any = None, host_blocks: int = 32, **kw: Any) -> SimEngine:
    """`kw`: `EngineConfig` fields over these defaults; `host_blocks=0`: no host tier."""
    args: dict[str, Any] = {
        "num_blocks": 17,
        "block_size": BS,
        "max_model_len": 48,
        "max_num_seqs": 4,
        "max_num_batched_tokens": 64,
    }
    host = HostTier(host_blocks) if host_blocks else None
    config = EngineConfig(**{**args, **kw})
    return SimEngine(config, hasher=HASHER, latency=LAT, residency=residency, host=host)


def drain(e: SimEngine, now: float) -> float:
    while e.has_unfinished_requests():
        now += e.step(now).duration_s
    return now


def warm_host_only(e: SimEngine, prompt: list[int], now: float = 0.0) -> float:
    """Serve `prompt` once, then clear the GPU's prefix cache: only the host tier has it."""
    e.add_request(SimRequest("warm", prompt, 1), now)
    now = drain(e, now)
    assert e.reset_prefix_cache()
    e.cache.take_events()  # AllBlocksCleared, published with the next step
    return now


def test_a_host_hit_adds_its_promotion_time_to_ttft_and_is_counted_apart() -> None:
    prompt = tokens(0, 30)  # 7 full blocks; 28 tokens can come from host
    e = engine()
    now = warm_host_only(e, prompt)
    e.add_request(SimRequest("r", [*prompt, 99, 98], 1), now)
    first = e.step(now)  # admitted: the copy starts, nothing is computed
    assert first.num_scheduled_tokens == 0 and first.outputs == []
    load_s = LAT.kv_copy_s(28, CopyDirection.H2D)
    assert first.idle_until_s == pytest.approx(now + load_s)
    assert first.duration_s == pytest.approx(load_s)
    assert first.idle_until_s is not None
    second = e.step(first.idle_until_s)
    (out,) = second.outputs
    assert out.first_token and second.scheduled == {"r": 4}
    assert second.duration_s == pytest.approx(LAT.prefill_s(4, 28))
    assert (out.num_cached_tokens, out.num_host_cached_tokens) == (28, 28)
    s = e.stats
    assert s.host_hit_tokens_total == 28 and s.host_load_s_total == pytest.approx(load_s)
    assert s.prompt_tokens_by_source["external_kv_transfer"] == 28
    assert s.prompt_tokens_by_source["local_cache_hit"] == 0
    assert s.prefix_cache_hits == 0


def test_loads_share_one_host_to_device_channel() -> None:
    """Two host hits admitted together: the second copy starts when the first ends."""
    e = engine(num_blocks=33, max_model_len=64)
    now = warm_host_only(e, tokens(0, 21))
    now = warm_host_only(e, tokens(500, 21), now)
    arrivals = [
        Arrival(now, SimRequest("a", tokens(0, 22), 1)),
        Arrival(now, SimRequest("b", tokens(500, 22), 1)),
    ]
    records = {r.request_id: r for r in replay([e], arrivals).records}
    one = LAT.kv_copy_s(20, CopyDirection.H2D)
    prefill = LAT.prefill_s(2, 20)
    assert records["a"].first_token_s == pytest.approx(now + one + prefill)
    b_first = records["b"].first_token_s
    assert b_first is not None and b_first >= now + 2 * one + prefill - 1e-12
    assert records["a"].host_cached_tokens == records["b"].host_cached_tokens == 20


def test_an_arrival_cuts_short_a_wait_for_a_load() -> None:
    prompt = tokens(0, 40)
    e = engine(num_blocks=33, max_model_len=64)
    now = warm_host_only(e, prompt)
    load_s = LAT.kv_copy_s(40, CopyDirection.H2D)
    arrivals = [
        Arrival(now, SimRequest("loaded", [*prompt, 1], 1)),
        Arrival(now + load_s / 2, SimRequest("quick", tokens(900, 5), 1)),
    ]
    steps: list[tuple[float, dict[str, int]]] = []
    result = replay([e], arrivals, on_step=lambda i, t, r: steps.append((t, r.scheduled)))
    records = {r.request_id: r for r in result.records}
    # "quick" starts when it arrives, in the middle of the wait, not after the copy.
    (done,) = [t for t, s in steps if "quick" in s]
    assert done == pytest.approx(now + load_s / 2 + LAT.prefill_s(5))
    assert records["loaded"].host_cached_tokens == 40
    assert records["loaded"].ttft_s is not None and records["loaded"].ttft_s > load_s


def test_a_loaded_request_gives_its_blocks_back_to_a_head_whose_load_does_not_fit() -> None:
    """Priority scheduling: a request loaded from host waits again behind a higher-priority
    one whose own host hit cannot fit beside it, and nothing runs: the loaded one gives its
    blocks back (to load again later), rather than both waiting forever."""
    a, b = tokens(0, 40), tokens(500, 40)  # 10 blocks each: not both in the 16 of the pool
    e = engine(policy="priority")
    now = warm_host_only(e, b, warm_host_only(e, a))
    load_s = LAT.kv_copy_s(40, CopyDirection.H2D)
    arrivals = [
        Arrival(now, SimRequest("loaded", [*b, 1], 1)),
        Arrival(now + load_s / 2, SimRequest("urgent", [*a, 1], 1, priority=-1)),
    ]
    records = {r.request_id: r for r in replay([e], arrivals).records}
    urgent, loaded = records["urgent"].first_token_s, records["loaded"].first_token_s
    assert urgent is not None and loaded is not None
    assert urgent == pytest.approx(now + 2 * load_s + LAT.prefill_s(1, 40))
    assert loaded > urgent  # loaded twice: before and after the urgent one
    assert e.stats.num_preemptions_total == 1


def test_with_room_for_everything_on_the_gpu_a_host_tier_changes_no_schedule() -> None:
    rng = random.Random(3)
    plain, hosted = engine(host_blocks=0, num_blocks=200), engine(num_blocks=200)
    now = 0.0
    for k in range(30):
        session = rng.randrange(4)
        prompt = tokens(session * 100, rng.randint(3, 40))
        max_tokens = rng.randint(1, 5)
        for e in (plain, hosted):
            e.add_request(SimRequest(f"r{k}", list(prompt), max_tokens), now)
        a, b = plain.step(now), hosted.step(now)
        assert (a.duration_s, a.scheduled, a.outputs) == (b.duration_s, b.scheduled, b.outputs)
        assert [e for e in b.events if e not in cpu(b.events)] == a.events
        now += a.duration_s + rng.random()
    assert hosted.stats.host_hit_tokens_total == 0
    assert hosted.host is not None and len(hosted.host) > 0


class Decide:
    """A residency hook that does `action` to every finished request's blocks."""

    def __init__(self, action: str, until_s: float | None = None) -> None:
        self.action = action
        self.until_s = until_s

    def after_turn(self, end: TurnEnd) -> AfterTurn:
        return AfterTurn(self.action, self.until_s)  # type: ignore[arg-type]

    def pin_priority(self, pin: Pin, now: float) -> float:
        return -pin.until_s


def block_ids_in_token_order(e: SimEngine, prompt: list[int]) -> list[int]:
    by_hash = {h: i for i, h in e.cache.cached_blocks().items()}
    return [by_hash[h] for h in HASHER.hash_blocks(prompt)]


def test_demote_copies_a_held_sessions_blocks_to_host_and_frees_them_on_the_gpu() -> None:
    e = engine(residency=Decide("hold", 100.0))
    prompt = tokens(0, 17)
    e.add_request(SimRequest("t0", prompt, 1, session_id="A"), 0.0)
    now = drain(e, 0.0)
    assert e.stats.pinned_blocks == 4
    ids = block_ids_in_token_order(e, prompt)
    e.cache.take_events()
    assert e.demote("A") == 4
    assert e.stats.pinned_blocks == 0 and not e.cache.cached_blocks()
    assert set(e.cache.free_block_ids()[:4]) == set(ids)  # free, and handed out first
    events = e.cache.take_events()
    gone = [h for ev in events if isinstance(ev, BlockRemoved) for h in ev.block_hashes]
    assert sorted(gone) == sorted(event_block_hash(h) for h in HASHER.hash_blocks(prompt))
    assert e.stats.demotions_total == 1
    e.add_request(SimRequest("t1", [*prompt, 5, 6], 1, session_id="A"), now)
    drain(e, now)
    assert e.stats.host_hit_tokens_total == 16
    assert e.demote("nobody") == 0


def test_evict_puts_a_held_sessions_blocks_first_in_the_eviction_order() -> None:
    e = engine(residency=Decide("hold", 100.0), host_blocks=0)
    e.add_request(SimRequest("t0", tokens(0, 17), 1, session_id="A"), 0.0)
    now = drain(e, 0.0)
    ids = block_ids_in_token_order(e, tokens(0, 17))
    assert e.evict("A") == 4
    # First in line, the tail block first, and still cached.
    assert e.cache.free_block_ids()[:4] == tuple(reversed(ids))
    assert set(e.cache.cached_blocks()) == set(ids)
    assert e.stats.evictions_total == 1 and e.stats.pinned_blocks == 0
    e.add_request(SimRequest("t1", tokens(0, 17), 1, session_id="A"), now)
    assert e.step(now).outputs[0].num_cached_tokens == 16  # findable until reused


def test_a_residency_hook_can_demote_or_evict_a_finished_turn() -> None:
    demoting = engine(residency=Decide("demote"))
    demoting.add_request(SimRequest("t0", tokens(0, 17), 1, session_id="A"), 0.0)
    drain(demoting, 0.0)
    assert demoting.stats.demotions_total == 1 and not demoting.cache.cached_blocks()
    assert demoting.host is not None and len(demoting.host) == 4

    evicting = engine(residency=Decide("evict"))
    evicting.add_request(SimRequest("t0", tokens(0, 17), 1, session_id="A"), 0.0)
    drain(evicting, 0.0)
    assert evicting.stats.evictions_total == 1 and len(evicting.cache.cached_blocks()) == 4
    head = evicting.cache.free_block_ids()[:5]
    assert set(evicting.cache.cached_blocks()) <= set(head)


def test_demoting_without_a_host_tier_is_refused() -> None:
    e = engine(residency=Decide("demote"), host_blocks=0)
    e.add_request(SimRequest("t0", tokens(0, 9), 1, session_id="A"), 0.0)
    with pytest.raises(ValueError, match="no host tier"):
        drain(e, 0.0)
    with pytest.raises(ValueError, match="needs a host tier"):
        engine(host_blocks=0).demote("A")
