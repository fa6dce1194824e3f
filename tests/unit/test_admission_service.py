"""The admission service over the task book, as the task routes and the turn desk drive
them (admission judges, the book opens the task and starts the turn): the counts, the
ledger rows (the real writer on a temporary file), the operator feed, the state snapshot
and the end of streamed turns."""

from __future__ import annotations

import asyncio
import logging
import sqlite3
from collections.abc import AsyncGenerator, Callable, Iterator
from concurrent.futures import Future
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from appliance.api.turns.model_route import RelayedStream
from appliance.domain.block_hash import BlockHashChain
from appliance.domain.records import (
    OpenTask,
    SessionId,
    TaskEventType,
    TaskId,
    TenantId,
    TurnId,
    TurnOutcome,
    TurnRecord,
    WorkerId,
)
from appliance.ledger import LedgerWriter
from appliance.policy.admission import AdmissionLimits, AdmitDecision
from appliance.services.operator.events import EventFeed
from appliance.services.sessions.sessions import SessionState
from appliance.services.tasks.admission import (
    AdmissionRefused,
    AdmissionService,
    WorkerEstimator,
    resident_hint,
)
from appliance.services.tasks.task_state import TaskError, TaskTurnBegan, TaskTurnEnded
from appliance.services.tasks.tasks import TaskBook
from tests.fakes import AckLedger, LinearCost, ManualClock

A, B = TenantId("a"), TenantId("b")
W0, W1 = WorkerId("w0"), WorkerId("w1")


@dataclass
class Worker:
    id: WorkerId
    healthy: bool = True
    draining: bool = False
    load: Any = None
    client: Any = None


End = Callable[[], None]
"""Ends a turn, as the turn desk does when its answer or stream has ended."""


@dataclass
class Box:
    clock: ManualClock
    feed: EventFeed
    service: AdmissionService
    book: TaskBook
    db: Path
    workers: list[Worker]
    queues: dict[WorkerId, float] = field(default_factory=dict)

    def rows(self, sql: str) -> list[tuple[Any, ...]]:
        with closing(sqlite3.connect(self.db)) as conn:
            return conn.execute(sql).fetchall()

    async def task(
        self,
        tenant: TenantId,
        name: str,
        *,
        parent: str | None = None,
        max_children: int | None = None,
        deadline_s: float | None = None,
    ) -> AdmitDecision | None:
        """As POST /v1/tasks: admission judges the task, then the book opens it."""
        decision = await self.service.admit_task(
            tenant, key(tenant, name), parent=_k(tenant, parent), deadline_s=deadline_s
        )
        if decision is not None:
            self.book.create(
                tenant,
                name,
                self.clock.now(),
                parent_id=parent,
                deadline_s=deadline_s,
                max_children=max_children,
            )
        return decision

    async def turn(
        self,
        tenant: TenantId,
        name: str,
        *,
        parent: str | None = None,
        one_turn: bool = False,
        deadline_s: float | None = None,
        **judged: Any,
    ) -> End:
        """As the turn desk: admission judges the turn, then the book opens its task (on its
        first turn) and starts the turn."""
        await self.service.admit_turn(
            tenant, key(tenant, name), parent=_k(tenant, parent), deadline_s=deadline_s, **judged
        )
        state = self.book.ensure(
            tenant,
            name,
            self.clock.now(),
            parent_id=parent,
            deadline_s=deadline_s,
            one_turn=one_turn,
        )
        self.book.turn_began(TaskTurnBegan(state, self.clock.now()))
        return lambda: self.book.turn_ended(TaskTurnEnded(state, self.clock.now()))

    def close(self, tenant: TenantId, name: str) -> None:
        """The task's terminal event."""
        self.book.event(tenant, name, TaskEventType.SUCCEEDED, self.clock.now())


def key(tenant: str, client_id: str) -> TaskId:
    return TaskId(f"{tenant}/{client_id}")


def _k(tenant: str, name: str | None) -> TaskId | None:
    return key(tenant, name) if name is not None else None


