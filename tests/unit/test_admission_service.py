"""The admission service: its counters, its ledger rows (the real writer on a temporary
file), the operator feed, the state snapshot and the release of streamed turns."""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import AsyncGenerator, Iterator
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from appliance.api.model_route import RelayedStream
from appliance.domain.block_hash import BlockHashChain
from appliance.domain.records import SessionId, TaskId, TenantId, WorkerId
from appliance.ledger import Ledger
from appliance.policy.admission import AdmissionLimits
from appliance.services.admission import (
    AdmissionRefused,
    AdmissionService,
    TurnTicket,
    WorkerEstimator,
    resident_hint,
)
from appliance.services.events import EventFeed
from appliance.services.sessions import SessionState
from tests.fakes import LinearCost, ManualClock

A, B = TenantId("a"), TenantId("b")
W0, W1 = WorkerId("w0"), WorkerId("w1")


@dataclass
class Worker:
    id: WorkerId
    healthy: bool = True
    draining: bool = False
    load: Any = None
    client: Any = None


@dataclass
class Box:
    clock: ManualClock
    feed: EventFeed
    service: AdmissionService
    db: Path
    workers: list[Worker]
    queues: dict[WorkerId, float] = field(default_factory=dict)

    def rows(self, sql: str) -> list[tuple[Any, ...]]:
        with closing(sqlite3.connect(self.db)) as conn:
            return conn.execute(sql).fetchall()


def key(tenant: str, client_id: str) -> TaskId:
    return TaskId(f"{tenant}/{client_id}")


@pytest.fixture
def ledger(tmp_path: Path) -> Iterator[Ledger]:
    led = Ledger.open(tmp_path / "ledger.db")
    yield led
    led.close()


def make_box(ledger: Ledger, **limits: Any) -> Box:
    clock, feed = ManualClock(1000.0), EventFeed()
    workers = [Worker(W0), Worker(W1)]
    queues: dict[WorkerId, float] = {}
    idle_s = limits.pop("task_idle_s", 600.0)
    slowdown: dict[WorkerId, float] = limits.pop("slowdown", {})
    service = AdmissionService(
        limits=AdmissionLimits(**{"retry_after_s": 3.0, **limits}),
        estimator=WorkerEstimator(
            lambda: workers,
            lambda w: queues.get(w.id, 0.0),
            LinearCost(),
            lambda w: slowdown.get(w, 1.0),
        ),
        ledger=ledger,
        clock=clock,
        task_idle_s=idle_s,
        events=feed,
    )
    return Box(clock, feed, service, ledger.path, workers, queues)


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def refused(coro: Any) -> AdmissionRefused:
    with pytest.raises(AdmissionRefused) as err:
        run(coro)
    return err.value


def test_a_child_beyond_max_children_is_refused_recorded_and_counted(ledger: Ledger) -> None:
    box = make_box(ledger)
    s = box.service
    run(s.admit_task(A, key("a", "p"), max_children=2))
    for c in ("c1", "c2"):
        run(s.admit_task(A, key("a", c), parent=key("a", "p")))
    err = refused(s.admit_task(A, key("a", "c3"), parent=key("a", "p")))
    assert (err.http_status, err.code, err.retry_after_s) == (429, "children_cap", 3.0)
    assert "task p has 2 open children; its max_children is 2" in err.message
    # The ledger acknowledged the row before the refusal was raised.
    [(tenant, task_id, decision, reason, depth)] = box.rows(
        "SELECT tenant, task_id, decision, reason, queue_depth FROM admission_events"
    )
    assert (tenant, task_id, decision, depth) == ("a", "a/c3", "deny", 0)
    assert reason.startswith("children_cap: task p has 2 open children")
    [event] = box.feed.recent()
    assert (event["kind"], event["subject"], event["tenant"]) == ("rejection", "c3", "a")
    assert event["detail"].startswith("children_cap:")
    snap = s.snapshot()
    assert (snap["accepted"], snap["rejected"], snap["by_reason"]) == (3, 1, {"children_cap": 1})
    assert snap["open_tasks"] == 3


def test_a_closed_child_frees_its_place(ledger: Ledger) -> None:
    s = make_box(ledger).service
    run(s.admit_task(A, key("a", "p"), max_children=1))
    run(s.admit_task(A, key("a", "c1"), parent=key("a", "p")))
    refused(s.admit_task(A, key("a", "c2"), parent=key("a", "p")))
    s.task_closed(key("a", "c1"))
    s.task_closed(key("a", "c1"))  # a second close changes nothing
    run(s.admit_task(A, key("a", "c2"), parent=key("a", "p")))
    refused(s.admit_task(A, key("a", "c3"), parent=key("a", "p")))


