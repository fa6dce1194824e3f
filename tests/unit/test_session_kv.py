"""What the state and the operators' session routes show of a session's KV: its prefix by
tier per worker (the KV index's view and the retention connectors' holds) and the decision
standing for it, over the idle reaper's loop with a fake retention port."""

from __future__ import annotations

import pytest

from appliance.api.admin.admin_sessions import residency_rows
from appliance.domain.records import SessionId, TenantId
from appliance.domain.retention import RetainedKv
from appliance.services.residency.session_kv import (
    IN_FLIGHT_REASON,
    NO_DECISION_REASON,
    REAPER_OFF_REASON,
    SessionKv,
    WorkerKv,
)
from tests.unit.test_reaper_loop import PROMPT, W0, W1, Setup, build


@pytest.fixture
def s() -> Setup:
    return build()


def test_the_state_shows_the_prefix_by_tier_and_the_reapers_decision(s: Setup) -> None:
    session = s.session("a")
    s.turn(session, tool="api", wait_s=1.0)
    s.retention.held[W0] = {"acme/a": RetainedKv("acme/a", 96, 1006.0, 0.5)}
    kv = SessionKv(lambda x: {"gpu": {W0: 128, W1: 0}, "host": {W1: 32}}, None, s.loop)
    now = kv.now(session)
    assert now.workers == [
        WorkerKv(W0, gpu=128, held=96, held_until=1006.0, host=0, gone=PROMPT - 128),
        WorkerKv(W1, gpu=0, held=0, held_until=None, host=32, gone=PROMPT - 32),
    ]
    assert now.most() == {"gpu": 128, "host": 32, "gpu_held": 96, "gone": PROMPT - 128}
    assert now.held_until == 1006.0
    assert now.decision == "hold" and now.reason.startswith("hold: HBM has room")
    assert residency_rows(now, 2) == [
        {"worker": W0, "tier": "gpu_held", "tokens": 96, "bytes": 192, "held_until": 1006.0},
        {"worker": W0, "tier": "gpu", "tokens": 32, "bytes": 64},
        {"worker": W1, "tier": "host", "tokens": 32, "bytes": 64},
        {"worker": W0, "tier": "gone", "tokens": 32, "bytes": 64},
        {"worker": W1, "tier": "gone", "tokens": 128, "bytes": 256},
    ]
    assert kv.status()["held"] == 1 and kv.status()["retention"] is True
    s.table.began(session, 1000.5)
    assert kv.now(session).decision is None  # a turn in flight


def test_without_the_reaper_the_state_says_so() -> None:
    kv = SessionKv(lambda x: {})
    assert kv.status() == {"reaper": False, "retention": False, "note": REAPER_OFF_REASON}


def test_a_session_without_a_decision_says_why(s: Setup) -> None:
    kv = SessionKv(lambda x: {"gpu": {W0: 0}}, None, s.loop)
    short = s.table.open(TenantId("acme"), SessionId("short"), s.clock.t)
    assert kv.now(short).reason == NO_DECISION_REASON  # no turn yet
    s.table.hash_prompt(short, list(range(100, 105)), "salt")  # 5 tokens: no full block
    s.table.began(short, s.clock.t)
    assert (kv.now(short).decision, kv.now(short).reason) == (None, IN_FLIGHT_REASON)
    short.home = W0
    s.table.ended(short, s.clock.t)
    assert s.loop.decision_of(short) is None  # the reaper never decides on it
    now = kv.now(short)
    assert now.decision is None
    assert now.reason == "nothing cached: prompt under one block (5 of 16 tokens)"