@pytest.fixture
def ledger(tmp_path: Path) -> Iterator[LedgerWriter]:
    led = LedgerWriter.open(tmp_path / "ledger.db")
    yield led
    led.close()


def make_box(ledger: LedgerWriter, **limits: Any) -> Box:
    clock, feed = ManualClock(1000.0), EventFeed()
    workers = [Worker(W0), Worker(W1)]
    queues: dict[WorkerId, float] = {}
    idle_s = limits.pop("task_idle_s", 600.0)
    slowdown: dict[WorkerId, float] = limits.pop("slowdown", {})
    book = TaskBook(AckLedger(), idle_s=idle_s)
    service = AdmissionService(
        limits=AdmissionLimits(**{"retry_after_s": 3.0, **limits}),
        tasks=book,
        estimator=WorkerEstimator(
            lambda: workers,
            lambda w: queues.get(w.id, 0.0),
            LinearCost(),
            lambda w: slowdown.get(w, 1.0),
        ),
        ledger=ledger,
        clock=clock,
        events=feed,
    )
    return Box(clock, feed, service, book, ledger.path, workers, queues)


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def refused(coro: Any) -> AdmissionRefused:
    with pytest.raises(AdmissionRefused) as err:
        run(coro)
    return err.value


def test_a_child_beyond_max_children_is_refused_recorded_and_counted(ledger: LedgerWriter) -> None:
    box = make_box(ledger)
    s = box.service
    run(box.task(A, "p", max_children=2))
    for c in ("c1", "c2"):
        run(box.task(A, c, parent="p"))
    err = refused(box.task(A, "c3", parent="p"))
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


def test_a_closed_child_frees_its_place(ledger: LedgerWriter) -> None:
    box = make_box(ledger)
    run(box.task(A, "p", max_children=1))
    run(box.task(A, "c1", parent="p"))
    refused(box.task(A, "c2", parent="p"))
    box.close(A, "c1")
    box.close(A, "c1")  # a retried close changes nothing
    run(box.task(A, "c2", parent="p"))
    refused(box.task(A, "c3", parent="p"))


def test_the_global_cap_and_depth_apply_to_tasks_opened_by_their_first_turn(
    ledger: LedgerWriter,
) -> None:
    box = make_box(ledger, max_children_per_task=1, max_depth=1)
    end = run(box.turn(A, "c1", parent="root", one_turn=True))
    err = refused(box.turn(A, "c2", parent="root"))
    assert "admission.max_children_per_task is 1" in err.message
    end()  # a one-turn task closes with its turn
    run(box.turn(A, "c2", parent="root"))
    err = refused(box.task(A, "grandchild", parent="c2"))
    assert err.code == "depth_cap"


def test_a_known_task_is_not_judged_again(ledger: LedgerWriter) -> None:
    box = make_box(ledger)
    assert run(box.task(A, "t")) is not None
    assert run(box.task(A, "t")) is None
    assert box.service.snapshot()["open_tasks"] == 1


def test_deadline_feasibility_uses_the_healthy_workers_and_the_resident_prefix(
    ledger: LedgerWriter,
) -> None:
    box = make_box(ledger)
    # 1000 cold tokens take 1 s anywhere: a 0.5 s deadline cannot be met.
    err = refused(box.turn(A, "t1", deadline_s=0.5, prompt_tokens=1000))
    assert err.code == "deadline_infeasible"
    assert "prefill 1.000 s" in err.message
    # 900 resident tokens on w1: 100 fresh + 900 reused = 0.19 s.
    run(box.turn(A, "t1", deadline_s=0.5, prompt_tokens=1000, resident_tokens={W1: 900}))()
    # The same prefix on a draining worker does not count.
    box.workers[1].draining = True
    err = refused(box.turn(A, "t2", deadline_s=0.5, prompt_tokens=1000, resident_tokens={W1: 900}))
    assert err.code == "deadline_infeasible"
    # Queue wait adds to the prefill.
    box.workers[1].draining = False
    box.queues.update({W0: 0.4, W1: 0.4})
    err = refused(box.turn(A, "t3", deadline_s=0.5, prompt_tokens=1000, resident_tokens={W1: 900}))
    assert "queue 0.400 s + prefill 0.190 s" in err.message
    assert box.rows("SELECT count(*) FROM admission_events") == [(3,)]


