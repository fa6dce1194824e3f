"""The default routing profile: table-driven decisions and score invariants."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from appliance.config.settings import RoutingSettings
from appliance.domain.records import WorkerId
from appliance.policy.routing import RouteKind, RouteRequest, WorkerView, route
from appliance.policy.routing.core import MEMORY_WAIT_S, RoutingProfile, default_profile, wait_s
from tests.fakes import LinearCost

A, B, C = WorkerId("a"), WorkerId("b"), WorkerId("c")
M = frozenset({"m"})


def w(name: WorkerId, **kw: object) -> WorkerView:
    return WorkerView(worker=name, models=M, **kw)  # type: ignore[arg-type]


CASES = [
    # (description, request, workers, expected worker, the decision's reason)
    (
        "prefix resident wins over an idle cold worker",
        RouteRequest("m", 1000, session_home=A),
        [w(A, resident_tokens=900, queue_s=0.05), w(B)],
        A,
        "prefix resident (900 tokens)",
    ),
    (
        # At A: wait 1.0 s + 100 fresh * 1 ms + 900 reused * 0.1 ms = 1.19 s; at B: 1.0 s cold.
        # The turn's own wait would be shorter at B, but the 0.81 s it saves at A counts
        # twice against the 1.0 s queue: the move's prefill delays the turns behind it at B.
        "a queue that costs more than the saving but less than twice it keeps the session",
        RouteRequest("m", 1000, session_home=A),
        [w(A, resident_tokens=900, queue_s=1.0, queued_share=0.9), w(B)],
        A,
        "prefix resident (900 tokens)",
    ),
    (
        # At A: 2.0 s queue, more than twice the 0.81 s saving.
        "a queue that costs more than twice the saving moves the session",
        RouteRequest("m", 1000, session_home=A),
        [w(A, resident_tokens=900, queue_s=2.0, queued_share=0.9), w(B)],
        B,
        "moved from a: est. TTFT 1000 ms here vs 2190 ms there",
    ),
    (
        # Scale 1.6 s: at A, 2 x 0.81 s saved / 1.6 = 1.0125 against B's empty queue's 1.
        "a queue just under twice the saving keeps the session",
        RouteRequest("m", 1000, session_home=A),
        [w(A, resident_tokens=900, queue_s=1.6, queued_share=0.9), w(B)],
        A,
        "prefix resident (900 tokens)",
    ),
    (
        "a queue just over twice the saving moves the session",
        RouteRequest("m", 1000, session_home=A),
        [w(A, resident_tokens=900, queue_s=1.65, queued_share=0.9), w(B)],
        B,
        "moved from a: est. TTFT 1000 ms here vs 1840 ms there",
    ),
    (
        "without a session the reason names the queue that outweighed a resident prefix",
        RouteRequest("m", 1000),
        [w(A, resident_tokens=900, queue_s=2.0), w(B)],
        B,
        "queue at a costs more than its 900 resident tokens save",
    ),
    (
        "a single resident token counts as a resident prefix",
        RouteRequest("m", 1000),
        [w(A), w(B, resident_tokens=1)],
        B,
        "prefix resident (1 tokens)",
    ),
    (
        "without any resident prefix the shortest queue wins",
        RouteRequest("m", 1000),
        [w(A, queue_s=0.3), w(B, queue_s=0.1), w(C, queue_s=0.2)],
        B,
        "least estimated time to first token",
    ),
    (
        "unhealthy, draining and wrong-model workers are filtered out",
        RouteRequest("m", 1000),
        [
            w(A, healthy=False, resident_tokens=1000),
            w(B, draining=True, resident_tokens=1000),
            WorkerView(C, frozenset({"other"})),
            w(WorkerId("d"), queue_s=0.5),
        ],
        WorkerId("d"),
        "only eligible worker",
    ),
    (
        # 20 tokens: a cold prefill of 20 ms. Scored on that, A's 2 ms more of queue
        # (0.1) outweighed the affinity (0.05); on the floor's 500 ms it is worth 0.004.
        "a short turn stays home for a few milliseconds of queue",
        RouteRequest("m", 20, session_home=A),
        [w(A, queue_s=0.002), w(B)],
        A,
        "least estimated time to first token",
    ),
    (
        # 30 ms of queue on the floor's 500 ms: 0.06, more than the affinity.
        "a short turn moves for more queue than its affinity is worth",
        RouteRequest("m", 20, session_home=A),
        [w(A, queue_s=0.03), w(B)],
        B,
        "moved from a: est. TTFT 20 ms here vs 50 ms there",
    ),
    (
        "affinity breaks a tie between equal workers",
        RouteRequest("m", 1000, session_home=B),
        [w(A), w(B)],
        B,
        "least estimated time to first token",
    ),
    (
        "a home carrying exactly the bounded share (half) of the queue keeps its affinity",
        RouteRequest("m", 1000, session_home=B),
        [w(A, queued_share=0.5), w(B, queued_share=0.5)],
        B,
        "least estimated time to first token",
    ),
    (
        "more free KV cache breaks a tie between equal workers",
        RouteRequest("m", 1000),
        [w(A, kv_usage=0.6), w(B, kv_usage=0.2)],
        B,
        "least estimated time to first token",
    ),
    (
        "a pool full of holds is freer than one as full of running requests",
        RouteRequest("m", 1000),
        [w(A, kv_usage=0.95, kv_held=0.2), w(B, kv_usage=0.95, kv_held=0.8)],
        B,
        "least estimated time to first token",
    ),
    (
        "fewer recent failures break a tie between equal workers",
        RouteRequest("m", 1000),
        [w(A, recent_failures=1), w(B)],
        B,
        "least estimated time to first token",
    ),
    (
        # The tie-breakers are small: all three against A are worth less than a queue
        # shorter by half the turn's cold prefill.
        "the tie-breakers together give way to a queue shorter by half the cold prefill",
        RouteRequest("m", 1000, session_home=B),
        [w(A, kv_usage=1.0, recent_failures=9), w(B, queue_s=0.5)],
        A,
        "moved from b: est. TTFT 1000 ms here vs 1500 ms there",
    ),
    (
        "affinity is bounded: a home carrying most of the queue gets none",
        RouteRequest("m", 1000, session_home=B),
        [w(A, queue_s=0.001, queued_share=0.1), w(B, queue_s=0.001, queued_share=0.9)],
        A,
        "moved from b: est. TTFT 1001 ms here vs 1001 ms there",
    ),
    (
        # At A: 2.0 s queue + 0.19 s prefill. At B, 10x slower than the profile: 10 s cold.
        # Alike, B would win (the case above); measured speeds keep the session.
        "a move to a slower worker must beat its slower cold prefill",
        RouteRequest("m", 1000, session_home=A),
        [w(A, resident_tokens=900, queue_s=2.0, queued_share=0.9), w(B, slowdown=10.0)],
        A,
        "prefix resident (900 tokens)",
    ),
    (
        "with no prefix anywhere the faster worker wins",
        RouteRequest("m", 1000),
        [w(A, slowdown=3.0), w(B, slowdown=0.5)],
        B,
        "least estimated time to first token",
    ),
]


@pytest.mark.parametrize(
    ("what", "req", "workers", "expected", "reason"), CASES, ids=[c[0] for c in CASES]
)
def test_decisions(
    what: str, req: RouteRequest, workers: list[WorkerView], expected: WorkerId, reason: str
) -> None:
    decision = route(req, workers, LinearCost(), default_profile())
    assert decision.worker == expected, decision
    assert decision.chosen is not None and decision.chosen.worker == expected
    assert decision.reason == reason
    assert decision.kind == KIND_OF_SENTENCE[reason.split(" (")[0].split(":")[0].split(" at ")[0]]


KIND_OF_SENTENCE = {
    "only eligible worker": RouteKind.ONLY_ELIGIBLE,
    "least estimated time to first token": RouteKind.LEAST_TTFT,
    "prefix resident": RouteKind.PREFIX_RESIDENT,
    "queue": RouteKind.QUEUE_OVER_PREFIX,
    "moved from a": RouteKind.MOVED,
    "moved from b": RouteKind.MOVED,
}
"""Each reason's sentence with the kind it must carry: the metric labels and the replay's
counts use the kind, so they stay a fixed set whatever the figures."""


def test_no_eligible_worker_names_each_filter() -> None:
    d = route(
        RouteRequest("m", 10),
        [w(A, healthy=False), w(B, draining=True), w(C, excluded=True)],
        LinearCost(),
        default_profile(),
    )
    assert d.worker is None and d.reason == "no eligible worker"
    assert d.chosen is None
    assert d.kind == RouteKind.NO_ELIGIBLE
    assert d.excluded == {"a": "healthy", "b": "not_draining", "c": "not_excluded"}


def test_excluded_workers_are_named_by_their_first_failed_filter_beside_a_pick() -> None:
    d = route(
        RouteRequest("m", 10),
        [
            w(A, healthy=False, draining=True),
            w(B, draining=True),
            WorkerView(C, frozenset({"other"})),
            w(WorkerId("d")),
        ],
        LinearCost(),
        default_profile(),
    )
    assert d.worker == "d"
    assert d.excluded == {"a": "healthy", "b": "not_draining", "c": "model"}


def test_an_empty_prompt_on_idle_workers_still_picks_the_first_listed() -> None:
    # Nothing to prefill and no queue anywhere: every score's scale is zero seconds.
    d = route(RouteRequest("m", 0), [w(A), w(B)], LinearCost(), default_profile())
    assert d.worker == A
    assert d.reason == "least estimated time to first token"
    assert [c.scores["queue"] for c in d.candidates] == [1.0, 1.0]


def test_the_default_profile_is_named_appliance() -> None:
    assert default_profile().name == "appliance"


def test_the_policy_defaults_are_the_daemons_routing_settings_defaults() -> None:
    # The daemon builds its profile from the settings, the replay from the defaults: the
    # two must route alike.
    def weights(profile: RoutingProfile) -> list[tuple[str, float]]:
        return [(name, weight) for name, weight, _ in profile.scorers]

    settings = RoutingSettings.model_validate({})
    assert weights(default_profile()) == weights(default_profile(**settings.model_dump()))
    # The bound is inside the affinity scorer; the scores below show the default's is half.
    assert settings.affinity_max_share == 0.5


SCORES = [
    # (description, prompt tokens, session home, workers, worker, scorer, its score)
    ("no recent failures score the full 1", 1000, None, [w(A)], A, "failures", 1.0),
    ("one recent failure halves it", 1000, None, [w(A, recent_failures=1)], A, "failures", 0.5),
    (
        "three recent failures quarter it",
        1000,
        None,
        [w(A, recent_failures=3)],
        A,
        "failures",
        0.25,
    ),
    ("an empty KV cache scores the full 1", 1000, None, [w(A)], A, "kv_pressure", 1.0),
    ("kv_pressure is the free share", 1000, None, [w(A, kv_usage=0.25)], A, "kv_pressure", 0.75),
    ("a full KV cache scores 0", 1000, None, [w(A, kv_usage=1.0)], A, "kv_pressure", 0.0),
    ("an over-full KV reading clips to 0", 1000, None, [w(A, kv_usage=1.5)], A, "kv_pressure", 0.0),
    ("a negative KV reading clips to 1", 1000, None, [w(A, kv_usage=-0.5)], A, "kv_pressure", 1.0),
    (
        "held idle KV counts as free",
        1000,
        None,
        [w(A, kv_usage=0.9, kv_held=0.6)],
        A,
        "kv_pressure",
        0.7,
    ),
    (
        "held KV past the usage reading clips to 1",
        1000,
        None,
        [w(A, kv_usage=0.3, kv_held=0.5)],
        A,
        "kv_pressure",
        1.0,
    ),
    (
        "a queue scores against the cold prefill when that is longer",
        2000,
        None,
        [w(A, queue_s=1.0)],
        A,
        "queue",
        0.5,
    ),
    (
        "a short turn's queue scores against the scale's floor, not its short cold prefill",
        100,
        None,
        [w(A, queue_s=0.05)],
        A,
        "queue",
        0.9,
    ),
    (
        "a cold prefill just over the floor sets the scale",
        600,
        None,
        [w(A, queue_s=0.3)],
        A,
        "queue",
        0.5,
    ),
    (
        "the longest queue sets the scale when it exceeds the cold prefill",
        1000,
        None,
        [w(A, queue_s=4.0), w(B, queue_s=1.0)],
        B,
        "queue",
        0.75,
    ),
    (
        "the longest queue scores 0",
        1000,
        None,
        [w(A, queue_s=4.0), w(B, queue_s=1.0)],
        A,
        "queue",
        0.0,
    ),
    ("the slowest worker without a prefix saves nothing", 1000, None, [w(A)], A, "reuse", 0.0),
    (
        "a resident prefix scores the prefill it saves over the scale",
        1000,
        None,
        [w(A, resident_tokens=900)],
        A,
        "reuse",
        0.81,
    ),
    (
        "a faster worker without a prefix saves against the slowest one's cold prefill",
        1000,
        None,
        [w(A, slowdown=2.0), w(B)],
        B,
        "reuse",
        0.5,
    ),
    ("the session's home scores affinity 1", 1000, A, [w(A)], A, "affinity", 1.0),
    (
        "a home with exactly the bounded share keeps affinity",
        1000,
        A,
        [w(A, queued_share=0.5)],
        A,
        "affinity",
        1.0,
    ),
    (
        "a home above the bounded share loses affinity",
        1000,
        A,
        [w(A, queued_share=0.51)],
        A,
        "affinity",
        0.0,
    ),
    ("a worker that is not home gets no affinity", 1000, B, [w(A), w(B)], A, "affinity", 0.0),
]


@pytest.mark.parametrize(
    ("what", "prompt", "home", "workers", "worker", "scorer", "expected"),
    SCORES,
    ids=[c[0] for c in SCORES],
)
def test_scores(
    what: str,
    prompt: int,
    home: WorkerId | None,
    workers: list[WorkerView],
    worker: WorkerId,
    scorer: str,
    expected: float,
) -> None:
    d = route(RouteRequest("m", prompt, home), workers, LinearCost(), default_profile())
    scores = {c.worker: c.scores for c in d.candidates}
    assert scores[worker][scorer] == pytest.approx(expected)


def test_estimated_ttft_is_queue_plus_prefill_over_the_resident_prefix() -> None:
    d = route(
        RouteRequest("m", 1000),
        [w(A, resident_tokens=600, queue_s=0.2)],
        LinearCost(),
        default_profile(),
    )
    # 0.2 s queue + 400 fresh * 1 ms + 600 reused * 0.1 ms
    assert d.candidates[0].ttft_estimate_s == pytest.approx(0.2 + 0.4 + 0.06)
    assert d.candidates[0].prefill_s == pytest.approx(0.4 + 0.06)  # the turn's own part


def test_a_workers_slowdown_scales_its_prefill_in_the_estimate() -> None:
    d = route(
        RouteRequest("m", 1000),
        [w(A, resident_tokens=600, queue_s=0.2, slowdown=4.0)],
        LinearCost(),
        default_profile(),
    )
    assert d.candidates[0].ttft_estimate_s == pytest.approx(0.2 + 4 * (0.4 + 0.06))
    assert d.candidates[0].prefill_s == pytest.approx(4 * (0.4 + 0.06))


@pytest.mark.parametrize(
    ("prompt", "usage", "held", "pool", "expected"),
    [
        (501, 0.75, 0.25, 0, 0.2),  # the pool's size not known yet: the queue alone
        (500, 0.75, 0.25, 1000, 0.2),  # room for exactly the prompt (1000 * (1 - 0.5))
        (501, 0.75, 0.25, 1000, 0.2 + MEMORY_WAIT_S),  # one token more than the room
        (300, 0.75, 0.0, 1000, 0.2 + MEMORY_WAIT_S),  # 250 free, none of it held
        (300, 0.75, 0.5, 1000, 0.2),  # 250 free and 500 held: holds are room
        (1, 0.75, 0.25, 1, 0.2 + MEMORY_WAIT_S),  # the least pool known: room for half a token
    ],
)
def test_a_turn_waits_where_the_pool_has_no_room_for_its_prompt(
    prompt: int, usage: float, held: float, pool: int, expected: float
) -> None:
    worker = w(A, queue_s=0.2, kv_usage=usage, kv_held=held, kv_pool_tokens=pool)
    assert wait_s(RouteRequest("m", prompt), worker) == pytest.approx(expected)


def test_a_resident_prefix_without_room_for_the_turn_loses_to_a_worker_with_room() -> None:
    # 1000 tokens: 1 s cold, 0.1 s over a resident prefix; A holds it but its pool is full of
    # running turns, B is empty.
    full = {"kv_usage": 0.95, "kv_pool_tokens": 10_000}
    request = RouteRequest("m", 1000, session_home=A)
    room_unknown = [w(A, resident_tokens=1000, kv_usage=0.95), w(B)]
    assert route(request, room_unknown, LinearCost(), default_profile()).worker == A
    no_room = [w(A, resident_tokens=1000, **full), w(B, kv_pool_tokens=10_000)]
    d = route(request, no_room, LinearCost(), default_profile())
    assert d.worker == B
    by_worker = {c.worker: c for c in d.candidates}
    assert by_worker[A].ttft_estimate_s == pytest.approx(MEMORY_WAIT_S + 0.1)  # room, prefill
    assert by_worker[A].prefill_s == pytest.approx(0.1)  # the wait is not the turn's prefill
    assert by_worker[B].ttft_estimate_s == pytest.approx(1.0)
    assert by_worker[A].scores["queue"] == 0.0  # the wait for room sets the scale
    assert by_worker[A].scores["reuse"] == pytest.approx(0.9 / MEMORY_WAIT_S)  # 0.9 s saved


views = st.builds(
    WorkerView,
    worker=st.sampled_from([A, B, C]),
    models=st.just(M),
    healthy=st.booleans(),
    draining=st.booleans(),
    resident_tokens=st.integers(0, 10**6),
    queue_s=st.floats(0, 1e4),
    queued_share=st.floats(0, 1),
    kv_usage=st.floats(0, 1),
    kv_held=st.floats(0, 1),
    kv_pool_tokens=st.integers(0, 10**6),
    recent_failures=st.integers(0, 100),
    slowdown=st.floats(1e-3, 1e5),
)


@given(st.integers(1, 10**6), st.lists(views, max_size=6), st.sampled_from([None, A, B]))
def test_scores_stay_in_unit_range_and_the_pick_is_the_best(
    prompt: int, workers: list[WorkerView], home: WorkerId | None
) -> None:
    d = route(RouteRequest("m", prompt, home), workers, LinearCost(), default_profile())
    for c in d.candidates:
        assert all(0.0 <= s <= 1.0 for s in c.scores.values()), c.scores
    if d.candidates:
        assert d.worker == d.candidates[0].worker
        assert d.candidates[0].score == max(c.score for c in d.candidates)
    else:
        assert d.worker is None