def test_the_global_cap_and_depth_apply_to_tasks_opened_by_their_first_turn(
    ledger: Ledger,
) -> None:
    s = make_box(ledger, max_children_per_task=1, max_depth=1).service
    ticket = run(s.admit_turn(A, key("a", "c1"), parent=key("a", "root"), one_turn=True))
    err = refused(s.admit_turn(A, key("a", "c2"), parent=key("a", "root")))
    assert "admission.max_children_per_task is 1" in err.message
    ticket.release()  # a one-turn task closes with its turn
    ticket.release()
    run(s.admit_turn(A, key("a", "c2"), parent=key("a", "root")))
    err = refused(s.admit_task(A, key("a", "grandchild"), parent=key("a", "c2")))
    assert err.code == "depth_cap"


def test_a_known_task_is_not_judged_again(ledger: Ledger) -> None:
    s = make_box(ledger).service
    assert run(s.admit_task(A, key("a", "t"))) is not None
    assert run(s.admit_task(A, key("a", "t"))) is None
    assert s.snapshot()["open_tasks"] == 1


def test_deadline_feasibility_uses_the_healthy_workers_and_the_resident_prefix(
    ledger: Ledger,
) -> None:
    box = make_box(ledger)
    s = box.service
    # 1000 cold tokens take 1 s anywhere: a 0.5 s deadline cannot be met.
    err = refused(s.admit_turn(A, key("a", "t1"), deadline_s=0.5, prompt_tokens=1000))
    assert err.code == "deadline_infeasible"
    assert "prefill 1.000 s" in err.message
    # 900 resident tokens on w1: 100 fresh + 900 reused = 0.19 s.
    ticket = run(
        s.admit_turn(
            A, key("a", "t1"), deadline_s=0.5, prompt_tokens=1000, resident_tokens={W1: 900}
        )
    )
    ticket.release()
    # The same prefix on a draining worker does not count.
    box.workers[1].draining = True
    err = refused(
        s.admit_turn(
            A, key("a", "t2"), deadline_s=0.5, prompt_tokens=1000, resident_tokens={W1: 900}
        )
    )
    assert err.code == "deadline_infeasible"
    # Queue wait adds to the prefill.
    box.workers[1].draining = False
    box.queues.update({W0: 0.4, W1: 0.4})
    err = refused(
        s.admit_turn(
            A, key("a", "t3"), deadline_s=0.5, prompt_tokens=1000, resident_tokens={W1: 900}
        )
    )
    assert "queue 0.400 s + prefill 0.190 s" in err.message
    assert box.rows("SELECT count(*) FROM admission_events") == [(3,)]


def test_deadline_feasibility_takes_each_workers_measured_speed(ledger: Ledger) -> None:
    s = make_box(ledger, slowdown={W1: 4.0}).service
    # 100 fresh + 900 reused on w1 is 0.19 s by the profile, 0.76 s at w1's speed.
    err = refused(
        s.admit_turn(
            A, key("a", "t1"), deadline_s=0.5, prompt_tokens=1000, resident_tokens={W1: 900}
        )
    )
    assert "prefill 0.760 s" in err.message


def test_a_task_deadline_applies_to_its_later_turns(ledger: Ledger) -> None:
    box = make_box(ledger)
    run(box.service.admit_task(A, key("a", "t"), deadline_s=10.0))
    run(box.service.admit_turn(A, key("a", "t"), prompt_tokens=10)).release()
    box.clock.t += 10.5
    err = refused(box.service.admit_turn(A, key("a", "t"), prompt_tokens=10))
    assert err.code == "deadline_passed"


def test_overload_is_503_with_the_queue_excess_as_retry_after(ledger: Ledger) -> None:
    box = make_box(ledger, max_queue_s=30.0, queue_s_per_priority=10.0, priority_ceilings={"b": 1})
    box.queues.update({W0: 45.0, W1: 38.0})
    err = refused(box.service.admit_turn(A, key("a", "t"), prompt_tokens=10))
    assert (err.http_status, err.code, err.retry_after_s) == (503, "overloaded", 8.0)
    # b's ceiling lets priority 1 tolerate 40 s; a's ceiling (0) clips its request.
    run(box.service.admit_turn(B, key("b", "t"), prompt_tokens=10, priority=5)).release()
    assert refused(box.service.admit_turn(A, key("a", "t"), priority=5)).code == "overloaded"


