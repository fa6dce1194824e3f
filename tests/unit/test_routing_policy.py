"""The default routing profile: table-driven decisions and score invariants."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from appliance.domain.records import WorkerId
from appliance.policy.routing import RouteRequest, WorkerView, route
from appliance.policy.routing.core import default_profile
from tests.fakes import LinearCost

A, B, C = WorkerId("a"), WorkerId("b"), WorkerId("c")
M = frozenset({"m"})


def w(name: WorkerId, **kw: object) -> WorkerView:
    return WorkerView(worker=name, models=M, **kw)  # type: ignore[arg-type]


CASES = [
    # (description, request, workers, expected worker, reason fragment)
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
        "moved from a",
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
        "affinity breaks a tie between equal workers",
        RouteRequest("m", 1000, session_home=B),
        [w(A), w(B)],
        B,
        "least estimated",
    ),
    (
        "affinity is bounded: a home carrying most of the queue gets none",
        RouteRequest("m", 1000, session_home=B),
        [w(A, queue_s=0.001, queued_share=0.1), w(B, queue_s=0.001, queued_share=0.9)],
        A,
        "moved from b",
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
    assert reason in decision.reason


def test_no_eligible_worker_names_each_filter() -> None:
    d = route(
        RouteRequest("m", 10),
        [w(A, healthy=False), w(B, draining=True)],
        LinearCost(),
        default_profile(),
    )
    assert d.worker is None and d.reason == "no eligible worker"
    assert d.excluded == {"a": "healthy", "b": "not_draining"}


def test_estimated_ttft_is_queue_plus_prefill_over_the_resident_prefix() -> None:
    d = route(
        RouteRequest("m", 1000),
        [w(A, resident_tokens=600, queue_s=0.2)],
        LinearCost(),
        default_profile(),
    )
    # 0.2 s queue + 400 fresh * 1 ms + 600 reused * 0.1 ms
    assert d.candidates[0].ttft_estimate_s == pytest.approx(0.2 + 0.4 + 0.06)


def test_a_workers_slowdown_scales_its_prefill_in_the_estimate() -> None:
    d = route(
        RouteRequest("m", 1000),
        [w(A, resident_tokens=600, queue_s=0.2, slowdown=4.0)],
        LinearCost(),
        default_profile(),
    )
    assert d.candidates[0].ttft_estimate_s == pytest.approx(0.2 + 4 * (0.4 + 0.06))


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
