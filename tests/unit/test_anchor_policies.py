"""The anchors' routing policies decide as their sources do, on small hand-made inputs."""

from __future__ import annotations

from collections import Counter as Tally
from collections.abc import Sequence

import pytest

from appliance.policy.routing.anchors import (
    ANCHORS,
    AnchorDecision,
    AnchorPolicy,
    AnchorRequest,
    AnchorWorker,
    ApproxTree,
    CacheAwareConfig,
    DynamoConfig,
    DynamoKv,
    LeastLoaded,
    LlmdConfig,
    LlmdPrecisePrefix,
    RoundRobin,
    SessionHash,
    SglangCacheAware,
    fbi_hash,
    furc_hash,
    llmd_load_aware_score,
    llmd_prefix_scores,
    llmd_queue_scores,
    murmur_hash_64a,
)

URLS = [f"http://worker-{i}:8000" for i in range(8)]


def workers(n: int = 3, **fields: Sequence[object]) -> list[AnchorWorker]:
    """n workers; each keyword gives that field's value per worker."""
    return [
        AnchorWorker(i, URLS[i], **{k: v[i] for k, v in fields.items()})  # type: ignore[arg-type]
        for i in range(n)
    ]


def req(
    rid: str = "r",
    blocks: Sequence[int] = (),
    tokens: int | None = None,
    session: str | None = None,
) -> AnchorRequest:
    n = tokens if tokens is not None else 16 * len(blocks)
    return AnchorRequest(rid, n, session, tuple(blocks), 16)


def decide(
    policy: AnchorPolicy[object], state: object, r: AnchorRequest, ws: list[AnchorWorker], now=0.0
) -> AnchorDecision:
    policy.advance(state, now)
    d = policy.route(r, ws, state)
    policy.record(state, r, d, now)
    return d


# --- round robin / least loaded ----------------------------------------------------------


def test_round_robin_cycles_over_healthy_workers() -> None:
    p = RoundRobin()
    s = p.initial_state(URLS[:3])
    ws = workers(3)
    assert [decide(p, s, req(str(i)), ws).worker for i in range(5)] == [0, 1, 2, 0, 1]
    sick = workers(3, healthy=[True, False, True])
    assert [decide(p, s, req(str(i)), sick).worker for i in range(2)] == [2, 0]


@pytest.mark.parametrize(
    ("in_flight", "healthy", "expected"),
    [
        ([3, 1, 2], [True] * 3, 1),
        ([2, 1, 1], [True] * 3, 1),  # the first of equals, as Rust's min_by_key
        ([3, 0, 2], [True, False, True], 2),
    ],
)
def test_least_loaded_takes_fewest_in_flight(in_flight, healthy, expected) -> None:
    p = LeastLoaded()
    ws = workers(3, in_flight=in_flight, healthy=healthy)
    assert p.route(req(), ws, p.initial_state(URLS[:3])).worker == expected


# --- session hash ----------------------------------------------------------------------

# From the canonical C MurmurHash64A (SMHasher) with mcrouter's seed 4193360111.
MURMUR = [
    (b"", 5566605159182504090),
    (b"a", 4425175614476078203),
    (b"hello", 1358530421184702161),
]
# From mcrouter's C furc_hash (lib/fbi/hash.c) with m = 2^23 - 1, as vllm-router uses it.
FURC = [
    (b"a", 7695180),
    (b"hello", 4189030),
    (b"http://worker-0:8000:17", 3122241),
    (b"header:x-session-id:conv-42", 7919992),
    (b"request:req-9", 4999162),
]


@pytest.mark.parametrize(("key", "value"), MURMUR)
def test_murmur_hash_64a_matches_the_c_reference(key: bytes, value: int) -> None:
    assert murmur_hash_64a(key, 4193360111) == value


@pytest.mark.parametrize(("key", "bucket"), FURC)
def test_furc_hash_matches_the_c_reference(key: bytes, bucket: int) -> None:
    assert furc_hash(key, (1 << 23) - 1) == bucket


