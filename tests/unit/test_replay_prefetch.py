"""Restore on lead time in the closed-loop replay: an announced turn finds its prefix
prefilled (or promoted from the host tier) before it arrives, every prefetch is a row that
says whether its turn used it, and announcements that never come early switch it off at no
cost; small hand-built workloads on one worker."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from appliance.policy.prefetch import RESTORE_AHEAD_TRIGGERS, PrefetchPolicy, PrefetchTuning
from appliance.policy.residency import (
    HeldSession,
    IdleSession,
    ResidencyAction,
    ResidencyDecision,
    ResidencyKind,
)
from appliance.policy.residency_by_name import ResidencyPlan
from appliance.policy.return_due import ONCE, RESTORE_AHEAD, DueRule
from appliance.policy.survival import Outlook, WaitKey
from appliance.policy.wait_curves import EDGES
from appliance.replay.kv_residency.prefetch import PrefetchDriver
from appliance.replay.kv_residency.residency import TurnHint
from appliance.replay.runner import make_setup
from appliance.replay.workload_replay import WorkloadRun, replay_closed_loop, replay_workload
from appliance.sim.engine_io import SimRequest
from appliance.sim.kv.residency_hook import TurnEnd
from appliance.sim.runtime.virtual import RequestRecord, Timer
from appliance.workload import AgentTask, AgentTurn

BLOCK = 512


def task(task_id: str, turns: list[AgentTurn], *, start: float = 0.0) -> AgentTask:
    return AgentTask(
        task_id, None, "acme", "fix", start, None, True, True, task_id, BLOCK, tuple(turns)
    )


def t(
    appended: int, tool: str | None = None, wait_s: float = 0.0, lead_s: float = 0.0
) -> AgentTurn:
    return AgentTurn(appended, 8, tool, wait_s, announce_lead_s=lead_s)


def waits_then_a_filler(lead_s: float) -> list[AgentTask]:
    """Four sessions of 21 blocks each wait 20 s on a test run, one after another; while
    each waits, a 46-block prompt of another task pushes most of it out of the 64-block pool
    (the reaper's hold gives way). The test's end is announced `lead_s` early."""
    big = [
        task(f"big{i}", [t(20 * BLOCK, "test", 20.0, lead_s), t(100)], start=i * 30.0)
        for i in range(4)
    ]
    fill = [task(f"fill{i}", [t(45 * BLOCK)], start=i * 30.0 + 3.0) for i in range(4)]
    return big + fill


def run(
    tasks: list[AgentTask], residency: str | ResidencyPlan, host_gib: float = 0.0
) -> WorkloadRun:
    setup, latency = make_setup(workers=1, hbm_gib=4.0, host_gib=host_gib)
    return replay_closed_loop(tasks, "appliance", setup, latency, residency=residency)


def returns(r: WorkloadRun) -> dict[str, tuple[float, int]]:
    """The tests' second turns: (TTFT, cached tokens)."""
    return {
        x.request_id: (x.ttft_s or 0.0, x.cached_tokens)
        for x in r.result.records
        if x.request_id.startswith("big") and x.request_id.endswith("/1")
    }


def test_an_announced_turn_finds_its_prefix_prefilled_before_it_arrives() -> None:
    tasks = waits_then_a_filler(lead_s=1.0)
    plain = returns(run(tasks, "reaper"))
    fetched_run = run(tasks, "reaper+lead-time:tool_finished")
    fetched = returns(fetched_run)
    # The first announcement shows the lead; from the second on, the prefix is prefilled.
    for rid in ("big1/1", "big2/1", "big3/1"):
        assert fetched[rid][1] > plain[rid][1]
        assert fetched[rid][0] < 0.5 * plain[rid][0]
    assert fetched["big0/1"] == plain["big0/1"]
    assert fetched_run.prefetch is not None
    summary = fetched_run.prefetch.summary()
    assert summary["prefetches"] == summary["used"] == 3
    assert summary["unused_bytes"] == 0 and summary["ttft_saved_s"] > 0
    rows = summary["rows"]
    assert isinstance(rows, list) and len(rows) == 3
    assert all(r["trigger"] == "tool_finished" and r["used"] for r in rows)
    assert all(r["lead_s"] == pytest.approx(1.0) for r in rows)


def test_announcements_that_never_come_early_cost_nothing() -> None:
    tasks = waits_then_a_filler(lead_s=0.0)
    plain = run(tasks, "reaper")
    fetched = run(tasks, "reaper+lead-time:tool_finished")
    assert returns(fetched) == returns(plain)
    assert fetched.prefetch is not None
    summary = fetched.prefetch.summary()
    assert summary["prefetches"] == 0
    skipped = summary["skipped"]
    assert isinstance(skipped, dict) and skipped["lead_too_short"] == 3  # switched off


def test_the_workload_rows_report_prefetches_and_prefill_seconds() -> None:
    setup, latency = make_setup(workers=1, hbm_gib=4.0)
    tasks = waits_then_a_filler(lead_s=1.0)
    plain = replay_workload(tasks, "appliance", setup, latency, residency="reaper")
    fetched = replay_workload(tasks, "appliance", setup, latency, residency="reaper+lead-time")
    assert plain["prefetch"] is None and isinstance(fetched["prefetch"], dict)
    assert fetched["prefetch"]["accuracy"] == 1.0
    assert plain["prefetch_unused_share"] is None
    assert fetched["prefetch_unused_share"] == fetched["prefetch"]["unused_bytes_share"] == 0.0
    # Prefill moved from the turns to the idle time before them, not added.
    assert fetched["prefill_s"] == pytest.approx(plain["prefill_s"], rel=0.05)
    assert fetched["ttft_p95_s"] <= plain["ttft_p95_s"]


@dataclass
class Demote:
    """A residency policy that demotes every turn's blocks to the host tier."""

    name: str = "demote"

    def decide(self, session: IdleSession, now: float) -> ResidencyDecision:
        return ResidencyDecision(ResidencyAction.DEMOTE, "demote", kind=ResidencyKind.LRU)

    def priority(self, held: HeldSession, now: float) -> float:
        return 0.0


def test_an_announced_turn_finds_its_demoted_blocks_promoted() -> None:
    tasks = [
        task("big0", [t(20 * BLOCK, "test", 20.0, 1.0), t(100)]),
        task("big1", [t(20 * BLOCK, "test", 20.0, 1.0), t(100)], start=30.0),
    ]
    plain = returns(run(tasks, Demote(), host_gib=8.0))  # type: ignore[arg-type]
    plan = ResidencyPlan(Demote(), prefetch=PrefetchPolicy())
    fetched_run = run(tasks, plan, host_gib=8.0)
    fetched = returns(fetched_run)
    assert fetched_run.prefetch is not None
    (first, second) = fetched_run.prefetch.rows  # promotions need no lead measured first
    assert first.action.value == second.action.value == "promote"
    assert first.use is not None and first.use.used_tokens == 21 * BLOCK  # every whole block
    for rid in ("big0/1", "big1/1"):
        assert fetched[rid][1] == plain[rid][1]  # the same hit, from HBM now
        assert fetched[rid][0] < plain[rid][0]  # without the copy in its TTFT
    host = [x for x in fetched_run.result.records if x.request_id.endswith("/1")]
    assert all(x.host_cached_tokens == 0 for x in host)


# --- the wait model's signals, rechecked (restore ahead of the predicted return) ---

DUE = next(e for e in EDGES if e >= 10.0)
AGAIN = next(e for e in EDGES if e >= DUE + 1.0)


class LikelyFrom:
    """A wait model by which a turn is likely (P 0.9) once away `from_s`, not before."""

    def __init__(self, from_s: float) -> None:
        self.from_s = from_s

    def outlook(
        self, key: WaitKey, idle_s: float, horizon_s: float, hint_s: float | None = None
    ) -> Outlook:
        return Outlook(0.9 if idle_s >= self.from_s else 0.0, horizon_s)


def waiting_driver(due: DueRule, hint: TurnHint) -> tuple[PrefetchDriver, list[Timer]]:
    """A driver (bound to no engines: a signal starts nothing) told of a session's turn
    ending at 100 s, and the timers that turn's record hands the replay."""
    _, latency = make_setup(workers=1, hbm_gib=4.0)
    policy = PrefetchPolicy(PrefetchTuning(triggers=RESTORE_AHEAD_TRIGGERS))
    driver = PrefetchDriver(policy, latency=latency, survival=LikelyFrom(10.0), due=due)
    req = SimRequest("s/0", [0] * 640, 8, cache_salt="acme", session_id="s")
    session = IdleSession("s", 640, 100.0, hint.ends_in_tool_call, tenant="acme")
    driver.turn_ended(TurnEnd(req, 640, 0.5, 100.0), hint, session)
    return driver, driver.on_finish(RequestRecord("s/0", 0, 90.0, 640, finish_s=100.0))


def fired(timer: Timer, now: float) -> list[Timer]:
    return list(timer.fire(now) or ())


def test_a_wait_model_signal_that_started_nothing_is_due_again_while_the_turn_stays_likely() -> (
    None
):
    driver, timers = waiting_driver(RESTORE_AHEAD, TurnHint(True))
    (first,) = timers
    assert first.time_s == 100.0 + DUE
    (again,) = fired(first, 100.0 + DUE)
    assert again.time_s == 100.0 + AGAIN
    driver.turn_arrived(SimRequest("s/1", [0] * 700, 8, session_id="s"), 100.0 + AGAIN - 0.5)
    assert fired(again, 100.0 + AGAIN) == []  # back: the timer is dropped
    _, once = waiting_driver(ONCE, TurnHint(True))
    assert fired(once[0], 100.0 + DUE) == []
    _, none = waiting_driver(RESTORE_AHEAD, TurnHint(None))
    assert none == []  # nothing known of the wait: not timed
