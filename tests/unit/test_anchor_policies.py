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


def test_round_robin_and_least_loaded_name_their_rule() -> None:
    rr, ll = RoundRobin(), LeastLoaded()
    ws = workers(3, in_flight=[2, 1, 3])
    assert rr.route(req(), ws, rr.initial_state(URLS[:3])) == AnchorDecision(0, "next in turn")
    assert ll.route(req(), ws, None) == AnchorDecision(1, "fewest in flight (1)")


# --- session hash ----------------------------------------------------------------------

# From the canonical C MurmurHash64A (SMHasher) with mcrouter's seed 4193360111; the lengths
# cover no tail, every tail length's switch case, and one and two whole 8-byte words.
MURMUR = [
    (b"", 5566605159182504090),
    (b"a", 4425175614476078203),
    (b"hello", 1358530421184702161),
    (b"abcdefg", 8587108595135994943),
    (b"abcdefgh", 16958741362351311540),
    (b"abcdefghi", 11646422826543029541),
    (b"abcdefghijklmno", 9311075682835786268),
    (b"abcdefghijklmnop", 9144637208322949185),
    (b"abcdefghijklmnopq", 1732057883686006198),
]
# From mcrouter's C furc_hash (lib/fbi/hash.c) with m = 2^23 - 1, as vllm-router uses it.
FURC = [
    (b"a", 7695180),
    (b"hello", 4189030),
    (b"http://worker-0:8000:17", 3122241),
    (b"header:x-session-id:conv-42", 7919992),
    (b"request:req-9", 4999162),
    (b"p475131", (1 << 23) - 2),  # the last bucket
]
# From vllm-router's furc_hash (src/policies/consistent_hash.rs), which agrees with mcrouter's C
# on these: few buckets, powers of two among them, where the bit walk is short.
FURC_SMALL_M = [
    (b"a", 0, 0),  # m <= 1: the only bucket
    (b"a", 1, 0),
    (b"k6", 1, 0),
    (b"a", 2, 1),
    (b"k0", 2, 0),  # every bit from d down to 0 is clear
    (b"k0", 3, 0),
    (b"abcdefghi", 3, 2),
    (b"a", 4, 1),
    (b"abcdefghi", 4, 2),
    (b"k0", 4, 3),
    (b"a", 8, 4),
    (b"k0", 8, 3),
    (b"hello", 11, 9),
    (b"k0", 11, 8),
    (b"k6", 12, 11),
    (b"a", 1000, 900),
    (b"k6", 1000, 932),
]
# vllm-router's fbi_hash (consistent_hash.rs): furc_hash into 2^23 - 1 buckets, the bucket's
# 4 little-endian bytes through MurmurHash64A with the same seed.
FBI = [
    ("", 13863836683688404004),
    ("a", 3013377723451042321),
    ("hello", 14929803838999735318),
    ("http://worker-0:8000:0", 14011355879685098304),
    ("header:x-session-id:conv-42", 3262117670625979094),
    ("request:req-9", 3804084473580111250),
    ("p475131", 12685693644280867197),  # from bucket 2^23 - 2, the last
    ("x1858788641", 8463576226079002928),  # bucket 4897932
]


@pytest.mark.parametrize(("key", "value"), MURMUR)
def test_murmur_hash_64a_matches_the_c_reference(key: bytes, value: int) -> None:
    assert murmur_hash_64a(key, 4193360111) == value


@pytest.mark.parametrize(("key", "bucket"), FURC)
def test_furc_hash_matches_the_c_reference(key: bytes, bucket: int) -> None:
    assert furc_hash(key, (1 << 23) - 1) == bucket


@pytest.mark.parametrize(("key", "m", "bucket"), FURC_SMALL_M)
def test_furc_hash_matches_the_reference_for_few_buckets(key: bytes, m: int, bucket: int) -> None:
    assert furc_hash(key, m) == bucket


@pytest.mark.parametrize(
    ("key", "m", "bucket"),
    [
        (b"x3142887116", (1 << 22) + 1, 0),  # misses all 32 tries at d = 23: gives up, 0
        (b"x3142887115", (1 << 22) + 1, 1862181),  # its neighbour lands in range
        (b"x3142887116", 1 << 22, 3226487),  # d = 22: any 22-bit draw is in range
        (b"x1858788641", (1 << 23) - 1, 4897932),  # would miss all 32 tries at d = 24
    ],
)
def test_furc_hash_gives_up_with_bucket_0_only_after_32_tries(
    key: bytes, m: int, bucket: int
) -> None:
    """A try at depth d (2^(d-1) < m <= 2^d) draws a number in [2^(d-1), 2^d); with
    m = 2^22 + 1 only 2^22 is in range. These keys (found by search with the C reference)
    have all 32 tries' first bits set at depth 23 or 24: at that depth furc returns 0, "a legal
    value in all cases" (mcrouter hash.c), so the depth must be exactly ceil(log2 m)."""
    assert furc_hash(key, m) == bucket