def test_deadline_feasibility_takes_each_workers_measured_speed(ledger: LedgerWriter) -> None:
    box = make_box(ledger, slowdown={W1: 4.0})
    # 100 fresh + 900 reused on w1 is 0.19 s by the profile, 0.76 s at w1's speed.
    err = refused(box.turn(A, "t1", deadline_s=0.5, prompt_tokens=1000, resident_tokens={W1: 900}))
    assert "prefill 0.760 s" in err.message


def test_a_task_deadline_applies_to_its_later_turns(ledger: LedgerWriter) -> None:
    box = make_box(ledger)
    run(box.task(A, "t", deadline_s=10.0))
    run(box.turn(A, "t", prompt_tokens=10))()
    box.clock.t += 10.5
    err = refused(box.turn(A, "t", prompt_tokens=10))
    assert err.code == "deadline_passed"


def test_a_child_inherits_its_parents_deadline(ledger: LedgerWriter) -> None:
    # The seed failure mode "deadline-blind admission": a parent due in 2 s; its child
    # names no deadline of its own, and its first turn (1000 cold tokens: 1 s) waits behind
    # 1.5 s of queue everywhere: it cannot finish by the parent's deadline.
    box = make_box(ledger)
    run(box.task(A, "p", deadline_s=2.0))
    run(box.task(A, "c", parent="p"))
    assert box.book.get(A, "c").deadline_at == box.clock.now() + 2.0
    box.queues.update({W0: 1.5, W1: 1.5})
    err = refused(box.turn(A, "c", prompt_tokens=1000))
    assert err.code == "deadline_infeasible"
    # A grandchild opened by its first turn is judged by the same deadline.
    err = refused(box.turn(A, "g", parent="c", prompt_tokens=1000))
    assert err.code == "deadline_infeasible"
    box.queues.clear()
    run(box.turn(A, "c", prompt_tokens=1000))()
    box.clock.t += 2.5
    assert refused(box.task(A, "late", parent="p")).code == "deadline_passed"


def priced_turn(box: Box, tenant: TenantId, name: str, cost: float) -> None:
    """One attempt of the task, priced by the ledger at `cost`."""
    done: Future[float | None] = Future()
    turn = TurnRecord(
        TurnId(f"{name}-{cost}"),
        tenant,
        key(tenant, name),
        None,
        W0,
        "m",
        10,
        0,
        1,
        TurnOutcome.OK,
        0.0,
        0.0,
    )
    box.book.add_turn(turn, done)
    done.set_result(cost)


def test_a_budget_covers_the_subtrees_spending(ledger: LedgerWriter) -> None:
    box = make_box(ledger)
    run(box.task(A, "root"))
    box.book.get(A, "root").budget = 1.0
    run(box.task(A, "child", parent="root"))
    run(box.task(A, "other"))
    priced_turn(box, A, "root", 0.4)
    priced_turn(box, A, "child", 0.5)
    assert box.book.budget_left(key(A, "child")) == pytest.approx(0.1)
    run(box.turn(A, "child", prompt_tokens=10))()  # 0.1 left: admitted
    priced_turn(box, A, "child", 0.1)
    for name, parent in (("child", None), ("root", None), ("new", "root")):
        err = refused(box.turn(A, name, parent=parent, prompt_tokens=10))
        assert (err.http_status, err.code) == (429, "budget_exhausted")
    assert refused(box.task(A, "late-child", parent="child")).code == "budget_exhausted"
    run(box.turn(A, "other", prompt_tokens=10))()  # another tree is not charged
    assert box.book.budget_left(key(A, "other")) is None
    sql = "SELECT count(*) FROM admission_events WHERE reason LIKE 'budget_exhausted:%'"
    refusals = box.rows(sql)
    assert refusals == [(4,)]


