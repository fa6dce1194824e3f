"""The idle reaper's live loop over a fake retention port (it records every directive), a KV
index the test sets, a ledger that keeps its rows and a clock the test moves: what it
decides at a turn's end, what it sends, what it records, and what it does as holds come
due, workers give holds back, prefixes are evicted, tasks close and operators release."""

from __future__ import annotations

import asyncio
import json
import logging
import math
from collections.abc import AsyncIterator, Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from types import SimpleNamespace
from typing import Any

import pytest

from appliance.domain.block_hash import BlockHasher, HashAlgo
from appliance.domain.records import (
    CacheEviction,
    ResidencyEvent,
    SessionId,
    TaskEventType,
    TaskId,
    TenantId,
    WorkerId,
)
from appliance.domain.retention import HostTierSize, RetainedKv, ReturnedKv
from appliance.domain.worker import LoadSnapshot
from appliance.policy.reaper import Reaper
from appliance.policy.residency import ResidencyPolicy
from appliance.policy.survival import WaitKey, WaitSurvival
from appliance.policy.wait_curves import LogNormal
from appliance.services.operator.events import EventFeed
from appliance.services.operator.session_admin import SessionReleases
from appliance.services.residency.no_retention import NoRetention
from appliance.services.residency.reaper_loop import HOLD_GRACE_S, ReaperLoop
from appliance.services.residency.reaper_runner import run_reaper
from appliance.services.residency.residency_inputs import LiveInputs
from appliance.services.residency.tool_events import reaper_hears
from appliance.services.sessions.answer_tools import TO_PERSON, AnswerEnd
from appliance.services.sessions.sessions import SessionState, SessionTable
from tests.fakes import FixedIndex, ManualClock, RouterWorker

W0, W1 = WorkerId("w0"), WorkerId("w1")
BLOCK = 16
PROMPT = 160  # 10 full blocks
PRIORS = {
    "api": LogNormal.from_median_p95(0.5, 2.0),
    "approval": LogNormal.from_median_p95(600, 7200),
}


@dataclass
class FakeRetention:
    """Records every directive; `held` and `usage` are what the workers' reports say."""

    controls: bool = True
    calls: list[tuple[Any, ...]] = field(default_factory=list)
    held: dict[WorkerId, dict[str, RetainedKv]] = field(default_factory=dict)
    usage: dict[WorkerId, float] = field(default_factory=dict)
    host: dict[WorkerId, HostTierSize] = field(default_factory=dict)
    returns: asyncio.Queue[ReturnedKv] | None = None

    async def hold(self, worker: WorkerId, key: str, until_s: float, priority: float) -> bool:
        self.calls.append(("hold", worker, key, until_s, priority))
        return True

    async def release(self, worker: WorkerId, key: str) -> bool:
        self.calls.append(("release", worker, key))
        return True

    async def evict_first(
        self, worker: WorkerId, key: str, keep_blocks: int = 0, drop_host: bool = False
    ) -> bool:
        if keep_blocks or drop_host:
            self.calls.append(("evict_first", worker, key, keep_blocks, drop_host))
        else:
            self.calls.append(("evict_first", worker, key))
        return True

    async def demote(self, worker: WorkerId, key: str) -> bool:
        self.calls.append(("demote", worker, key))
        return True

    async def restore(self, worker: WorkerId, key: str, until_s: float, priority: float) -> bool:
        self.calls.append(("restore", worker, key, until_s, priority))
        return True

    async def order(self, worker: WorkerId, priorities: Mapping[str, float]) -> bool:
        self.calls.append(("order", worker, dict(priorities)))
        return True

    def host_tier(self, worker: WorkerId) -> HostTierSize | None:
        return self.host.get(worker)

    def retained(self, worker: WorkerId) -> Mapping[str, RetainedKv]:
        return self.held.get(worker, {})

    def kv_usage(self, worker: WorkerId) -> float | None:
        return self.usage.get(worker)

    async def returned(self) -> AsyncIterator[ReturnedKv]:
        assert self.returns is not None
        while True:
            yield await self.returns.get()

    def kinds(self) -> list[str]:
        return [c[0] for c in self.calls]


@dataclass
class Rows:
    residency: list[ResidencyEvent] = field(default_factory=list)
    evictions: list[CacheEviction] = field(default_factory=list)

    def record_residency_event(self, event: ResidencyEvent) -> Future[None]:
        self.residency.append(event)
        return _done()

    def record_cache_eviction(self, eviction: CacheEviction) -> Future[None]:
        self.evictions.append(eviction)
        return _done()

    def __getattr__(self, name: str) -> Any:
        return lambda *_: _done()

    def last(self) -> ResidencyEvent:
        return self.residency[-1]

    def figures(self, i: int = -1) -> dict[str, Any]:
        raw = self.residency[i].figures_json
        assert raw is not None
        return dict(json.loads(raw))


