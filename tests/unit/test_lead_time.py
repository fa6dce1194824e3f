"""Restore on lead time, live: on a client's `tool_finished`, or when the wait model says its
turn is likely (a timer the reaper loop's tick fires, on the test's clock), a demoted
session is restored to its worker's HBM (a directive and a ledger row), and its next turn
settles it used or unused. Over the reaper loop's fakes (tests/unit/test_reaper_loop.py)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace

import pytest

from appliance.domain.retention import HostTierSize
from appliance.domain.worker import LoadSnapshot
from appliance.policy.prefetch import (
    RESTORE_AHEAD_TRIGGERS,
    PrefetchKey,
    PrefetchPolicy,
    PrefetchTrigger,
    PrefetchTuning,
)
from appliance.policy.survival import Outlook, WaitKey
from appliance.policy.wait_curves import EDGES
from appliance.services.residency.lead_time import RESTORE_HOLD_S, LeadTime
from appliance.services.residency.reaper_loop import ReaperLoop
from tests.unit.test_reaper_loop import BLOCK, PROMPT, W0, Setup, build

KEY = PrefetchKey("acme", "approval", PrefetchTrigger.TOOL_FINISHED)


def lead_time(policy: PrefetchPolicy) -> Callable[[ReaperLoop], LeadTime]:
    """The reaper loop's restore on lead time under `policy`, over the loop's own parts."""
    return lambda loop: LeadTime(
        policy, loop._inputs, loop.outbox, ledger=loop._ledger, waiting=loop.waiting_sessions
    )


def demoted(task: str = "acme/t1") -> tuple[Setup, LeadTime]:
    """A session of `task` demoted on w0: its prefix gone from HBM, whole on the host tier."""
    s = build(usage=0.99, lead_time=lead_time(PrefetchPolicy(PrefetchTuning(prefill=False))))
    s.retention.host[W0] = HostTierSize(1000, 10, 250)
    s.turn(s.session("slow", task=task), tool="approval", wait_s=3600.0)
    assert s.sent() == [("demote", W0, "acme/slow")]
    s.index.evict(W0, 0)
    s.index.host[W0] = PROMPT // BLOCK
    assert s.loop.lead_time is not None
    return s, s.loop.lead_time


def test_a_demoted_sessions_announced_return_restores_it_and_its_turn_uses_it() -> None:
    s, lead = demoted()
    lead.tool_finished("acme/t1", "approval", 1010.0)  # type: ignore[arg-type]
    ((kind, worker, key, until_s, _),) = s.sent()
    assert (kind, worker, key, until_s) == ("restore", W0, "acme/slow", 1010.0 + RESTORE_HOLD_S)
    row = s.rows.last()
    assert (row.action, row.tokens) == ("restore", PROMPT)
    figures = json.loads(row.figures_json or "{}")
    assert figures["trigger"] == "tool_finished" and figures["kv_bytes"] == PROMPT * 1024
    lead.tool_finished("acme/t1", "approval", 1010.1)  # type: ignore[arg-type]
    assert s.sent() == []  # one restore per idle period
    s.index.blocks[W0] = PROMPT // BLOCK  # the copy landed: the events show it in HBM
    s.table.began(next(iter(s.table)), 1010.6)
    used = s.rows.last()
    assert used.action == "restore_used" and "0.60 s" in used.reason
    assert lead.policy.accuracy(KEY) == 1.0


def test_a_restore_its_turn_does_not_find_in_hbm_is_unused() -> None:
    s, lead = demoted()
    lead.tool_finished("acme/t1", "approval", 1010.0)  # type: ignore[arg-type]
    s.sent()
    s.table.began(next(iter(s.table)), 1011.0)  # the index shows nothing back in HBM
    assert s.rows.last().action == "restore_unused"
    assert lead.policy.accuracy(KEY) == 0.0


def test_a_restore_whose_turn_never_comes_is_settled_unused_at_its_holds_end() -> None:
    s, lead = demoted()
    lead.tool_finished("acme/t1", "approval", 1010.0)  # type: ignore[arg-type]
    s.sent()
    s.loop.tick(1010.0 + RESTORE_HOLD_S - 1)
    assert s.rows.last().action == "restore"
    s.loop.tick(1010.0 + RESTORE_HOLD_S)
    row = s.rows.last()
    assert (row.action, row.reason) == ("restore_unused", "no turn came")


def test_only_the_tasks_demoted_sessions_are_restored() -> None:
    s, lead = demoted()
    lead.tool_finished("acme/other", "approval", 1010.0)  # type: ignore[arg-type]
    assert s.sent() == []
    held = build(lead_time=lead_time(PrefetchPolicy()))
    assert held.loop.lead_time is not None
    lead = held.loop.lead_time
    held.turn(held.session("quick", task="acme/t1"), tool="api", wait_s=0.5)
    assert [c[0] for c in held.sent()] == ["hold"]
    lead.tool_finished("acme/t1", "api", 1000.5)  # type: ignore[arg-type]
    assert held.sent() == []  # held in HBM: nothing to restore
    held.table.began(next(iter(held.table)), 1001.25)
    api = PrefetchKey("acme", "api", PrefetchTrigger.TOOL_FINISHED)
    assert lead.policy.lead_s(api) == 0.75  # its lead is measured all the same


def test_no_restore_while_the_worker_has_requests_waiting() -> None:
    s, lead = demoted()
    busy = LoadSnapshot(time=0.0, running=4, waiting=2, kv_cache_usage_perc=0.99)
    s.workers[0] = replace(s.workers[0], load=busy)
    lead.tool_finished("acme/t1", "approval", 1010.0)  # type: ignore[arg-type]
    assert s.sent() == []
    assert s.rows.last().action == "demote"


# --- restore ahead of the predicted return: the wait model's timers ---

DUE = next(e for e in EDGES if e >= 10.0)
"""The first bin edge from 10 s: where `Likely(10.0)` says a turn is due."""
AGAIN = next(e for e in EDGES if e >= DUE + 1.0)
"""The first one a second past it: a recheck's."""