def test_fair_share_of_in_flight_turns(ledger: Ledger) -> None:
    s = make_box(ledger, turns_per_worker=1).service  # two workers: the box holds 2 turns
    a1 = run(s.admit_turn(A, key("a", "t1")))
    a2 = run(s.admit_turn(A, key("a", "t2")))
    a3 = run(s.admit_turn(A, key("a", "t3")))  # alone, a may use everything, and more
    b1 = run(s.admit_turn(B, key("b", "t1")))  # b is under its share of 1
    assert refused(s.admit_turn(B, key("b", "t2"))).code == "tenant_over_share"
    assert refused(s.admit_turn(A, key("a", "t4"))).code == "tenant_over_share"
    for ticket in (a1, a2, a3):
        ticket.release()
    b2 = run(s.admit_turn(B, key("b", "t2")))
    snap = s.snapshot()
    assert snap["in_flight_turns"] == 2
    assert snap["tenants"]["b"]["in_flight_turns"] == 2
    b1.release()
    b2.release()
    assert s.snapshot()["in_flight_turns"] == 0
    assert s.snapshot()["tenants"] == {
        "a": {"in_flight_turns": 0, "open_tasks": 3},
        "b": {"in_flight_turns": 0, "open_tasks": 2},
    }


def test_an_idle_open_task_is_forgotten(ledger: Ledger) -> None:
    box = make_box(ledger, task_idle_s=60.0)
    s = box.service
    run(s.admit_task(A, key("a", "p"), max_children=1))
    run(s.admit_turn(A, key("a", "c1"), parent=key("a", "p")))  # named: stays open
    box.clock.t += 30
    refused(s.admit_task(A, key("a", "c2"), parent=key("a", "p")))
    box.clock.t += 31  # c1 was admitted 61 s ago, its turn is still in flight
    refused(s.admit_task(A, key("a", "c2"), parent=key("a", "p")))
    # p itself had no turn and no new child for 61 s: it no longer counts; c1 still does.
    assert s.snapshot()["open_tasks"] == 1


def test_an_idle_task_without_turns_in_flight_stops_counting(ledger: Ledger) -> None:
    box = make_box(ledger, task_idle_s=60.0)
    s = box.service
    run(s.admit_task(A, key("a", "p"), max_children=1))
    run(s.admit_turn(A, key("a", "c1"), parent=key("a", "p"))).release()
    box.clock.t += 59
    refused(s.admit_task(A, key("a", "c2"), parent=key("a", "p")))
    box.clock.t += 2
    run(s.admit_task(A, key("a", "c2"), parent=key("a", "p")))
    # p and c1 were idle for 61 s and are forgotten (for good); only c2 counts.
    assert s.snapshot()["open_tasks"] == 1


def test_rates_cover_the_last_minute_and_totals_stay(ledger: Ledger) -> None:
    box = make_box(ledger, max_children_per_task=0)
    s = box.service
    for i in range(3):
        run(s.admit_turn(A, key("a", f"t{i}"))).release()
    refused(s.admit_task(A, key("a", "c"), parent=key("a", "t0")))
    snap = s.snapshot()
    assert snap["accept_rate_per_s"] == pytest.approx(3 / 60, abs=1e-6)
    assert snap["reject_rate_per_s"] == pytest.approx(1 / 60, abs=1e-6)
    box.clock.t += 61
    snap = s.snapshot()
    assert (snap["accepted"], snap["rejected"]) == (3, 1)
    assert (snap["accept_rate_per_s"], snap["reject_rate_per_s"]) == (0.0, 0.0)
    samples = {
        (sample.name, tuple(sample.labels.items())): sample.value
        for family in s.metric_families()
        for sample in family.samples
    }
    assert samples[("appliance_admission_accepted_total", ())] == 3
    assert samples[("appliance_admission_rejected_total", (("reason", "children_cap"),))] == 1
    assert samples[("appliance_admission_in_flight_turns", ())] == 0


async def _chunks(n: int, closed: list[bool] | None = None) -> AsyncGenerator[bytes, None]:
    try:
        for i in range(n):
            yield f"data: {i}\n\n".encode()
    finally:
        if closed is not None:
            closed.append(True)


async def _broken() -> AsyncGenerator[bytes, None]:
    yield b"data: 0\n\n"
    raise ConnectionError("the worker broke off")