@pytest.mark.parametrize(
    ("key", "m"), [(b"hello", 2), (b"k9", 2), (b"abcdefghi", 2), (b"hello", 3), (b"hello", 8)]
)
def test_furc_hash_follows_vllm_router_where_it_departs_from_mcrouter(key: bytes, m: int) -> None:
    """When every bit from d down to 1 is clear, mcrouter's C gives up with 0 (`--d == 0`),
    while vllm-router tests `d == 0` before decrementing, so it reads bit 0 as well and lands
    on 1 when that bit is set. The anchor reproduces vllm-router; mcrouter gives 0 here."""
    assert furc_hash(key, m) == 1


@pytest.mark.parametrize(("key", "value"), FBI)
def test_fbi_hash_matches_vllm_router(key: str, value: int) -> None:
    assert fbi_hash(key) == value


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


def test_session_hash_names_the_key_it_followed() -> None:
    p = SessionHash()
    s = p.initial_state(URLS[:3])
    owner = p.route(req("x", session="s1"), workers(3), s).worker
    assert p.route(req("x", session="s1"), workers(3), s) == AnchorDecision(
        owner, "ring owner of header:x-session-id:s1"
    )
    anonymous = p.route(req("req-9"), workers(3), s)
    assert anonymous.reason == "ring owner of request:req-9"


def test_session_hash_falls_back_to_the_first_healthy_worker_when_the_owner_is_gone() -> None:
    """The ring still names a worker the router no longer lists (vllm-router: "not found in
    current worker set, falling back"): the first healthy listed worker takes the request."""
    p = SessionHash()
    s = p.initial_state(URLS[:3])
    session = next(
        f"s{i}" for i in range(100) if p.route(req("x", session=f"s{i}"), workers(3), s).worker == 2
    )
    listed = workers(2, healthy=[False, True])  # worker 2 is not among them
    assert p.route(req("x", session=session), listed, s) == AnchorDecision(
        1, "ring owner unavailable"
    )


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


@pytest.mark.parametrize(
    ("loads", "imbalanced"),
    [
        ([0, 64], False),  # difference 64 is not > 64
        ([0, 65], True),
        ([200, 300], False),  # 300 is not > 200 * 1.5
        ([200, 301], True),
    ],
)
def test_sglang_default_thresholds_are_strict_at_both_boundaries(
    loads: list[int], imbalanced: bool
) -> None:
    """The launcher's defaults: balance_abs_threshold 64, balance_rel_threshold 1.5."""
    assert SglangCacheAware().imbalanced(loads) is imbalanced


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


@pytest.mark.parametrize(
    ("sends", "expected"),
    [
        ([(0, 1.0), (1, 2.0)], 1),
        ([(1, 1.0), (0, 2.0)], 0),  # the latest, not the highest index
        ([(2, 1.0), (1, 1.0)], 1),  # equally recent: the lowest index
    ],
)
def test_sglang_matched_tenant_is_the_latest_user_of_the_deepest_node(
    sends: list[tuple[int, float]], expected: int
) -> None:
    p = SglangCacheAware(SG)
    s = p.initial_state(URLS[:3])
    for tenant, at in sends:
        p.record(s, req("w", [1, 2]), AnchorDecision(tenant, ""), at)
    assert p.route(req("c", [1, 2, 3]), workers(3), s).worker == expected


def test_sglang_decision_names_its_branch_and_reports_the_match_rate() -> None:
    p = SglangCacheAware(SG)
    s = p.initial_state(URLS[:3])
    p.record(s, req("a", [1, 2, 3, 4]), AnchorDecision(0, ""), 1.0)
    ws = workers(3)
    assert p.route(req("b", [1, 2, 3, 5]), ws, s) == AnchorDecision(
        0, "prefix match 75%", {0: 0.75}
    )
    assert p.route(req("c", [9, 9]), ws, s) == AnchorDecision(
        1, "prefix match 0%: smallest tree", {1: 0.0}
    )
    busy = workers(3, in_flight=[0, 0, 40])
    assert p.route(req("d", [1, 2, 3, 4]), busy, s) == AnchorDecision(
        0, "imbalanced: shortest queue"
    )


def test_sglang_empty_prompt_matches_nothing_and_goes_to_the_smallest_tree() -> None:
    p = SglangCacheAware(SG)
    s = p.initial_state(URLS[:2])
    p.record(s, req("a", [1, 2]), AnchorDecision(0, ""), 1.0)
    assert p.route(req("e", [], tokens=0), workers(2), s) == AnchorDecision(
        1, "prefix match 0%: smallest tree", {1: 0.0}
    )