def _done() -> Future[None]:
    f: Future[None] = Future()
    f.set_result(None)
    return f


@dataclass
class Setup:
    loop: ReaperLoop
    table: SessionTable
    retention: FakeRetention
    rows: Rows
    index: FixedIndex
    clock: ManualClock
    closed: set[str]
    workers: list[RouterWorker]

    def session(
        self,
        sid: str,
        *,
        tool: str | None = None,
        wait_s: float | None = None,
        task: str | None = None,
        worker: WorkerId = W0,
    ) -> SessionState:
        s = self.table.open(TenantId("acme"), SessionId(sid), self.clock.t)
        self.table.hash_prompt(s, list(range(100, 100 + PROMPT)), "salt")
        s.home, s.tool_class, s.expected_wait_s = worker, tool, wait_s
        s.task_id = TaskId(task) if task else None
        return s

    def turn(
        self,
        s: SessionState,
        *,
        tool: str | None = None,
        wait_s: float | None = None,
        worker: WorkerId = W0,
        said: AnswerEnd | None = None,
    ) -> None:
        """One turn of the session, ending now (`said`: how its answer ended)."""
        self.table.began(s, self.clock.t)
        s.home, s.tool_class, s.expected_wait_s = worker, tool, wait_s
        s.said = said
        self.table.ended(s, self.clock.t)

    def sent(self) -> list[tuple[Any, ...]]:
        asyncio.run(self.loop.outbox.flush())
        calls, self.retention.calls = self.retention.calls, []
        return calls


def _at_once(call: Callable[[], None]) -> None:
    call()


