"""Residency policies as tables: the decision for a finished turn, the eviction order among
held sessions, and the names `--residency` accepts."""

from __future__ import annotations

import pytest

from appliance.policy.prefetch import PrefetchTrigger
from appliance.policy.reaper import Reaper
from appliance.policy.residency import (
    DEFAULT_PIN_TTL_S,
    DEFAULT_TENANT,
    HeldSession,
    IdleSession,
    Lru,
    ResidencyAction,
    ResidencyDecision,
    ResidencyKind,
    TtlPin,
)
from appliance.policy.residency_by_name import RESIDENCY_NAMES, residency_plan, residency_policy
from appliance.policy.survival import WaitKey
from appliance.policy.wait_curves import LogNormal


def idle(tool: bool | None = None, **kw: object) -> IdleSession:
    base: dict[str, object] = {
        "session_id": "s",
        "resident_tokens": 4096,
        "finished_at_s": 10.0,
        "ends_in_tool_call": tool,
    }
    return IdleSession(**{**base, **kw})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("policy", "session", "now", "action", "until_s", "reason"),
    [
        (Lru(), idle(None), 10.0, ResidencyAction.RELEASE, None, "least recently used goes first"),
        (Lru(), idle(True, kv_usage=0.1), 10.0, ResidencyAction.RELEASE, None, "least recently"),
        (Lru(), idle(False, kv_usage=0.99), 10.0, ResidencyAction.RELEASE, None, "least recently"),
        (TtlPin(30.0), idle(None), 10.0, ResidencyAction.HOLD, 40.0, "pinned for the 30 s TTL"),
        (
            TtlPin(30.0),
            idle(True, expected_wait_s=500.0),
            10.0,
            ResidencyAction.HOLD,
            40.0,
            "pinned",
        ),
        (TtlPin(30.0), idle(True, kv_usage=0.99), 12.5, ResidencyAction.HOLD, 42.5, "pinned"),
        (TtlPin(30.0), idle(False), 10.0, ResidencyAction.RELEASE, None, "last step"),
        (TtlPin(), idle(None), 0.0, ResidencyAction.HOLD, DEFAULT_PIN_TTL_S, "pinned for the 60 s"),
    ],
)
def test_decisions(
    policy: Lru | TtlPin,
    session: IdleSession,
    now: float,
    action: ResidencyAction,
    until_s: float | None,
    reason: str,
) -> None:
    decision = policy.decide(session, now)
    assert decision.action is action
    assert decision.until_s == until_s
    assert reason in decision.reason


HELD = [
    HeldSession("old", 2048, held_since_s=1.0, until_s=61.0),
    HeldSession("mid", 512, held_since_s=5.0, until_s=35.0),  # a shorter hold, same policy
    HeldSession("new", 8192, held_since_s=9.0, until_s=69.0),
]


@pytest.mark.parametrize(
    ("policy", "given_back_first_to_last"),
    [
        (Lru(), ["old", "mid", "new"]),  # least recently used first
        (TtlPin(60.0), ["new", "old", "mid"]),  # Continuum: the latest expiry first
    ],
)
def test_eviction_order(policy: Lru | TtlPin, given_back_first_to_last: list[str]) -> None:
    order = sorted(HELD, key=lambda h: policy.priority(h, now=10.0))
    assert [h.session_id for h in order] == given_back_first_to_last


@pytest.mark.parametrize(
    ("name", "kind", "ttl_s", "row"),
    [
        ("lru", Lru, None, "lru"),
        ("ttl-pin", TtlPin, DEFAULT_PIN_TTL_S, "ttl-pin"),
        ("ttl-pin:30", TtlPin, 30.0, "ttl-pin:30"),
        ("ttl-pin:2.5", TtlPin, 2.5, "ttl-pin:2.5"),
        ("ttl-pin:120.0", TtlPin, 120.0, "ttl-pin:120"),
        ("ttl-pin:0.5", TtlPin, 0.5, "ttl-pin:0.5"),  # under a second is still positive
        ("reaper", Reaper, None, "reaper"),
    ],
)
def test_names(name: str, kind: type, ttl_s: float | None, row: str) -> None:
    policy = residency_policy(name)
    assert isinstance(policy, kind) and policy.name == row
    if ttl_s is not None:
        assert isinstance(policy, TtlPin) and policy.ttl_s == ttl_s