def test_sglang_threshold_below_zero_sends_an_unmatched_prompt_to_the_latest_tenant() -> None:
    """Every prompt then counts as matched, at the root: its tenants are every worker sent
    anything, the most recent one first (not the smallest tree, worker 2's)."""
    p = SglangCacheAware(CacheAwareConfig(cache_threshold=-1.0))
    s = p.initial_state(URLS[:3])
    p.record(s, req("a", [1]), AnchorDecision(0, ""), 1.0)
    p.record(s, req("b", [2]), AnchorDecision(1, ""), 2.0)
    assert p.route(req("c", [9]), workers(3), s) == AnchorDecision(1, "prefix match 0%", {1: 0.0})


@pytest.mark.parametrize(
    ("healthy", "sent_to", "expected"),
    [
        ([False, True, True], None, 1),  # the smallest tree (worker 0's, empty) is down
        ([True, True, False], 2, 0),  # the matched tenant is down
    ],
)
def test_sglang_unhealthy_choice_falls_back_to_the_first_healthy_worker(
    healthy: list[bool], sent_to: int | None, expected: int
) -> None:
    p = SglangCacheAware(SG)
    s = p.initial_state(URLS[:3])
    if sent_to is not None:
        p.record(s, req("a", [1, 2]), AnchorDecision(sent_to, ""), 1.0)
    ws = workers(3, healthy=healthy)
    assert p.route(req("r", [1, 2]), ws, s) == AnchorDecision(
        expected, "chosen worker unhealthy: first healthy"
    )


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


def test_sglang_eviction_queues_a_parent_once_its_last_child_of_that_tenant_goes() -> None:
    tree = ApproxTree(1)
    tree.insert(req("a", [1, 2]), 0, 1.0)
    tree.insert(req("b", [1, 3, 4]), 0, 2.0)
    tree.evict(16)
    # Leaves 2 (oldest) and 4 go, then 3 (a leaf once 4 went); block 1 is all that fits.
    assert tree.size == [16]
    assert [tree.match(req("q", b))[0] for b in ([1, 2], [1, 3, 4])] == [16, 16]


def test_sglang_eviction_keeps_a_block_another_tenant_still_holds() -> None:
    tree = ApproxTree(2)
    tree.insert(req("a", [1, 2]), 0, 1.0)
    tree.insert(req("a", [1, 2]), 1, 2.0)
    tree.insert(req("b", [5, 6, 7]), 0, 3.0)
    tree.evict(48)
    # Tenant 0 gives up its oldest path, [1, 2]; tenant 1 (within the limit) keeps it.
    assert tree.size == [48, 32]
    assert tree.match(req("q", [1, 2]))[0] == 32
    assert tree.match(req("q", [5, 6, 7]))[0] == 48


def test_sglang_eviction_trims_every_tenant_over_the_limit() -> None:
    tree = ApproxTree(2)
    for block, tenant, at in [(1, 0, 1.0), (2, 0, 2.0), (3, 1, 3.0), (4, 1, 4.0)]:
        tree.insert(req("r", [block]), tenant, at)
    tree.evict(16)
    assert tree.size == [16, 16]
    assert [tree.match(req("q", [b]))[0] for b in (1, 2, 3, 4)] == [0, 16, 0, 16]


def test_sglang_eviction_copes_with_leaves_sent_at_the_same_instant() -> None:
    tree = ApproxTree(1)
    prompts = [[1, 2, 3], [1, 2, 4], [1, 5], [6, 7], [6, 8], [9]]
    for blocks in prompts:
        tree.insert(req("r", blocks), 0, 1.0)
    assert tree.size == [9 * 16]
    tree.evict(16)
    # Which block stays is a tie; that exactly one first block stays is not.
    assert tree.size == [16]
    assert sorted({tree.match(req("q", b))[0] for b in prompts}) == [0, 16]


def test_sglang_eviction_copes_with_a_requeued_parent_as_old_as_a_waiting_leaf() -> None:
    tree = ApproxTree(1)
    tree.insert(req("a", [1]), 0, 2.0)
    tree.insert(req("b", [2, 3, 4]), 0, 1.0)
    tree.insert(req("c", [2]), 0, 2.0)  # block 2 is now as recent as leaf 1
    tree.evict(16)
    # 4 and 3 (the oldest) go, then 2 or 1: equally old, either may stay.
    assert tree.size == [16]
    assert tree.match(req("q", [2, 3, 4]))[0] <= 16
    assert sorted(tree.match(req("q", [b]))[0] for b in (1, 2)) == [0, 16]