def test_overload_is_503_with_the_queue_excess_as_retry_after(ledger: LedgerWriter) -> None:
    box = make_box(ledger, max_queue_s=30.0, queue_s_per_priority=10.0, priority_ceilings={"b": 1})
    box.queues.update({W0: 45.0, W1: 38.0})
    err = refused(box.turn(A, "t", prompt_tokens=10))
    assert (err.http_status, err.code, err.retry_after_s) == (503, "overloaded", 8.0)
    # b's ceiling lets priority 1 tolerate 40 s; a's ceiling (0) clips its request.
    run(box.turn(B, "t", prompt_tokens=10, priority=5))()
    assert refused(box.turn(A, "t", priority=5)).code == "overloaded"


def test_fair_share_of_in_flight_turns(ledger: LedgerWriter) -> None:
    box = make_box(ledger, turns_per_worker=1)  # two workers: the box holds 2 turns
    s = box.service
    a1 = run(box.turn(A, "t1"))
    a2 = run(box.turn(A, "t2"))
    a3 = run(box.turn(A, "t3"))  # alone, a may use everything, and more
    b1 = run(box.turn(B, "t1"))  # b is under its share of 1
    assert refused(box.turn(B, "t2")).code == "tenant_over_share"
    assert refused(box.turn(A, "t4")).code == "tenant_over_share"
    for end in (a1, a2, a3):
        end()
    b2 = run(box.turn(B, "t2"))
    snap = s.snapshot()
    assert snap["in_flight_turns"] == 2
    assert snap["tenants"]["b"]["in_flight_turns"] == 2
    b1()
    b2()
    assert s.snapshot()["in_flight_turns"] == 0
    assert s.snapshot()["tenants"] == {
        "a": {"in_flight_turns": 0, "open_tasks": 3},
        "b": {"in_flight_turns": 0, "open_tasks": 2},
    }


def test_an_idle_open_task_is_forgotten(ledger: LedgerWriter) -> None:
    box = make_box(ledger, task_idle_s=60.0)
    run(box.task(A, "p", max_children=1))
    run(box.turn(A, "c1", parent="p"))  # named: stays open
    box.clock.t += 30
    refused(box.task(A, "c2", parent="p"))
    box.clock.t += 31  # c1 was admitted 61 s ago, its turn is still in flight
    refused(box.task(A, "c2", parent="p"))
    # p itself had no turn and no new child for 61 s: it no longer counts; c1 still does.
    assert box.service.snapshot()["open_tasks"] == 1


def test_an_idle_task_without_turns_in_flight_stops_counting(ledger: LedgerWriter) -> None:
    box = make_box(ledger, task_idle_s=60.0)
    run(box.task(A, "p", max_children=1))
    run(box.turn(A, "c1", parent="p"))()
    box.clock.t += 59
    refused(box.task(A, "c2", parent="p"))
    box.clock.t += 2
    run(box.task(A, "c2", parent="p"))
    # p and c1 were idle for 61 s and are forgotten (for good); only c2 counts.
    assert box.service.snapshot()["open_tasks"] == 1


def test_tasks_taken_back_after_a_restart_count_again_once_a_turn_names_them(
    ledger: LedgerWriter,
) -> None:
    box = make_box(ledger, max_children_per_task=1)
    box.book.restore(
        [
            OpenTask("a/p", "a", None, None, 990.0, None, 0, 0, 0, 0, 0.0),
            OpenTask("a/c", "a", "a/p", None, 991.0, None, 2, 0, 0, 0, 0.0),
            OpenTask("a/other", "a", None, None, 992.0, None, 0, 0, 0, 0, 0.0),
        ]
    )
    assert box.service.snapshot()["open_tasks"] == 0
    end = run(box.turn(A, "c"))  # judged as opening c, under its own parent
    snap = box.service.snapshot()
    assert (snap["open_tasks"], snap["in_flight_turns"]) == (2, 1)  # c and p, not other
    assert refused(box.task(A, "c2", parent="p")).code == "children_cap"
    end()
    run(box.turn(A, "c"))()  # named again: a turn of an open task
    assert box.service.snapshot()["accepted"] == 2