@pytest.mark.parametrize(
    ("name", "needle"),
    [
        ("mru", "unknown residency policy 'mru'"),
        ("lru:5", "unknown residency policy 'lru:5'"),
        ("reaper:5", "unknown residency policy 'reaper:5'"),
        ("ttl-pin:soon", "needs a number of seconds"),
        ("ttl-pin:0", "positive, finite TTL"),
        ("ttl-pin:-3", "positive, finite TTL"),
        ("ttl-pin:inf", "positive, finite TTL"),
    ],
)
def test_bad_names(name: str, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        residency_policy(name)


@pytest.mark.parametrize(
    ("action", "until_s"),
    [(ResidencyAction.HOLD, None), (ResidencyAction.RELEASE, 5.0), (ResidencyAction.EVICT, 5.0)],
)
def test_only_a_hold_carries_an_expiry(action: ResidencyAction, until_s: float | None) -> None:
    with pytest.raises(ValueError, match=r"^a HOLD, and only a HOLD, carries until_s$"):
        ResidencyDecision(action, "x", until_s)


@pytest.mark.parametrize(
    ("policy", "session", "reason"),
    [
        (Lru(), idle(True), "least recently used goes first"),
        (TtlPin(30.0), idle(False), "last step: nothing to pin for"),
        (TtlPin(30.0), idle(None), "pinned for the 30 s TTL"),
        (TtlPin(0.5), idle(True), "pinned for the 0.5 s TTL"),
    ],
    ids=["lru releases", "ttl-pin releases a last step", "ttl-pin pins", "ttl-pin, a short TTL"],
)
def test_each_decision_states_its_exact_reason(
    policy: Lru | TtlPin, session: IdleSession, reason: str
) -> None:
    assert policy.decide(session, 10.0).reason == reason


def test_a_ttl_under_a_second_pins_for_that_long() -> None:
    decision = TtlPin(0.5).decide(idle(True), now=10.0)
    assert (decision.action, decision.until_s) == (ResidencyAction.HOLD, 10.5)


@pytest.mark.parametrize("name", RESIDENCY_NAMES)
def test_every_listed_name_builds_its_policy(name: str) -> None:
    assert residency_policy(name).name == name


@pytest.mark.parametrize(
    ("policy", "session", "kind"),
    [
        (Lru(), idle(True), ResidencyKind.LRU),
        (TtlPin(30.0), idle(None), ResidencyKind.TTL_PIN),
        (TtlPin(30.0), idle(False), ResidencyKind.LAST_STEP),
    ],
)
def test_the_baselines_decisions_carry_a_fixed_kind(
    policy: Lru | TtlPin, session: IdleSession, kind: ResidencyKind
) -> None:
    assert policy.decide(session, 10.0).kind is kind


@pytest.mark.parametrize(
    ("name", "triggers", "branches"),
    [
        ("reaper", None, False),
        ("reaper+lead-time", frozenset({PrefetchTrigger.TOOL_FINISHED}), False),
        ("reaper+lead-time:tool_finished", frozenset({PrefetchTrigger.TOOL_FINISHED}), False),
        (
            "reaper+lead-time:hazard,tool_due",
            frozenset({PrefetchTrigger.HAZARD, PrefetchTrigger.TOOL_DUE}),
            False,
        ),
        ("reaper+branches", None, True),
        ("reaper+lead-time+branches", frozenset({PrefetchTrigger.TOOL_FINISHED}), True),
        (
            "reaper+lead-time:tool_finished,tool_due,hazard+branches",
            frozenset(PrefetchTrigger),
            True,
        ),
    ],
)
def test_the_reapers_options_by_name(
    name: str, triggers: frozenset[PrefetchTrigger] | None, branches: bool
) -> None:
    plan = residency_plan(name)
    assert isinstance(plan.policy, Reaper) and plan.policy.name == name
    assert (plan.prefetch.tuning.triggers if plan.prefetch else None) == triggers
    assert (plan.branches is not None) == branches


@pytest.mark.parametrize(
    ("name", "needle"),
    [
        ("lru+lead-time", "only the reaper"),
        ("reaper+lead-time:soon", "lead-time triggers are"),
        ("reaper+pin", "unknown residency option 'pin'"),
        ("reaper+branches:3", "unknown residency option"),
        ("reaper+lead-time+lead-time", "unknown residency option"),
    ],
)
def test_bad_options(name: str, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        residency_plan(name)


@pytest.mark.parametrize("name", ["reaper", "reaper+lead-time", "reaper+branches"])
def test_the_reaper_of_every_name_takes_the_priors(name: str) -> None:
    priors = {"test": LogNormal(600.0, 0.05)}  # tests take ten minutes, always
    key = WaitKey(DEFAULT_TENANT, "test")
    for policy in (
        residency_plan(name, priors=priors).policy,
        residency_policy(name, priors=priors),
    ):
        assert isinstance(policy, Reaper)
        assert policy.survival.p_return_within(key, 0.0, 60.0) < 0.01
    assert residency_policy(name).survival.p_return_within(key, 0.0, 60.0) > 0.1  # type: ignore[attr-defined]


def test_a_bad_trigger_names_the_known_ones() -> None:
    with pytest.raises(ValueError) as bad:
        residency_plan("reaper+lead-time:soon")
    assert str(bad.value) == "lead-time triggers are tool_finished, tool_due, hazard, got 'soon'"