class Likely:
    """A wait model by which every turn is likely (P 0.9) once away `from_s`, not before;
    it writes down the keys asked about."""

    def __init__(self, from_s: float) -> None:
        self.from_s = from_s
        self.keys: set[WaitKey] = set()

    def outlook(
        self, key: WaitKey, idle_s: float, horizon_s: float, hint_s: float | None = None
    ) -> Outlook:
        self.keys.add(key)
        return Outlook(0.9 if idle_s >= self.from_s else 0.0, horizon_s)


def ahead(task: str = "acme/t1") -> tuple[Setup, LeadTime]:
    """`demoted`, with the wait model's signals on: due `DUE` s into the wait."""
    s, lead = demoted(task)
    lead.policy = PrefetchPolicy(PrefetchTuning(prefill=False, triggers=RESTORE_AHEAD_TRIGGERS))
    lead.survival = Likely(10.0)
    return s, lead


def test_a_demoted_session_is_restored_when_its_turn_becomes_likely_with_no_announcement() -> None:
    s, lead = ahead()
    s.loop.tick(1000.5)  # the timer is set
    s.loop.tick(1000.0 + DUE - 0.1)
    assert s.sent() == []
    s.loop.tick(1000.0 + DUE)
    ((kind, worker, key, until_s, _),) = s.sent()
    assert (kind, worker, key, until_s) == (
        "restore",
        W0,
        "acme/slow",
        1000.0 + DUE + RESTORE_HOLD_S,
    )
    row = s.rows.last()
    assert (row.action, row.tokens) == ("restore", PROMPT)
    assert json.loads(row.figures_json or "{}")["trigger"] == "hazard"
    assert isinstance(lead.survival, Likely)
    assert lead.survival.keys == {WaitKey("acme", "approval", 1)}  # the reaper's key
    s.loop.tick(1000.0 + AGAIN + 1.0)
    assert s.sent() == []  # one restore a wait: the client's expected wait's timer too
    s.index.blocks[W0] = PROMPT // BLOCK
    s.table.began(next(iter(s.table)), 1000.0 + DUE + 0.5)
    assert s.rows.last().action == "restore_used"
    hazard = PrefetchKey("acme", "approval", PrefetchTrigger.HAZARD)
    assert lead.policy.accuracy(hazard) == 1.0
    assert lead.policy.lead_s(hazard) == 0.5


def test_the_clients_expected_wait_times_its_own_signal() -> None:
    s, lead = ahead()
    lead.policy = PrefetchPolicy(
        PrefetchTuning(prefill=False, triggers=frozenset({PrefetchTrigger.TOOL_DUE}))
    )
    s.loop.tick(1000.5)
    s.loop.tick(1000.0 + DUE)
    assert [c[0] for c in s.sent()] == ["restore"]
    assert json.loads(s.rows.last().figures_json or "{}")["trigger"] == "tool_due"


def test_a_turn_that_comes_first_drops_the_timer() -> None:
    s, _ = ahead()
    s.loop.tick(1000.5)
    s.table.began(next(iter(s.table)), 1005.0)
    s.loop.tick(1000.0 + DUE)
    assert s.sent() == []
    assert all(r.action != "restore" for r in s.rows.residency)


def test_a_session_still_in_hbm_when_due_is_looked_at_again_while_its_turn_stays_likely() -> None:
    s, lead = ahead()
    s.index.blocks[W0] = PROMPT // BLOCK  # the demotion's blocks are still cached in HBM
    s.loop.tick(1000.5)
    s.loop.tick(1000.0 + DUE)
    assert s.sent() == []  # resident: nothing to restore
    s.index.evict(W0, 0)  # now they are gone from HBM
    s.loop.tick(1000.0 + AGAIN - 0.1)
    assert s.sent() == []
    s.loop.tick(1000.0 + AGAIN)
    assert [c[0] for c in s.sent()] == ["restore"]
    s.table.began(next(iter(s.table)), 1000.0 + AGAIN + 2.0)
    hazard = PrefetchKey("acme", "approval", PrefetchTrigger.HAZARD)
    assert lead.policy.lead_s(hazard) == pytest.approx(AGAIN + 2.0 - DUE)  # its first signal


def test_no_timer_without_the_wait_model_its_signals_or_past_the_horizon() -> None:
    s, lead = ahead()
    lead.horizon_s = DUE
    s.loop.tick(1000.5)
    s.loop.tick(1000.0 + AGAIN)
    assert s.sent() == []
    s, lead = ahead()
    lead.survival = None
    s.loop.tick(1000.5)
    s.loop.tick(1000.0 + AGAIN)
    assert s.sent() == []
    s, lead = ahead()
    lead.policy = PrefetchPolicy(PrefetchTuning(prefill=False))  # `restore_ahead` off
    s.loop.tick(1000.5)
    s.loop.tick(1000.0 + AGAIN)
    assert s.sent() == []


def test_a_session_an_operator_released_is_not_restored() -> None:
    s, _ = ahead()
    s.loop.tick(1000.5)
    s.loop.release(next(iter(s.table)))
    s.sent()
    s.loop.tick(1000.0 + DUE)
    assert s.sent() == []