def test_a_task_the_ledger_refused_to_create_counts_no_more(ledger: LedgerWriter) -> None:
    box = make_box(ledger)
    run(box.task(A, "p", max_children=1))
    run(box.task(A, "c1", parent="p"))
    child = box.book.get(A, "c1")
    assert child is not None
    box.book.drop(child)
    assert box.service.snapshot()["open_tasks"] == 1
    run(box.task(A, "c1", parent="p"))  # judged afresh: p has room for it again


def test_rates_cover_the_last_minute_and_totals_stay(ledger: LedgerWriter) -> None:
    box = make_box(ledger, max_children_per_task=0)
    s = box.service
    for i in range(3):
        run(box.turn(A, f"t{i}"))()
    refused(box.task(A, "c", parent="t0"))
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


def test_a_stream_releases_its_turn_however_it_ends(ledger: LedgerWriter) -> None:
    """Relayed to its end, broken off by the worker, or left by the client (sending raises):
    the turn is released once and the worker's stream is closed."""
    box = make_box(ledger)
    s = box.service

    async def relay(chunks: AsyncGenerator[bytes, None], send: Any) -> None:
        end = await box.turn(A, "t")
        assert s.snapshot()["in_flight_turns"] == 1
        await RelayedStream(chunks, {"X-Task-ID": "t"}, on_end=end)({}, None, send)

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
    ledger: LedgerWriter, steps: list[tuple[str, int]], caps: list[int | None]
) -> None:
    """Random task creations, first turns, closes and releases: a model of open children
    per parent (from what the service admitted) never exceeds the parent's cap, a closed
    task takes no new child, and the in-flight count returns to zero."""
    box = make_box(ledger, max_children_per_task=2, max_depth=3, turns_per_worker=1000)
    parent_of: dict[str, str | None] = {}
    open_children: dict[str, set[str]] = {}
    caps_of: dict[str, int | None] = {}
    ends: list[End] = []
    closed: set[str] = set()
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
                    run(box.task(A, name, parent=target, max_children=cap))
                else:
                    ends.append(run(box.turn(A, name, parent=target)))
            except AdmissionRefused:
                continue
            except TaskError as err:
                assert (err.code, target in closed) == ("task_closed", True)
                continue
            assert target not in closed
            parent_of[name] = target
            open_children[name] = set()
            if target is not None:
                open_children[target].add(name)
                limit = min(2, c) if (c := caps_of.get(target)) is not None else 2
                assert len(open_children[target]) <= limit
            caps_of[name] = cap if action == "task" else None
        elif action == "close" and target is not None:
            box.close(A, target)
            closed.add(target)
            above = parent_of[target]
            if above is not None:
                open_children[above].discard(target)
        elif action == "release" and ends:
            ends.pop(i % len(ends))()
    for end in ends:
        end()
    assert box.service.snapshot()["in_flight_turns"] == 0


def test_decisions_are_logged_admissions_at_debug_refusals_at_info(
    ledger: LedgerWriter, caplog: pytest.LogCaptureFixture
) -> None:
    box = make_box(ledger)
    with caplog.at_level(logging.DEBUG, logger="appliance.services.tasks.admission"):
        run(box.task(A, "p", max_children=1))
        run(box.task(A, "c1", parent="p"))
        refused(box.task(A, "c2", parent="p"))
    lines = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert (logging.DEBUG, "admission admitted a/c1 of tenant a") in lines
    assert any(level == logging.INFO and "refused a/c2" in text for level, text in lines)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="appliance.services.tasks.admission"):
        run(box.task(A, "q"))
    assert caplog.records == []
