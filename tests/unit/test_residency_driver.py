"""The residency driver: the standing decision kept once (whatever the number of sessions),
each idle period's end told once, the room's value and a tenant's bytes only where the policy
weighs them, and the replay and the live loop driving policies through the same one."""

from __future__ import annotations

from dataclasses import dataclass, field

from appliance.policy.reaper import Reaper, ReaperTuning
from appliance.policy.residency import (
    HeldSession,
    IdleSession,
    Lru,
    ResidencyAction,
    ResidencyDecision,
    ResidencyKind,
)
from appliance.replay.kv_residency.residency import PolicyResidency
from appliance.services.residency.residency_driver import ResidencyDriver
from tests.unit.test_reaper_loop import build
from tests.unit.test_replay_reaper import make_setup


@dataclass
class Told:
    """A policy that holds, and writes down what it is asked and told."""

    revisits_holds: bool = True
    tuning: ReaperTuning = field(default_factory=lambda: ReaperTuning(tenant_cap_bytes=100))
    name: str = "told"
    standings: list[ResidencyAction | None] = field(default_factory=list)
    returns: list[tuple[IdleSession, float]] = field(default_factory=list)
    abandoned: list[tuple[IdleSession, float]] = field(default_factory=list)
    ranked: list[HeldSession] = field(default_factory=list)

    def decide(self, session: IdleSession, now: float) -> ResidencyDecision:
        self.standings.append(session.standing)
        return ResidencyDecision(ResidencyAction.HOLD, "held", now + 5.0, ResidencyKind.LRU)

    def priority(self, held: HeldSession, now: float) -> float:
        self.ranked.append(held)
        return float(len(held.session_id))

    def observe_return(self, session: IdleSession, now: float) -> None:
        self.returns.append((session, now))

    def observe_abandoned(self, session: IdleSession, now: float) -> None:
        self.abandoned.append((session, now))


def idle(sid: str = "s", at: float = 0.0, tenant: str = "t", nbytes: int = 10) -> IdleSession:
    return IdleSession(sid, 64, at, tenant=tenant, kv_bytes=nbytes)


def test_asked_again_in_the_same_idle_period_the_policy_is_told_its_standing_decision() -> None:
    told = Told()
    driver = ResidencyDriver(told)
    driver.decide(idle(at=0.0), 0.0)
    driver.decide(idle(at=0.0), 5.0)  # a revisit
    driver.decide(idle(at=9.0), 9.0)  # the next idle period
    assert told.standings == [None, ResidencyAction.HOLD, None]


def test_the_standing_decision_is_kept_for_every_waiting_session_however_many() -> None:
    told = Told()
    driver = ResidencyDriver(told)
    n = 70_000  # past the 65,536 records the reaper kept of its own
    for k in range(n):
        driver.decide(idle(f"s{k}"), 0.0)
    driver.decide(idle("s0"), 5.0)
    assert told.standings[-1] is ResidencyAction.HOLD
    assert driver.returned("s0", 6.0) and told.returns[0][0].session_id == "s0"


def test_each_idle_period_ends_once_with_the_session_as_last_decided_on() -> None:
    told = Told()
    driver = ResidencyDriver(told)
    driver.decide(idle("a", at=1.0), 1.0)
    driver.decide(idle("b", at=2.0), 2.0)
    assert driver.returned("a", 3.0) and not driver.returned("a", 4.0)
    assert driver.abandoned("b", 9.0) and not driver.abandoned("b", 10.0)
    assert not driver.returned("b", 11.0) and not driver.abandoned("never", 1.0)
    assert [(s.session_id, s.finished_at_s, t) for s, t in told.returns] == [("a", 1.0, 3.0)]
    assert [(s.session_id, s.finished_at_s, t) for s, t in told.abandoned] == [("b", 2.0, 9.0)]
    assert driver.standing("a") is None and driver.standing("b") is None


def test_a_hold_is_ranked_with_the_session_it_was_decided_on() -> None:
    told = Told()
    driver = ResidencyDriver(told)
    decided = driver.decide(idle("a"), 0.0).idle
    assert driver.held("a", 64, 0.0, 5.0).idle is decided
    assert driver.held("stranger", 64, 0.0, 5.0).idle is None


def test_the_rooms_value_is_the_lowest_other_hold_and_only_where_it_is_weighed() -> None:
    def asked() -> list[float]:
        raise AssertionError("the other holds were ranked for nothing")

    weighs = ResidencyDriver(Reaper())  # revisits its holds; pressure from 0.8
    assert weighs.hbm_value(0.9, lambda: [3.0, 1.0, 2.0]) == 1.0
    assert weighs.hbm_value(0.9, lambda: []) is None
    assert weighs.hbm_value(0.5, asked) is None
    assert ResidencyDriver(Lru()).hbm_value(1.0, asked) is None


def test_a_tenants_held_bytes_count_its_other_sessions_only_under_a_cap() -> None:
    driver = ResidencyDriver(Told())
    for sid, tenant in (("a", "t"), ("b", "t"), ("c", "other")):
        driver.decide(idle(sid, tenant=tenant), 0.0)
    holds = [("a", 10), ("b", 20), ("c", 40), ("unknown", 80)]
    assert driver.tenant_held_bytes(idle("a"), lambda: holds) == 20
    uncapped = ResidencyDriver(Lru())
    assert uncapped.tenant_held_bytes(idle("a"), lambda: holds) == 0


def test_a_bound_has_the_last_word_and_its_decision_stands() -> None:
    told = Told()

    def quota(session: IdleSession, decision: ResidencyDecision) -> ResidencyDecision:
        return ResidencyDecision(ResidencyAction.RELEASE, "over quota")

    driver = ResidencyDriver(told, bound=quota)
    assert driver.decide(idle(), 0.0).decision.action is ResidencyAction.RELEASE
    driver.decide(idle(), 5.0)
    assert told.standings == [None, ResidencyAction.RELEASE]
    assert driver.actions == {"release": 2} and driver.reasons == {"over quota": 2}


def test_the_replay_and_the_live_loop_drive_the_policy_through_the_same_driver() -> None:
    _, latency = make_setup(workers=1, hbm_gib=1.0)
    replay = PolicyResidency(Lru(), latency=latency, block_size=16)
    live = build(usage=0.9, policy=Lru())
    live.turn(live.session("a"), tool="api", wait_s=1.0)
    assert type(replay.driver) is type(live.loop.driver) is ResidencyDriver
    assert live.loop.driver.actions == {"release": 1}