def test_sglang_upkeep_without_workers_only_moves_the_timer() -> None:
    p = SglangCacheAware(CacheAwareConfig(eviction_interval_s=10.0, max_tree_tokens=0))
    s = p.initial_state([])
    p.advance(s, 10.0)
    assert s.tree.size == []
    assert s.next_eviction_s == 20.0


# --- llm-d ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("cached", "scores"),
    [
        ([0, 0, 0], [0.0, 0.0, 0.0]),
        ([5, 0, 0], [1.0, 0.0, 0.0]),  # a single pod with hits scores 1
        ([5, 5, 0], [1.0, 1.0, 0.0]),
        ([5, 3, 0], [1.0, 0.0, 0.0]),  # min-max over pods with hits only
        ([6, 4, 2], [1.0, 0.5, 0.0]),
        ([1, 0, 0], [1.0, 0.0, 0.0]),  # one block is a hit
        ([3, 1, 2], [1.0, 0.0, 0.5]),  # the shortest run, one block, scores 0
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
    ("waiting", "scores"),
    [
        ([2, 4, 3], [1.0, 0.0, 0.5]),  # min-max over the queues, the shortest not empty
        ([5], [1.0]),
    ],
)
def test_llmd_queue_scores_normalise_between_shortest_and_longest(
    waiting: list[int], scores: list[float]
) -> None:
    got = llmd_queue_scores(workers(len(waiting), waiting=waiting))
    assert [got[i] for i in range(len(waiting))] == scores


@pytest.mark.parametrize(
    ("waiting", "score"),
    [(0, 0.5), (1, 0.5 * 127 / 128), (64, 0.25), (127, 0.5 / 128), (128, 0.0), (129, 0.0)],
)
def test_llmd_load_aware_score_falls_from_half_to_zero_at_the_threshold(
    waiting: int, score: float
) -> None:
    assert llmd_load_aware_score(workers(1, waiting=[waiting])[0], 128) == score


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


def test_llmd_decision_reports_every_weighted_total() -> None:
    p = LlmdPrecisePrefix()
    ws = workers(3, cached_blocks=[8, 0, 0], kv_usage=[0.5, 0.25, 0.0], waiting=[0, 2, 4])
    # 3 * prefix + 2 * (1 - usage) + 2 * queue score
    assert p.route(req("r", [1] * 8), ws, None) == AnchorDecision(
        0, "max score (8 blocks hit)", {0: 3.0 + 1.0 + 2.0, 1: 1.5 + 1.0, 2: 2.0}
    )


def test_llmd_load_aware_scorer_adds_its_weighted_score() -> None:
    p = LlmdPrecisePrefix(LlmdConfig(load_aware_weight=1.0))
    ws = workers(3, waiting=[0, 64, 128])
    # kv 2 * 1, queue 2 * (1, 0.5, 0), load-aware 0.5, 0.25, 0
    assert p.route(req("r", [1]), ws, None).scores == {0: 4.5, 1: 3.25, 2: 2.0}


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


@pytest.mark.parametrize(
    ("tokens", "cached", "prefill", "active", "shared", "logit"),
    [
        (64, 4, 0, 0, 0, 0.0 + 4),  # fully cached: no prefill, 4 decode blocks
        (64, 4, 32, 10, 4, 2.0 + 10),  # routed prefill counts; shared blocks not twice
        (40, 0, 0, 0, 0, 2.5 + 3),  # a partial last block: 2.5 to prefill, 3 to hold
        (40, 2, 0, 5, 2, 0.5 + 6),
    ],
)
def test_dynamo_logit_is_prefill_plus_decode_blocks(
    tokens: int, cached: int, prefill: int, active: int, shared: int, logit: float
) -> None:
    w = workers(
        1,
        cached_blocks=[cached],
        prefill_tokens=[prefill],
        active_blocks=[active],
        shared_active_blocks=[shared],
    )[0]
    assert DynamoKv().logit(req("r", [1, 2, 3], tokens=tokens), w) == logit


def test_dynamo_decision_reports_every_worker_cost() -> None:
    r = req("r", list(range(10)))
    ws = workers(3, cached_blocks=[2, 5, 8], shared_active_blocks=[0, 5, 1])
    assert DynamoKv().route(r, ws, None) == AnchorDecision(
        1, "lowest cost 10.0 blocks", {0: 18.0, 1: 10.0, 2: 11.0}
    )


@pytest.mark.parametrize("name", sorted(ANCHORS))
def test_every_anchor_refuses_to_route_when_no_worker_is_healthy(name: str) -> None:
    p = ANCHORS[name]()
    s = p.initial_state(URLS[:2])
    with pytest.raises(ValueError, match=r"^no healthy worker$"):
        p.route(req("r", [1, 2], session="s"), workers(2, healthy=[False, False]), s)


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
