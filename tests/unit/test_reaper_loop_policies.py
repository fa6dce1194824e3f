"""The live residency loop runs any residency policy through the protocol (`residency.policy`),
gives the policy the tenant's held bytes and the promotion seconds, and tells a policy that
keeps records of each session it stops following. Over the reaper loop's fakes
(tests/unit/test_reaper_loop.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest

from appliance.config.settings import ResidencySettings
from appliance.ledger.connections import open_writer_connection
from appliance.policy.mori import Mori
from appliance.policy.reaper import Reaper, ReaperTuning
from appliance.policy.residency import (
    HeldSession,
    IdleSession,
    Lru,
    ResidencyDecision,
    TtlPin,
)
from appliance.services.residency import reaper_loop
from appliance.start.wiring_residency import live_residency_policy
from tests.unit.test_reaper_loop import PRIORS, PROMPT, W0, build


@dataclass
class Recorder:
    """Lru, and what the loop tells it: the sessions it decides on, the ends it hears."""

    name: str = "recorder"
    seen: list[IdleSession] = field(default_factory=list)
    abandoned: list[str] = field(default_factory=list)
    returned: list[str] = field(default_factory=list)

    def decide(self, session: IdleSession, now: float) -> ResidencyDecision:
        self.seen.append(session)
        return Lru().decide(session, now)

    def priority(self, held: HeldSession, now: float) -> float:
        return 0.0

    def observe_return(self, session: IdleSession, now: float) -> None:
        self.returned.append(session.session_id)

    def observe_abandoned(self, session: IdleSession, now: float) -> None:
        self.abandoned.append(session.session_id)


def test_the_loop_runs_lru_through_the_protocol() -> None:
    s = build(usage=0.9, policy=Lru())
    s.turn(s.session("a"), tool="api", wait_s=1.0)
    row = s.rows.last()
    assert (row.action, s.rows.figures()["kind"]) == ("release", "lru")
    assert s.sent() == []  # nothing was held: nothing to release
    s.clock.t += 2000.0
    s.loop.tick(s.clock.t)  # past the follow time: it ends unreturned, without a decision
    assert len(s.rows.residency) == 1 and s.loop.status()["policy"] == "lru"


def test_the_loop_runs_ttl_pin_and_lets_its_pin_lapse_on_time() -> None:
    s = build(policy=TtlPin(30.0))
    session = s.session("a")
    s.turn(session, tool="api", wait_s=1.0)
    [(kind, worker, key, until_s, _)] = s.sent()
    assert (kind, worker, key, until_s) == ("hold", W0, "acme/a", 1030.0)  # the TTL, exactly
    assert s.rows.figures()["kind"] == "ttl_pin"
    s.clock.t += 31.0
    s.loop.tick(s.clock.t)  # due: not revisited (ttl-pin is no reaper), not pinned again
    assert s.sent() == [] and len(s.rows.residency) == 1
    assert s.loop.decision_of(session).action == "release"  # type: ignore[union-attr]


def test_the_loop_runs_mori_through_the_protocol() -> None:
    s = build(policy=Mori())
    s.turn(s.session("a"), tool="api", wait_s=1.0)
    assert (s.rows.last().action, s.rows.figures()["kind"]) == ("hold", "pool_free")
    assert s.sent()[0][0] == "hold"


def test_the_tenant_cap_holds_live() -> None:
    """Each session's KV is 160 tokens x 1 KiB: the cap fits one hold, not two."""
    tuning = ReaperTuning(tenant_cap_bytes=200_000, kv_bytes_per_token=1024)
    s = build(policy=Reaper(priors=PRIORS, tuning=tuning))
    s.turn(s.session("a"), tool="api", wait_s=1.0)
    assert (s.rows.last().action, s.rows.figures()["kind"]) == ("hold", "pool_free")
    s.turn(s.session("b"), tool="api", wait_s=1.0)  # the same tenant, the same worker
    row = s.rows.last()
    assert (row.session_id, row.action, s.rows.figures()["kind"]) == (
        "acme/b",
        "release",
        "tenant_cap",
    )


def test_the_policy_is_told_the_promotion_seconds() -> None:
    recorder = Recorder()
    s = build(policy=recorder, copy_in_s=lambda tokens: tokens * 1e-5)
    s.turn(s.session("a"), tool="api", wait_s=1.0)
    [seen] = recorder.seen
    assert seen.promote_s == pytest.approx(PROMPT * 1e-5)


def test_a_session_no_longer_followed_ends_unreturned_for_the_policy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(reaper_loop, "MAX_WAITING", 2)
    recorder = Recorder()
    s = build(policy=recorder)
    for sid in ("a", "b", "c"):
        s.turn(s.session(sid), tool="api", wait_s=1.0)
        s.clock.t += 1.0
    assert recorder.abandoned == ["acme/a"]  # its wait, censored: it waited this long at least
    assert set(s.loop.waiting_sessions()) == {"acme/b", "acme/c"}


@pytest.mark.parametrize(
    ("name", "kind"), [("lru", Lru), ("ttl-pin", TtlPin), ("mori", Mori), ("reaper", Reaper)]
)
def test_the_setting_names_the_policy(name: str, kind: type, tmp_path: Path) -> None:
    ledger = tmp_path / "ledger.db"
    open_writer_connection(ledger, synchronous="normal", busy_timeout_s=1.0).close()
    r = ResidencySettings(policy=name, tenant_cap_bytes=1 << 30)  # type: ignore[arg-type]
    policy = live_residency_policy(
        r, kv_bytes_per_token=1024, ledger_path=ledger, window=(0, 1), limit=10
    )
    assert isinstance(policy, kind)
    if isinstance(policy, Reaper):
        assert policy.tuning.tenant_cap_bytes == 1 << 30
        assert policy.tuning.kv_bytes_per_token == 1024
