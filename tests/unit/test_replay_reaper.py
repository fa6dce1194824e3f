"""The reaper in the replay: what the adapter gives it and tells it (revisits through the
engine, each idle period's end reported once), and three failure modes of idle KV replayed
closed loop: approvals that never starve running requests, a burst of returning large
sessions under pressure, and a fan-out storm against other tenants' warm prefixes."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from appliance.policy.reaper import Reaper, ReaperTuning
from appliance.policy.residency import (
    HeldSession,
    IdleSession,
    ResidencyAction,
    ResidencyDecision,
    ResidencyKind,
)
from appliance.policy.residency_by_name import residency_policy
from appliance.replay.closed_loop import ClosedLoop
from appliance.replay.kv_residency.residency import PolicyResidency, TurnHint, wait_priors
from appliance.replay.runner import make_engines, make_setup
from appliance.replay.workload_replay import replay_workload
from appliance.sim.engine_io import SimRequest
from appliance.sim.kv.pins import Pin
from appliance.sim.kv.residency_hook import PinDue, TurnEnd
from appliance.sim.runtime.virtual import RequestRecord
from appliance.sim.runtime.virtual import replay as run_virtual
from appliance.workload import AgentTask, AgentTurn, WorkloadSpec

BLOCK = 512


@dataclass
class Recorder:
    """A policy that holds for `hold_s` and writes down everything it is told."""

    hold_s: float = 10.0
    tuning: ReaperTuning = field(default_factory=lambda: ReaperTuning(max_residency_s=100.0))
    revisits_holds: bool = True
    name: str = "recorder"
    decided: list[IdleSession] = field(default_factory=list)
    returns: list[tuple[str, float]] = field(default_factory=list)
    abandoned: list[tuple[str, float]] = field(default_factory=list)

    def decide(self, session: IdleSession, now: float) -> ResidencyDecision:
        self.decided.append(session)
        return ResidencyDecision(ResidencyAction.HOLD, "hold", now + self.hold_s, ResidencyKind.LRU)

    def priority(self, held: HeldSession, now: float) -> float:
        return 0.0

    def observe_return(self, session: IdleSession, now: float) -> None:
        self.returns.append((session.session_id, now))

    def observe_abandoned(self, session: IdleSession, now: float) -> None:
        self.abandoned.append((session.session_id, now))


def adapter(policy: Recorder, hints: dict[str, TurnHint] | None = None) -> PolicyResidency:
    _, latency = make_setup(workers=1, hbm_gib=1.0)
    table = hints or {}
    return PolicyResidency(policy, latency=latency, block_size=BLOCK, hints=table.get)


def req(request_id: str, session: str = "s", tenant: str | None = None) -> SimRequest:
    return SimRequest(request_id, [1] * 10, 1, session_id=session, cache_salt=tenant)


def end(request_id: str, now: float, *, session: str = "s", usage: float = 0.5) -> TurnEnd:
    return TurnEnd(req(request_id, session), 2 * BLOCK, usage, now)


def test_a_turn_end_gives_the_policy_costs_sizes_and_the_hint() -> None:
    policy = Recorder()
    hold = adapter(policy, {"r1": TurnHint(True, "test", 30.0)})
    assert hold.after_turn(end("r1", 5.0)).action == "hold"
    s = policy.decided[0]
    assert (s.session_id, s.finished_at_s, s.tool_class, s.expected_wait_s) == (
        "s",
        5.0,
        "test",
        30.0,
    )
    assert s.recompute_s and s.recompute_s > 0 and s.kv_bytes == 2 * BLOCK * 131_072
    assert s.promote_s and s.promote_s > 0 and s.host is None and s.kv_usage == 0.5


def test_a_due_pin_is_decided_again_for_the_same_idle_period_as_the_pool_is_now() -> None:
    policy = Recorder()
    hold = adapter(policy)
    hold.after_turn(end("r1", 5.0))
    pin = Pin("s", 2, 5.0, 15.0)
    after = hold.revisit(PinDue(pin, kv_usage=0.9, now_s=15.0))
    assert after.action == "hold" and after.until_s == 25.0
    again = policy.decided[1]
    assert again.finished_at_s == 5.0 and again.kv_usage == 0.9


def test_a_pin_of_an_earlier_idle_period_lapses_without_asking() -> None:
    policy = Recorder()
    hold = adapter(policy)
    hold.after_turn(end("r1", 5.0))
    hold.turn_arrived(req("r2"), 8.0)
    hold.after_turn(end("r2", 9.0))
    stale = Pin("s", 2, 5.0, 15.0)  # on the worker of the first turn
    assert hold.revisit(PinDue(stale, kv_usage=0.9, now_s=15.0)).action == "release"
    assert len(policy.decided) == 2


def test_a_fixed_ttl_is_never_revisited() -> None:
    policy = Recorder(revisits_holds=False)
    hold = adapter(policy)
    hold.after_turn(end("r1", 5.0))
    assert hold.revisit(PinDue(Pin("s", 2, 5.0, 15.0), 0.9, 15.0)).action == "release"


def test_each_idle_period_ends_once_in_a_return() -> None:
    policy = Recorder()
    hold = adapter(policy)
    hold.after_turn(end("r1", 5.0))
    hold.turn_arrived(req("r2"), 8.0)
    hold.turn_arrived(req("r3"), 9.0)  # a second request while the first still runs
    assert policy.returns == [("s", 8.0)] and policy.abandoned == []


def test_a_session_that_ends_after_a_tool_call_is_abandoned_when_its_client_gives_up() -> None:
    policy = Recorder()
    hold = adapter(policy, {"r1": TurnHint(True, "approval", 40.0, session_ends=True)})
    hold.after_turn(end("r1", 5.0))
    hold.turn_arrived(req("x", session="other"), 44.0)
    assert policy.abandoned == []
    hold.turn_arrived(req("y", session="other"), 46.0)
    assert policy.abandoned == [("s", 45.0)] and policy.returns == []


def test_a_session_idle_past_the_maximum_residency_has_timed_out() -> None:
    policy = Recorder(tuning=ReaperTuning(max_residency_s=100.0))
    hold = adapter(policy)
    hold.after_turn(end("r1", 5.0))
    hold.turn_arrived(req("x", session="other"), 200.0)
    hold.turn_arrived(req("r2"), 201.0)  # too late: a new session of the same id
    assert policy.abandoned == [("s", 105.0)] and policy.returns == []


# --- failure modes, closed loop ---


def task(
    task_id: str,
    turns: list[AgentTurn],
    *,
    start: float = 0.0,
    tenant: str = "acme",
    prefix: int = 512,
    prefix_id: str = "p",
) -> AgentTask:
    return AgentTask(
        task_id, None, tenant, "fix", start, None, True, True, prefix_id, prefix, tuple(turns)
    )


def t(
    appended: int,
    output: int = 8,
    tool: str | None = None,
    wait_s: float = 0.0,
    spawns: tuple[str, ...] = (),
) -> AgentTurn:
    return AgentTurn(appended, output, tool, wait_s, spawns)


@dataclass
class Run:
    records: dict[str, RequestRecord]
    preemptions: int
    kinds: dict[str, int]

    def fresh(self) -> int:
        return sum(r.prompt_tokens - r.cached_tokens for r in self.records.values())

    def cached(self, prefix: str) -> int:
        return sum(r.cached_tokens for k, r in self.records.items() if k.startswith(prefix))


def replay(tasks: list[AgentTask], residency: str | Reaper, hbm_gib: float = 4.0) -> Run:
    """The tasks closed loop on one worker of `hbm_gib` (4 GiB: 64 blocks of 512)."""
    setup, latency = make_setup(workers=1, hbm_gib=hbm_gib)
    loop = ClosedLoop(tasks, max_model_len=setup.max_model_len)
    priors = wait_priors(WorkloadSpec().tool_classes)
    policy = residency_policy(residency, priors=priors) if isinstance(residency, str) else residency
    hold = PolicyResidency(policy, latency=latency, block_size=BLOCK, hints=loop.hint)
    engines = make_engines(setup, latency, hold)
    result = run_virtual(engines, loop.arrivals(), on_finish=loop.on_finish)
    preempted = sum(s.num_preemptions_total for s in result.engine_stats)
    return Run({r.request_id: r for r in result.records}, preempted, dict(hold.kinds))


def approvals_and_workers() -> list[AgentTask]:
    """40 sessions of 2 blocks each go to wait on approvals (10 min) while 6 workers of 6
    blocks keep running: the waiting KV alone would fill most of the 64-block pool."""
    waiting = [
        task(
            f"wait{i}",
            [t(2 * BLOCK, 8, "approval", 600.0), t(100)],
            start=i * 0.05,
            prefix_id=f"w{i}",
        )
        for i in range(40)
    ]
    working = [
        task(
            f"work{i}",
            [t(BLOCK, 8, "file", 0.5) for _ in range(6)] + [t(100)],
            start=3.0 + i * 0.1,
            prefix_id=f"k{i}",
        )
        for i in range(6)
    ]
    return waiting + working


@pytest.mark.parametrize("residency", ["reaper", "ttl-pin:3600"])
def test_sessions_waiting_on_approvals_never_preempt_or_refuse_a_running_request(
    residency: str,
) -> None:
    run = replay(approvals_and_workers(), residency)
    assert run.preemptions == 0
    tasks = approvals_and_workers()
    assert len(run.records) == sum(len(x.turns) for x in tasks)
    assert all(r.finish_reason == "length" for r in run.records.values())


def big_sessions_return_in_a_burst() -> list[AgentTask]:
    """Four large sessions (12 blocks) wait 20 s on a test run; meanwhile 30 small ones (2
    blocks) finish and wait a few seconds on file tools; then the large ones all come back
    in a burst. The 64-block pool cannot keep everything: which holds give way decides how
    much of the burst is prefilled again."""
    big = [
        task(f"big{i}", [t(12 * BLOCK, 8, "test", 20.0), t(100)], start=i * 0.05, prefix_id=f"b{i}")
        for i in range(4)
    ]
    small = [
        task(
            f"small{i}",
            [t(2 * BLOCK, 8, "file", 3.0), t(100)],
            start=1.0 + i * 0.3,
            prefix_id=f"s{i}",
        )
        for i in range(30)
    ]
    return big + small


def test_under_pressure_the_reaper_keeps_what_costs_most_to_prefill_again() -> None:
    tasks = big_sessions_return_in_a_burst()
    fresh = {r: replay(tasks, r).fresh() for r in ("lru", "ttl-pin", "reaper")}
    assert fresh["reaper"] < fresh["lru"] and fresh["reaper"] < fresh["ttl-pin"]


def fan_out_storm() -> list[AgentTask]:
    """Tenant `other` has 8 sessions of 3 blocks waiting 8 s on searches; at t=1 a parent of
    tenant `acme` spawns 12 children of 3 blocks, which finish and wait a minute on tests;
    at t=4 a 30-block prompt of a third tenant needs room in the 64-block pool."""
    children = [
        AgentTask(
            f"p.{j}",
            "p",
            "acme",
            "fix",
            0.0,
            None,
            True,
            True,
            f"c{j}",
            512,
            (t(2 * BLOCK, 8, "test", 60.0), t(100)),
        )
        for j in range(12)
    ]
    parent = task(
        "p", [t(100, 8, "subagent", 0.0, tuple(c.task_id for c in children)), t(100)], start=1.0
    )
    others = [
        task(
            f"o{i}",
            [t(3 * BLOCK - 600, 8, "search", 8.0), t(100)],
            start=i * 0.05,
            tenant="other",
            prefix_id=f"o{i}",
        )
        for i in range(8)
    ]
    third = task("big", [t(30 * BLOCK, 8)], start=4.0, tenant="third", prefix_id="big")
    return [parent, *children, *others, third]


def test_a_fan_out_storm_does_not_push_out_other_tenants_warm_prefixes_past_its_cap() -> None:
    cap = 16 * BLOCK * 131_072  # a tenant may hold 16 blocks of 64
    lru = replay(fan_out_storm(), "lru")
    priors = wait_priors(WorkloadSpec().tool_classes)
    capping = Reaper(priors=priors, tuning=ReaperTuning(tenant_cap_bytes=cap))
    capped = replay(fan_out_storm(), capping)
    assert capped.preemptions == lru.preemptions == 0
    assert capped.kinds.get("tenant_cap", 0) > 0
    returns = [f"o{i}/1" for i in range(8)]
    assert all(capped.records[r].cached_tokens >= 2 * BLOCK for r in returns)
    assert sum(lru.records[r].cached_tokens for r in returns) < 8 * 2 * BLOCK


def test_reuse_is_counted_by_the_tool_the_turn_waited_on() -> None:
    setup, latency = make_setup(workers=1, hbm_gib=4.0)
    tasks = [task("a", [t(2 * BLOCK, 8, "file", 1.0), t(100, 8, "test", 5.0), t(100)])]
    m = replay_workload(tasks, "round-robin", setup, latency, residency="reaper")
    reuse = m["reuse_by_tool"]
    assert set(reuse) == {"file", "test"}
    assert reuse["file"]["turns"] == reuse["test"]["turns"] == 1
    assert reuse["file"]["cached_tokens"] == 3 * BLOCK  # prefix and statement: 3 blocks


def test_an_abandoned_task_never_completes_nor_meets_its_deadline() -> None:
    setup, latency = make_setup(workers=1, hbm_gib=4.0)
    gone = AgentTask(
        "gone",
        None,
        "acme",
        "fix",
        0.0,
        600.0,
        False,
        False,
        "p",
        512,
        (t(BLOCK, 8, "approval", 30.0),),
    )
    done = AgentTask(
        "done",
        None,
        "acme",
        "fix",
        0.0,
        600.0,
        True,
        True,
        "q",
        512,
        (t(BLOCK, 8, "file", 1.0), t(100)),
    )
    m = replay_workload([gone, done], "round-robin", setup, latency, residency="reaper")
    assert m["tasks"] == 2 and m["tasks_completed"] == 1 and m["deadline_goodput"] == 0.5