def build(
    *,
    retention: Any = None,
    usage: float = 0.1,
    defer: Callable[..., None] | None = _at_once,
    policy: ResidencyPolicy | None = None,
    copy_in_s: Callable[[int], float] = lambda tokens: tokens * 1024 / 50e9,  # 50 GB/s
    lead_time: Callable[[ReaperLoop], Any] | None = None,
) -> Setup:
    clock = ManualClock(1000.0)
    fake = FakeRetention()
    index = FixedIndex({W0: PROMPT // BLOCK})
    closed: set[str] = set()
    load = LoadSnapshot(time=0.0, running=0, waiting=0, kv_cache_usage_perc=usage)
    workers = [RouterWorker(W0, None, load=load), RouterWorker(W1, None, load=load)]
    inputs = LiveInputs(
        index=index,
        workers=lambda: workers,
        prefill_s=lambda worker, n: n * 1e-3,
        task_closed=lambda key: key in closed,
        kv_bytes_per_token=1024,
        model="m",
        runtime_identity="test:m",
        copy_in_s=copy_in_s,
    )
    loop = ReaperLoop(
        policy if policy is not None else Reaper(priors=PRIORS),
        retention or fake,
        inputs,
        ledger=Rows(),
        clock=clock,  # type: ignore[arg-type]
        defer=defer,
        lead_time=lead_time,
    )
    rows = loop._ledger  # the Rows given above
    table = SessionTable(BlockHasher(HashAlgo.SHA256_CBOR, BLOCK), subscribers=(loop,))
    return Setup(loop, table, fake, rows, index, clock, closed, workers)  # type: ignore[arg-type]


@pytest.fixture
def s() -> Setup:
    return build()


def test_a_short_expected_wait_is_held_until_its_revisit(s: Setup) -> None:
    session = s.session("a")
    s.turn(session, tool="api", wait_s=1.0)
    [(kind, worker, key, until_s, priority)] = s.sent()
    assert (kind, worker, key) == ("hold", W0, "acme/a")
    row = s.rows.last()
    assert (row.action, row.session_id, row.worker, row.tokens) == ("hold", "acme/a", W0, PROMPT)
    figures = s.rows.figures()
    assert figures["kind"] == "pool_free" and figures["until_s"] == pytest.approx(1001.0)
    assert until_s == figures["until_s"] + HOLD_GRACE_S  # outlives its revisit
    assert priority > 0 and figures["priority"] == priority
    assert "P " in row.reason and row.reason.startswith("pool_free: hold")
    assert s.loop.decision_of(session).action == "hold"  # type: ignore[union-attr]


def test_each_decision_is_logged_at_debug(s: Setup, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG, logger="appliance.services.residency.reaper_loop"):
        s.turn(s.session("a"), tool="api", wait_s=1.0)
    [record] = caplog.records
    assert record.levelno == logging.DEBUG
    assert record.getMessage().startswith("idle reaper: hold acme/a on w0: hold: HBM has room")


def test_under_pressure_an_approval_wait_is_released_and_an_api_wait_held() -> None:
    s = build(usage=0.9)
    s.turn(s.session("slow"), tool="approval", wait_s=3600.0)
    s.turn(s.session("fast"), tool="api", wait_s=1.0)
    sent = s.sent()
    assert [(c[0], c[2]) for c in sent] == [("hold", "acme/fast")]  # nothing held: no release
    slow, fast = s.rows.residency
    assert (slow.action, s.rows.figures(0)["kind"]) == ("release", "release_cheapest")
    assert (fast.action, s.rows.figures(1)["kind"]) == ("hold", "hold_cheapest")
    assert s.rows.figures(0)["kv_usage"] == 0.9  # the worker's reading, no report yet


def test_the_connectors_report_is_the_pressure_when_there_is_one() -> None:
    s = build(usage=0.1)
    s.retention.usage[W0] = 0.95
    s.turn(s.session("slow"), tool="approval", wait_s=3600.0)
    assert s.rows.last().action == "release" and s.rows.figures()["kv_usage"] == 0.95


def test_a_last_step_is_evicted(s: Setup) -> None:
    session = s.session("a")
    s.turn(session, tool="api", wait_s=1.0)
    s.sent()
    s.clock.t += 0.5
    s.turn(session)  # its client named tools before: no tool now is its last step
    assert s.sent() == [("evict_first", W0, "acme/a")]
    assert (s.rows.last().action, s.rows.figures()["kind"]) == ("evict", "last_step")


def test_a_client_that_never_names_tools_is_not_taken_for_a_last_step(s: Setup) -> None:
    s.turn(s.session("a"))
    assert s.rows.figures()["kind"] != "last_step"


GREP = AnswerEnd(True, ("grep",))


def test_a_turn_whose_answer_called_a_tool_waits_on_that_tool(s: Setup) -> None:
    session = s.session("a")  # its client sends no agent header
    s.turn(session, said=GREP)
    row, figures = s.rows.last(), s.rows.figures()
    assert figures["kind"] == "pool_free" and row.action == "hold"
    assert row.reason.endswith("; waits on tool grep (its answer called grep)")
    assert (figures["tool_class"], figures["answer_tools"]) == ("grep", "grep")
    assert (figures["wait_from"], figures["header_tool_class"]) == ("answer", None)
    s.clock.t += 2.0
    s.table.began(session, s.clock.t)  # back: the gap is learned under the tool's name
    survival = s.loop.policy.survival
    assert isinstance(survival, WaitSurvival)
    assert WaitKey("acme", "grep") in survival and WaitKey("acme", "grep", 1) in survival


def test_an_answer_that_called_no_tool_waits_on_the_person_not_a_last_step(s: Setup) -> None:
    s.turn(s.session("a"), said=TO_PERSON)
    row, figures = s.rows.last(), s.rows.figures()
    assert figures["kind"] == "pool_free" and figures["tool_class"] == "person"
    assert row.reason.endswith("; waits on the person (its answer called no tool)")


def test_the_headers_win_for_their_turn_and_the_ledger_keeps_both(s: Setup) -> None:
    s.turn(s.session("a"), tool="api", wait_s=1.0, said=GREP)
    row, figures = s.rows.last(), s.rows.figures()
    assert (figures["tool_class"], figures["header_wait_s"]) == ("api", 1.0)
    assert (figures["header_tool_class"], figures["answer_tools"]) == ("api", "grep")
    assert figures["wait_from"] == "header"
    assert row.reason.endswith(
        "; waits on api (X-Tool-Class, expected 1 s; its answer called grep)"
    )
    s.turn(s.session("b"), wait_s=5.0, said=GREP)  # a wait, no class: the answer's class
    assert s.rows.figures()["tool_class"] == "grep"


def test_a_tool_started_event_decides_the_tasks_waiting_session_again_on_its_tool() -> None:
    s = build(usage=0.9)
    session = s.session("quick", task="acme/t1")
    other = s.session("other", task="acme/t2")
    s.turn(session, said=GREP)
    s.turn(other, said=GREP)
    assert [r.action for r in s.rows.residency] == ["release", "release"]  # unknown, HBM full
    s.clock.t += 0.1
    hook = reaper_hears(s.loop)
    hook(TaskId("acme/t1"), TaskEventType.TOOL_STARTED, "api", 1.0, s.clock.t)
    [row] = s.rows.residency[2:]  # only the task's session is decided again
    figures = s.rows.figures()
    assert (row.session_id, row.action) == ("acme/quick", "hold")  # a quick tool: kept
    assert (figures["tool_class"], figures["header_wait_s"]) == ("api", 1.0)
    assert (figures["wait_from"], figures["answer_tools"]) == ("event", "grep")
    assert row.reason.endswith(
        "; waits on api (its task's tool_started event, expected 1 s; its answer called grep)"
    )
    assert [(c[0], c[2]) for c in s.sent()] == [("hold", "acme/quick")]
    s.clock.t += 0.5
    s.table.began(session, s.clock.t)  # back: the gap is learned under the event's tool
    survival = s.loop.policy.survival
    assert isinstance(survival, WaitSurvival) and WaitKey("acme", "api", 1) in survival


def test_a_tool_finished_event_reaches_the_lead_time() -> None:
    heard: list[tuple[Any, ...]] = []
    s = build(lead_time=lambda loop: SimpleNamespace(tool_finished=lambda *a: heard.append(a)))
    reaper_hears(s.loop)(TaskId("acme/t1"), TaskEventType.TOOL_FINISHED, "grep", None, 5.0)
    reaper_hears(s.loop)(TaskId("acme/t1"), TaskEventType.SUCCEEDED, None, None, 6.0)
    assert heard == [(TaskId("acme/t1"), "grep", 5.0)]


def test_a_header_speaker_without_headers_ends_unless_its_answer_called_a_tool(s: Setup) -> None:
    session = s.session("a")
    s.turn(session, tool="api", wait_s=1.0)
    s.turn(session, said=GREP)  # no header, but a tool call: it is coming back
    assert s.rows.figures()["kind"] == "pool_free" and s.rows.figures()["tool_class"] == "grep"
    s.turn(session, said=TO_PERSON)  # no header and no tool: its last step, as it says
    assert s.rows.figures()["kind"] == "last_step"
    assert "last step: its client named tools on earlier turns" in s.rows.last().reason


def test_a_turn_whose_answer_said_nothing_is_unknown(s: Setup) -> None:
    s.turn(s.session("a"))  # an error, a cut stream: no answer read, no header
    row, figures = s.rows.last(), s.rows.figures()
    assert figures["kind"] == "pool_free" and figures["tool_class"] is None
    assert figures["wait_from"] is None and "waits on" not in row.reason


def test_a_turns_end_is_decided_after_its_answer_unless_the_next_turn_began() -> None:
    """With the product's default `defer`: nothing is decided while the desk still has
    the answer to send; on the loop's next turn it is, unless the session is busy again."""
    s = build(defer=None)

    async def go() -> tuple[int, int, int]:
        a, b = s.session("a"), s.session("b")
        s.turn(a, tool="api", wait_s=1.0)
        s.turn(b, tool="api", wait_s=1.0)
        s.table.began(b, s.clock.t)  # b's next turn, before the loop turned
        decided_at_once = len(s.rows.residency)
        await asyncio.sleep(0)
        return decided_at_once, len(s.rows.residency), int(s.loop.decision_of(b) is None)

    assert asyncio.run(go()) == (0, 1, 1)
    assert s.rows.last().session_id == "acme/a"


def test_a_hold_is_decided_again_at_its_revisit_and_extended(s: Setup) -> None:
    session = s.session("a")
    s.turn(session, tool="api", wait_s=1.0)
    first = s.sent()[0]
    s.loop.tick(1000.5)
    assert s.sent() == [] and len(s.rows.residency) == 1  # not due yet
    s.clock.t = 1001.0
    s.loop.tick(1001.0)
    [again] = s.sent()
    assert again[0] == "hold" and again[3] > first[3]  # extended
    assert s.rows.figures()["idle_s"] == 1.0 and len(s.rows.residency) == 2


def test_a_hold_under_new_pressure_is_dropped_at_its_revisit() -> None:
    s = build(usage=0.1)
    s.turn(s.session("slow"), tool="approval", wait_s=3600.0)
    assert s.sent()[0][0] == "hold"  # room enough: holding costs nothing
    s.retention.usage[W0] = 0.99
    s.loop.tick(1001.0)
    assert s.sent() == [("release", W0, "acme/slow")]
    assert s.rows.last().action == "release"


def test_the_next_turn_ends_the_idle_period_in_a_return(s: Setup) -> None:
    session = s.session("a")
    s.turn(session, tool="api", wait_s=1.0)
    s.clock.t += 3.0
    s.table.began(session, s.clock.t)
    assert s.loop.decision_of(session) is None
    assert len(s.loop.policy.survival) > 0  # the 3 s gap was learned (WaitSurvival keys)
    s.loop.tick(1010.0)  # nothing waits: no revisit, no eviction
    assert len(s.rows.residency) == 1


def test_a_session_that_moved_worker_releases_its_old_hold(s: Setup) -> None:
    session = s.session("a")
    s.turn(session, tool="api", wait_s=1.0)
    s.sent()
    s.index.blocks[W1] = PROMPT // BLOCK
    s.turn(session, tool="api", wait_s=1.0, worker=W1)
    assert [(c[0], c[1]) for c in s.sent()] == [("release", W0), ("hold", W1)]


def test_an_eviction_is_recorded_with_its_cause_and_marks_the_receipt(s: Setup) -> None:
    session = s.session("a")
    s.turn(session, tool="approval", wait_s=3600.0)
    s.retention.usage[W0] = 0.99
    s.loop.tick(1001.0)  # released at its revisit
    s.index.evict(W0, 4)  # the engine evicted the tail of its prefix
    s.loop.tick(1003.0)
    row = s.rows.last()
    assert (row.action, row.tokens) == ("evicted", 4 * BLOCK)
    assert row.reason.startswith("lru: ")
    [mark] = s.rows.evictions
    assert session.chain is not None
    assert mark.prefix_digest == session.chain.hashes[-1].hex() and mark.cause == "lru"
    assert (mark.worker, mark.tenant_domain, mark.model, mark.runtime_identity) == (
        W0,
        "acme",
        "m",
        "test:m",
    )
    s.index.evict(W0, 0)
    s.loop.tick(1005.0)
    assert len(s.rows.evictions) == 1  # once per idle period


def test_a_seen_prefix_is_looked_up_again_only_after_its_worker_lost_blocks(s: Setup) -> None:
    s.retention.usage[W0] = 0.99  # released, not held: no revisits
    session = s.session("a")
    s.turn(session, tool="approval", wait_s=3600.0)
    s.loop.tick(1001.0)
    looked = s.index.lookups
    s.loop.tick(1003.0)
    s.index.evict(W1, 0)  # another worker's loss
    s.loop.tick(1005.0)
    assert s.index.lookups == looked
    s.index.evict(W0, 4)
    s.loop.tick(1007.0)
    assert s.index.lookups == looked + 1 and s.rows.last().action == "evicted"


def test_a_prefix_not_yet_seen_whole_is_looked_up_until_it_is(s: Setup) -> None:
    """Its worker's KV events may come after the answer: the watch waits for them, so that
    a later loss is told from blocks that never arrived."""
    s.index.blocks[W0] = 0
    s.retention.usage[W0] = 0.99  # released, not held: no revisits
    s.turn(s.session("a"), tool="approval", wait_s=3600.0)
    s.loop.tick(1001.0)
    s.loop.tick(1003.0)  # still nothing seen: looked up at each watch
    looked = s.index.lookups
    s.index.blocks[W0] = PROMPT // BLOCK
    s.loop.tick(1005.0)
    s.loop.tick(1007.0)
    assert s.index.lookups == looked + 1
    s.index.evict(W0, 2)
    s.loop.tick(1009.0)
    assert (s.rows.last().action, s.rows.last().tokens) == ("evicted", 2 * BLOCK)


def test_a_hold_given_back_under_pressure_is_recorded_and_is_the_cause(s: Setup) -> None:
    s.turn(s.session("a"), tool="api", wait_s=1.0)
    s.loop.returned(ReturnedKv(W0, "acme/a", 10, "pressure"), 1000.2)
    row = s.rows.last()
    assert (row.action, row.tokens) == ("given_back", PROMPT)
    assert row.reason.startswith("pressure: ")
    s.loop.returned(ReturnedKv(W0, "acme/a", 10, "released"), 1000.3)  # asked for: no row
    assert s.rows.last() is row
    s.index.evict(W0, 0)
    s.loop.tick(1000.4)
    assert s.rows.evictions[0].cause == "pressure"


def test_a_held_session_that_vanishes_was_lost_with_its_worker(s: Setup) -> None:
    s.turn(s.session("a"), tool="api", wait_s=1.0)
    s.index.evict(W0, 0)  # the index forgot the worker (a restart)
    s.loop.tick(1000.1)
    assert s.rows.evictions[0].cause == "worker_lost"
    s.sent()
    decided = len(s.rows.residency)
    for t in (1001.0, 1002.0, 1004.0, 1008.0):  # its revisits: nothing is left to hold
        s.loop.tick(t)
    assert len(s.rows.residency) == decided and s.sent() == []
    assert s.loop.decision_of(s.table.get(TenantId("acme"), SessionId("a"))).action == "evict"  # type: ignore[union-attr]
    s.loop.tick(1000.0 + 1800.0)  # at the maximum residency it is forgotten
    assert s.loop.status()["waiting"] == 0 and len(s.rows.residency) == decided


def test_an_evicted_decision_is_not_made_again_at_the_maximum_residency(s: Setup) -> None:
    """A session the reaper put first to evict gets no second evict row when the maximum
    residency comes; its wait ends unreturned."""
    session = s.session("a")
    s.turn(session, tool="api", wait_s=1.0)
    s.clock.t += 0.5
    s.turn(session)  # its last step: evicted
    s.sent()
    decided = len(s.rows.residency)
    s.loop.tick(s.clock.t + 1800.0)
    assert len(s.rows.residency) == decided and s.sent() == []
    assert s.rows.figures()["kind"] == "last_step"
    assert s.loop.status()["waiting"] == 1  # followed until its KV is gone


def test_with_a_host_tier_a_long_wait_under_pressure_is_demoted_and_its_copy_watched() -> None:
    s = build(usage=0.99)
    s.retention.host[W0] = HostTierSize(1000, 10, 250)  # its reports: a host tier, mostly free
    s.turn(s.session("slow"), tool="approval", wait_s=3600.0)
    assert s.sent() == [("demote", W0, "acme/slow")]
    assert (s.rows.last().action, s.rows.figures()["kind"]) == ("demote", "demote_cheapest")
    assert s.rows.figures()["v_host"] == 0.0 and s.rows.figures()["c_demote"] > 0
    s.index.evict(W0, 0)  # its GPU blocks went first: expected, no eviction
    s.index.host[W0] = PROMPT // BLOCK  # its copy on the host tier, as the events show
    s.loop.tick(1001.0)
    assert s.rows.evictions == [] and s.rows.last().action == "demote"
    s.index.evict(W0, 2, host=True)  # the host tier evicted most of it
    s.loop.tick(1003.0)
    row = s.rows.last()
    assert (row.action, row.tier, row.tokens) == ("evicted", "host", 2 * BLOCK)
    assert row.reason.startswith("host_lru: ") and s.rows.evictions[0].cause == "host_lru"
    s.loop.returned(ReturnedKv(W0, "acme/slow", 10, "demoted"), 1003.5)  # asked for: no row
    assert s.rows.last() is row


@pytest.mark.parametrize(("host_blocks", "action"), [(2000, "demote"), (250, "hold")])
def test_a_full_host_tier_is_valued_by_its_size_against_the_pool(
    host_blocks: int, action: str
) -> None:
    """A host tier is an LRU cache of everything the GPU computed: full once warm. Eight
    times the pool's size, what a demotion displaces there was kept eight times as long,
    and a short wait in a full pool goes there (its copy back costs microseconds); as large
    as the pool, it costs what a hold does and the copy back on top, and the session is
    held."""
    s = build(usage=1.0)
    s.retention.host[W0] = HostTierSize(host_blocks, host_blocks, 250)
    s.turn(s.session("call"), tool="api", wait_s=1.0)
    figures = s.rows.figures()
    assert s.rows.last().action == action, figures
    assert figures["v_host"] == pytest.approx(figures["v_hbm"] * 250 / host_blocks)


def test_without_a_host_tier_nothing_is_demoted() -> None:
    s = build(usage=0.99)
    s.turn(s.session("slow"), tool="approval", wait_s=3600.0)
    assert s.sent() == [] and s.rows.last().action == "release"
    assert s.rows.figures()["c_demote"] is None


def test_a_closed_tasks_session_is_evicted_and_ends(s: Setup) -> None:
    session = s.session("a", task="acme/t1")
    s.turn(session, tool="human", wait_s=60.0)
    s.sent()
    s.closed.add("acme/t1")
    s.loop.tick(1000.1)
    assert s.sent() == [("evict_first", W0, "acme/a", 0, True)]  # a root's: all of it
    assert s.rows.last().reason.startswith("session_ended: its task closed")
    s.loop.tick(5000.0)  # ended: never decided again
    assert s.rows.last().reason.startswith("session_ended")


@pytest.mark.parametrize("host", [True, False])
def test_a_closed_tasks_session_gone_from_the_gpu_still_leaves_the_host_tier(
    s: Setup, host: bool
) -> None:
    """Evicted from its worker's GPU while it waited: its task's end still drops its copies
    in the worker's host tier; without one, nothing is left to send."""
    session = s.session("a", task="acme/t1")
    s.turn(session, tool="approval", wait_s=3600.0)
    s.retention.usage[W0] = 0.99
    s.loop.tick(1001.0)  # released at its revisit
    s.index.evict(W0, 0)  # then evicted from the GPU
    s.loop.tick(1003.0)
    assert s.rows.last().action == "evicted"
    s.sent()
    if host:  # the worker's reports show a host tier
        s.retention.host[W0] = HostTierSize(4096, 100, 512)
    s.closed.add("acme/t1")
    s.loop.tick(1004.0)
    assert s.sent() == ([("evict_first", W0, "acme/a", 0, True)] if host else [])
    assert s.rows.last().reason.startswith("session_ended: its task closed")


def test_an_ended_session_keeps_its_stem_cached_and_evicts_the_rest_first(s: Setup) -> None:
    session = s.session("a", task="acme/t1")
    session.stem_tokens = 3 * BLOCK + 5  # its system prompt and tools: 3 full blocks
    s.turn(session, tool="human", wait_s=60.0)
    s.sent()
    s.closed.add("acme/t1")
    s.loop.tick(1000.1)
    assert s.sent() == [("evict_first", W0, "acme/a", 3, True)]


def test_a_session_whose_next_prompt_overflowed_ends_keeping_its_stem(s: Setup) -> None:
    """A turn refused for a prompt over the window (its harness compacts next): the session's
    KV past its system prompt and tools goes on every tier, with no task event; a refusal
    from before its last turn ended does not end it."""
    session = s.session("a")
    session.stem_tokens = 2 * BLOCK
    s.turn(session, tool="api", wait_s=600.0)
    s.sent()
    session.overflowed_at = s.clock.t - 1.0  # refused before this turn: compacted since
    s.loop.tick(s.clock.t + 1.0)
    assert not [d for d in s.sent() if d[0] == "evict_first"]
    session.overflowed_at = s.clock.t + 2.0
    s.loop.tick(s.clock.t + 2.5)
    assert s.sent() == [("evict_first", W0, "acme/a", 2, True)]
    assert s.rows.last().reason.startswith("session_ended: its next prompt overflowed")
    s.loop.tick(s.clock.t + 5000.0)  # ended: not ended again
    assert not [d for d in s.sent() if d[0] == "evict_first"]


def test_a_last_step_keeps_what_another_waiting_session_of_its_tenant_shares(s: Setup) -> None:
    other = s.session("b")
    s.table.hash_prompt(other, [*range(100, 100 + 4 * BLOCK), *range(9000, 9000 + BLOCK)], "salt")
    s.turn(other, tool="approval", wait_s=3600.0)
    stranger = s.table.open(TenantId("zeta"), SessionId("z"), s.clock.t)
    s.table.hash_prompt(stranger, list(range(100, 100 + PROMPT)), "zeta-salt")
    stranger.home = W0
    s.turn(stranger, tool="approval", wait_s=3600.0)
    session = s.session("a")
    s.turn(session, tool="api", wait_s=1.0)
    s.sent()
    s.turn(session)  # its last step: the 4 blocks "b" shares stay, another tenant's do not
    assert s.sent() == [("evict_first", W0, "acme/a", 4, False)]


def test_past_the_maximum_residency_a_session_is_evicted_and_abandoned(s: Setup) -> None:
    session = s.session("a")
    s.turn(session, tool="approval", wait_s=3600.0)
    s.retention.usage[W0] = 0.99
    s.loop.tick(1001.0)  # released: next due at the maximum residency
    s.sent()
    s.loop.tick(1000.0 + 1800.0)
    assert s.sent() == [("evict_first", W0, "acme/a")]
    assert s.rows.figures()["kind"] == "max_residency"
    s.loop.tick(1000.0 + 3600.0)
    assert s.rows.figures()["kind"] == "max_residency"  # decided once


def test_holds_get_their_priorities_again(s: Setup) -> None:
    s.turn(s.session("a"), tool="api", wait_s=1.0)
    s.turn(s.session("b"), tool="api", wait_s=2.0)
    s.sent()
    s.loop.tick(1000.1)
    [order] = [c for c in s.sent() if c[0] == "order"]
    assert order[1] == W0 and set(order[2]) == {"acme/a", "acme/b"}


def test_an_operators_release_reaches_the_workers_that_hold_it(s: Setup) -> None:
    session = s.session("a")
    s.turn(session, tool="api", wait_s=1.0)
    s.sent()
    s.retention.held[W1] = {"acme/a": RetainedKv("acme/a", 32, 2000.0, 0.1)}  # an old hold
    releases = SessionReleases(
        s.table,
        s.rows,
        EventFeed(),
        1024,
        kv_release=s.loop.release,  # type: ignore[arg-type]
    )
    releases.release(session, 1000.2)
    assert sorted(s.sent()) == [("release", W0, "acme/a"), ("release", W1, "acme/a")]
    assert s.rows.last().action == "release" and s.rows.last().reason == "released by operator"
    assert s.loop.decision_of(session).reason == "released by operator"  # type: ignore[union-attr]
    s.loop.tick(1001.0)  # its revisit is gone: not held again before its next turn
    assert [c for c in s.sent() if c[0] == "hold"] == []


def test_without_retention_decisions_are_recorded_and_nothing_is_sent() -> None:
    s = build(retention=NoRetention("the simulated workers have no retention channel"))
    s.turn(s.session("a"), tool="api", wait_s=1.0)
    assert s.rows.last().action == "hold" and s.loop.decisions["hold"] == 1
    asyncio.run(s.loop.outbox.flush())
    assert s.loop.outbox.unsent == 0  # nothing was queued to send


def test_a_turn_without_a_session_or_task_gets_no_decision(s: Setup) -> None:
    one = s.session("task:acme/turn-abc", task="acme/turn-abc")
    s.turn(one)
    assert s.rows.residency == []


def test_the_loop_reads_the_workers_give_backs_as_they_come() -> None:
    async def go() -> Rows:
        s = build()
        s.retention.returns = asyncio.Queue()
        s.turn(s.session("a"), tool="api", wait_s=1.0)
        task = asyncio.create_task(run_reaper(s.loop))
        await s.retention.returns.put(ReturnedKv(W0, "acme/a", 10, "capped"))
        for _ in range(50):
            if s.rows.last().action == "given_back":
                break
            await asyncio.sleep(0.01)
        assert s.retention.calls[0][0] == "hold"  # the sender sent the turn's hold
        task.cancel()
        return s.rows

    rows = asyncio.run(go())
    assert rows.last().reason.startswith("capped: ")


def test_a_decision_that_fails_never_reaches_the_turn(s: Setup) -> None:
    session = s.session("a")
    session.home = WorkerId("nowhere")
    s.index.blocks.clear()
    s.loop.policy.decide = None  # type: ignore[assignment,method-assign]
    s.table.began(session, 1000.0)
    s.table.ended(session, 1000.0)  # logged, not raised
    assert session.in_flight == 0 and math.isfinite(s.clock.t)


def test_a_branch_that_ends_drops_its_own_blocks_everywhere_and_leaves_its_parents() -> None:
    """A child task's session shares its parent's prefix (inherited) and adds its own: when
    the child ends, only its own blocks go first and leave the host tier; the parent's stay
    cached as they were. Unknown parent sessions: nothing is taken for its own."""
    s = build()
    parents = {TaskId("acme/kid"): TaskId("acme/root"), TaskId("acme/orphan"): TaskId("acme/gone")}
    s.loop._inputs = replace(s.loop._inputs, task_parent=parents.get)
    s.turn(s.session("p", task="acme/root"), tool="approval", wait_s=600.0)
    for sid, task, start in (("c", "acme/kid", 5000), ("o", "acme/orphan", 6000)):
        own = list(range(start, start + 3 * BLOCK))  # three blocks of its own past the prefix
        child = s.table.open(TenantId("acme"), SessionId(sid), s.clock.t)
        s.table.hash_prompt(child, [*range(100, 100 + PROMPT), *own], "salt")
        child.home, child.task_id = W0, TaskId(task)
        s.turn(child, tool="api", wait_s=0.5)
    s.sent()
    s.closed.update({"acme/kid", "acme/orphan"})
    s.loop.tick(1000.1)
    sent = sorted(s.sent())
    assert sent == [
        ("evict_first", W0, "acme/c", PROMPT // BLOCK, True),
        ("evict_first", W0, "acme/o", PROMPT // BLOCK + 3, True),
    ]
    ended = {r.session_id: json.loads(r.figures_json or "{}") for r in s.rows.residency[-2:]}
    assert ended["acme/c"]["inherited_tokens"] == PROMPT  # on the ledger: what stayed
    assert ended["acme/c"]["own_tokens"] == 3 * BLOCK
    kid = s.loop.branch_ends.get(TaskId("acme/kid"))  # and for the state's task tree
    assert kid is not None and (kid.own_tokens, kid.inherited_tokens) == (3 * BLOCK, PROMPT)
    assert kid.at == 1000.1 and s.loop.branch_ends.get(TaskId("acme/root")) is None


def test_a_held_session_whose_worker_goes_to_rest_is_lost_with_that_cause(s: Setup) -> None:
    """The worker reaper tells the loop before it puts a worker to sleep or stops it: the
    sessions waiting there are held no more, and their KV's going is recorded as the rest's;
    a session on another worker that loses its KV then was lost with its worker."""
    s.index.blocks[W1] = PROMPT // BLOCK
    s.turn(s.session("a"), tool="api", wait_s=1.0)
    s.turn(s.session("b"), tool="api", wait_s=1.0, worker=W1)
    s.loop.worker_rests(W0)
    s.index.evict(W0, 0)  # the worker's KV is gone with its sleep
    s.index.evict(W1, 0)  # and the other's with a restart
    s.loop.tick(1000.1)
    causes = {e.tenant_domain + "/" + e.worker: e.cause for e in s.rows.evictions}
    assert causes == {f"acme/{W0}": "worker_rest", f"acme/{W1}": "worker_lost"}