def test_a_stream_releases_its_turn_however_it_ends(ledger: Ledger) -> None:
    """Relayed to its end, broken off by the worker, or left by the client (sending raises):
    the turn is released once and the worker's stream is closed."""
    s = make_box(ledger).service

    async def relay(chunks: AsyncGenerator[bytes, None], send: Any) -> None:
        ticket = await s.admit_turn(A, key("a", "t"))
        assert s.snapshot()["in_flight_turns"] == 1
        await RelayedStream(chunks, {"X-Task-ID": "t"}, on_end=ticket.release)({}, None, send)

    async def scenario() -> None:
        sent: list[dict[str, Any]] = []

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        closed: list[bool] = []
        await relay(_chunks(3, closed), send)
        assert (b"x-task-id", b"t") in sent[0]["headers"]
        assert [m["body"] for m in sent[1:]] == [
            b"data: 0\n\n",
            b"data: 1\n\n",
            b"data: 2\n\n",
            b"",
        ]
        assert sent[-1]["more_body"] is False
        assert closed == [True] and s.snapshot()["in_flight_turns"] == 0

        with pytest.raises(ConnectionError):
            await relay(_broken(), send)
        assert s.snapshot()["in_flight_turns"] == 0

        async def hung_up(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.body":
                raise ConnectionResetError("the client disconnected")

        closed.clear()
        with pytest.raises(ConnectionResetError):
            await relay(_chunks(10, closed), hung_up)
        assert closed == [True] and s.snapshot()["in_flight_turns"] == 0

        async def gone(message: dict[str, Any]) -> None:
            raise ConnectionResetError("the client left before the answer began")

        closed.clear()
        with pytest.raises(ConnectionResetError):
            await relay(_chunks(10, closed), gone)
        assert closed == [True] and s.snapshot()["in_flight_turns"] == 0

    run(scenario())


def test_resident_hint_is_the_previous_prompt_where_it_ran() -> None:
    session = SessionState(A, SessionId("s"), 0.0, home=W0, resident_tokens={W1: 64})
    session.chain = BlockHashChain(32, tuple(b"x" * 32 for _ in range(10)), ())
    assert resident_hint(session, 500) == {W0: 320, W1: 64}
    # A 100-token prompt can reuse three whole blocks of 32, never its last token.
    assert resident_hint(session, 100) == {W0: 96, W1: 64}
    assert resident_hint(None, 500) == {}


@settings(max_examples=60, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    st.lists(
        st.tuples(st.sampled_from(["task", "turn", "close", "release"]), st.integers(0, 9)),
        max_size=80,
    ),
    st.lists(st.one_of(st.none(), st.integers(0, 3)), min_size=10, max_size=10),
)
def test_the_counters_never_let_a_cap_be_exceeded(
    ledger: Ledger, steps: list[tuple[str, int]], caps: list[int | None]
) -> None:
    """Random task creations, first turns, closes and releases: a model of open children
    per parent (from what the service admitted) never exceeds the parent's cap, and the
    in-flight count returns to zero."""
    s = make_box(ledger, max_children_per_task=2, max_depth=3, turns_per_worker=1000).service
    parent_of: dict[str, str | None] = {}
    open_children: dict[str, set[str]] = {}
    caps_of: dict[str, int | None] = {}
    tickets: list[TurnTicket] = []
    n = 0
    for action, i in steps:
        names = sorted(parent_of)
        target = names[i % len(names)] if names else None
        if action in ("task", "turn"):
            n += 1
            name = f"t{n}"
            cap = caps[i]
            try:
                if action == "task":
                    run(s.admit_task(A, key("a", name), parent=_k(target), max_children=cap))
                else:
                    tickets.append(run(s.admit_turn(A, key("a", name), parent=_k(target))))
            except AdmissionRefused:
                continue
            parent_of[name] = target
            open_children[name] = set()
            if target is not None:
                open_children[target].add(name)
                limit = min(2, c) if (c := caps_of.get(target)) is not None else 2
                assert len(open_children[target]) <= limit
            caps_of[name] = cap if action == "task" else None
        elif action == "close" and target is not None:
            s.task_closed(key("a", target))
            above = parent_of[target]
            if above is not None:
                open_children[above].discard(target)
        elif action == "release" and tickets:
            tickets.pop(i % len(tickets)).release()
    for ticket in tickets:
        ticket.release()
    assert s.snapshot()["in_flight_turns"] == 0


def _k(name: str | None) -> TaskId | None:
    return key("a", name) if name is not None else None