def test_furc_hash_is_consistent_when_buckets_grow() -> None:
    """Growing m by one moves keys only into the new bucket (furc's defining property)."""
    keys = [f"k{i}".encode() for i in range(600)]
    before = {k: furc_hash(k, 11) for k in keys}
    after = {k: furc_hash(k, 12) for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert all(after[k] == 11 for k in moved)
    assert 0 < len(moved) < len(keys) / 6


def test_session_hash_keeps_a_session_on_one_worker_and_spreads_sessions() -> None:
    p = SessionHash()
    s = p.initial_state(URLS)
    ws = workers(8)
    assert len(s.points) == 8 * 160
    homes = {decide(p, s, req(f"t{t}", session="conv-7"), ws).worker for t in range(5)}
    assert len(homes) == 1
    spread = Tally(decide(p, s, req("x", session=f"s{i}"), ws).worker for i in range(1600))
    assert set(spread) == set(range(8))
    assert max(spread.values()) < 2.5 * min(spread.values())
    # Without a session the request itself is the key.
    assert p.key(req("req-1")) == "request:req-1"
    assert p.key(req("req-1", session="a")) == "header:x-session-id:a"


def test_session_hash_ring_moves_few_sessions_when_a_worker_joins() -> None:
    p = SessionHash()
    s8, s9 = p.initial_state(URLS[:7]), p.initial_state(URLS[:8])
    ws8, ws9 = workers(7), workers(8)
    moved = same = 0
    for i in range(800):
        r = req("x", session=f"s{i}")
        a, b = p.route(r, ws8, s8).worker, p.route(r, ws9, s9).worker
        if a == b:
            same += 1
        else:
            moved += 1
            assert b == 7  # only onto the new worker
    assert moved < same / 3


def test_session_hash_falls_back_when_the_owner_is_down() -> None:
    p = SessionHash()
    s = p.initial_state(URLS[:3])
    r = req("x", session="s1")
    owner = p.route(r, workers(3), s).worker
    healthy = [i != owner for i in range(3)]
    assert p.route(r, workers(3, healthy=healthy), s).worker == healthy.index(True)
    assert fbi_hash("s1") == fbi_hash("s1")


# --- SGLang cache-aware --------------------------------------------------------------

SG = CacheAwareConfig(cache_threshold=0.5, balance_abs_threshold=32, balance_rel_threshold=1.1)


@pytest.mark.parametrize(
    ("loads", "imbalanced"),
    [
        ([0, 32], False),  # difference 32 is not > 32
        ([0, 33], True),  # 33 > 32 and 33 > 0 * 1.1
        ([300, 332], False),  # difference 32
        ([300, 333], True),  # 33 > 32 and 333 > 330
        ([400, 433], False),  # 33 > 32 but 433 <= 440: only one threshold crossed
        ([400, 441], True),  # both crossed
        ([10, 10, 10], False),
    ],
)
def test_sglang_switches_to_shortest_queue_exactly_when_both_thresholds_cross(
    loads: list[int], imbalanced: bool
) -> None:
    p = SglangCacheAware(SG)
    s = p.initial_state(URLS[: len(loads)])
    # Worker 0 owns the prompt in the tree: the cache-aware branch would pick it.
    p.record(s, req("warm", [1, 2, 3, 4]), AnchorDecision(0, ""), 0.0)
    ws = workers(len(loads), in_flight=loads)
    d = p.route(req("r", [1, 2, 3, 4]), ws, s)
    assert p.imbalanced(loads) is imbalanced
    expected = min(range(len(loads)), key=lambda i: loads[i]) if imbalanced else 0
    assert d.worker == expected
    assert d.reason.startswith("imbalanced") is imbalanced


def test_sglang_routes_by_match_rate_then_smallest_tree() -> None:
    p = SglangCacheAware(SG)
    s = p.initial_state(URLS[:3])
    ws = workers(3)
    # Empty tree: every tenant has 0 tokens; the first smallest takes it, then owns it.
    assert decide(p, s, req("a", [1, 2, 3, 4]), ws).worker == 0
    # Another prompt: no match -> smallest tree (worker 1), and so on.
    assert decide(p, s, req("b", [9, 8, 7, 6]), ws).worker == 1
    # 3 of 4 blocks match worker 0's prompt: 75% > 50% -> worker 0.
    assert decide(p, s, req("c", [1, 2, 3, 5]), ws).worker == 0
    # 2 of 4 blocks is exactly 50%, not above the threshold -> smallest tree (worker 2).
    assert decide(p, s, req("d", [9, 8, 4, 4]), ws).worker == 2
    assert s.tree.size == [16 * 5, 16 * 4, 16 * 4]


def test_sglang_matched_tenant_is_the_latest_user_of_the_deepest_node() -> None:
    p = SglangCacheAware(SG)
    s = p.initial_state(URLS[:2])
    p.record(s, req("a", [1, 2]), AnchorDecision(0, ""), 1.0)
    p.record(s, req("b", [1, 2]), AnchorDecision(1, ""), 2.0)
    assert p.route(req("c", [1, 2, 3]), workers(2), s).worker == 1


def test_sglang_partial_tail_block_counts_its_tokens() -> None:
    tree = ApproxTree(1)
    r = req("a", [1, 2, 3], tokens=40)  # 16 + 16 + 8
    tree.insert(r, 0, 0.0)
    assert tree.size == [40]
    assert tree.match(req("b", [1, 2, 99], tokens=40))[0] == 32


def test_sglang_eviction_trims_least_recently_used_leaves_on_its_timer() -> None:
    p = SglangCacheAware(
        CacheAwareConfig(cache_threshold=0.5, eviction_interval_s=10.0, max_tree_tokens=64)
    )
    s = p.initial_state(URLS[:1])
    p.record(s, req("old", [1, 2, 3]), AnchorDecision(0, ""), 1.0)
    p.record(s, req("new", [1, 5, 6]), AnchorDecision(0, ""), 5.0)
    assert s.tree.size == [80]
    p.advance(s, 9.9)  # not yet due
    assert s.tree.size == [80]
    p.advance(s, 10.0)
    assert s.tree.size == [64]  # the old leaf (block 3) went, the shared block stayed
    assert s.tree.match(req("q", [1, 2, 3]))[0] == 32
    assert s.tree.match(req("q", [1, 5, 6]))[0] == 48
    assert s.next_eviction_s == 20.0
    p.advance(s, 45.0)
    assert s.next_eviction_s == 50.0


# --- llm-d ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("cached", "scores"),
    [
        ([0, 0, 0], [0.0, 0.0, 0.0]),
        ([5, 0, 0], [1.0, 0.0, 0.0]),  # a single pod with hits scores 1
        ([5, 5, 0], [1.0, 1.0, 0.0]),
        ([5, 3, 0], [1.0, 0.0, 0.0]),  # min-max over pods with hits only
        ([6, 4, 2], [1.0, 0.5, 0.0]),
    ],
)
def test_llmd_precise_prefix_scores(cached: list[int], scores: list[float]) -> None:
    got = llmd_prefix_scores(workers(3, cached_blocks=cached))
    assert [got[i] for i in range(3)] == scores


def test_llmd_queue_and_load_aware_scores() -> None:
    got = llmd_queue_scores(workers(3, waiting=[4, 0, 2]))
    assert [got[i] for i in range(3)] == [0.0, 1.0, 0.5]
    assert llmd_queue_scores(workers(2, waiting=[3, 3])) == {0: 1.0, 1: 1.0}
    w = workers(3, waiting=[0, 64, 500])
    assert [llmd_load_aware_score(x, 128) for x in w] == [0.5, 0.25, 0.0]


@pytest.mark.parametrize(
    ("cached", "usage", "waiting", "expected"),
    [
        ([8, 0, 0], [0.5, 0.5, 0.5], [0, 0, 0], 0),  # 3 + 1 + 2 beats 0 + 1 + 2
        ([8, 0, 0], [0.9, 0.0, 0.0], [6, 0, 3], 1),  # 3 + 0.2 + 0 < 0 + 2 + 2 > 0 + 2 + 1
        ([8, 7, 0], [0.0, 0.0, 0.0], [0, 0, 5], 0),
    ],
)
def test_llmd_weighted_sum_picks_max(cached, usage, waiting, expected) -> None:
    p = LlmdPrecisePrefix()
    ws = workers(3, cached_blocks=cached, kv_usage=usage, waiting=waiting)
    assert p.route(req("r", [1] * 8), ws, None).worker == expected


def test_llmd_ties_break_repeatably_and_evenly() -> None:
    p = LlmdPrecisePrefix(LlmdConfig())
    ws = workers(4)
    picks = [p.route(req(f"r{i}", [1]), ws, None).worker for i in range(400)]
    assert picks == [p.route(req(f"r{i}", [1]), ws, None).worker for i in range(400)]
    assert min(Tally(picks).values()) > 60


# --- Dynamo ----------------------------------------------------------------------------


def test_dynamo_cost_reproduces_the_design_doc_example() -> None:
    """router_design.md: prefill 8/5/2 and decode 10/5/9 blocks cost 18/10/11 -> worker 2."""
    r = req("r", list(range(10)))  # 10 blocks of 16 tokens
    ws = workers(3, cached_blocks=[2, 5, 8], shared_active_blocks=[0, 5, 1])
    p = DynamoKv()
    assert [p.logit(r, w) for w in ws] == [18.0, 10.0, 11.0]
    assert p.route(r, ws, None).worker == 1


def test_dynamo_counts_routed_prefill_and_active_blocks() -> None:
    r = req("r", list(range(4)))
    ws = workers(2, cached_blocks=[4, 0], prefill_tokens=[320, 0], active_blocks=[10, 10])
    # worker 0: (320 + 64 - 64) / 16 = 20 prefill + 14 decode; worker 1: 4 + 14.
    assert DynamoKv().route(r, ws, None).worker == 1
    # With overlap weight 0 only the decode blocks count: worker 0 shares none either.
    pure_load = DynamoKv(DynamoConfig(overlap_score_weight=0.0))
    ws = workers(2, active_blocks=[3, 9])
    assert pure_load.route(r, ws, None).worker == 0


def test_every_anchor_is_registered_and_pure_on_route() -> None:
    assert set(ANCHORS) == {
        "round-robin",
        "least-loaded",
        "session-hash",
        "sglang-cache-aware",
        "llm-d-precise",
        "dynamo-kv",
    }
    for name, make in ANCHORS.items():
        p = make()
        assert p.name == name
        s = p.initial_state(URLS[:3])
        ws = workers(3, in_flight=[1, 0, 2], cached_blocks=[0, 2, 1])
        r = req("r", [1, 2, 3], session="s")
        first = p.route(r, ws, s)
        assert p.route(r, ws, s) == first  # route reads the state, never changes it
        assert first.worker in range(3)
