"""The idle reaper's residency policy: its decisions at both sides of each boundary of its
cost inequality, its margins, limits and caps, what it learns from the returns and
abandonments reported to it, and the properties of its eviction order."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import given
from hypothesis import strategies as st

from appliance.policy.reaper import (
    DEFAULT_DISPLACED_WAIT_S,
    DEFAULT_MAX_RESIDENCY_S,
    Reaper,
    ReaperTuning,
    value_density,
)
from appliance.policy.residency import (
    HeldSession,
    HostTierReading,
    IdleSession,
    ResidencyAction,
    ResidencyKind,
)
from appliance.policy.survival import Outlook, WaitKey, WaitSurvival
from appliance.policy.wait_curves import LogNormal

MAX_S = DEFAULT_MAX_RESIDENCY_S
KB = 1000  # the sessions' KV bytes below: 1,000 bytes, so costs are round numbers


@dataclass
class Fixed:
    """A wait model with set answers per tool class, (P(return), E[W]), that keeps what it
    is taught."""

    answers: dict[str | None, tuple[float, float]]
    gaps: list[tuple[WaitKey, float, float | None]] = field(default_factory=list)
    censored: list[tuple[WaitKey, float]] = field(default_factory=list)
    asked: list[tuple[WaitKey, float, float, float | None]] = field(default_factory=list)

    def observe_gap(self, key: WaitKey, gap_s: float, hint_s: float | None = None) -> None:
        self.gaps.append((key, gap_s, hint_s))

    def observe_censored(self, key: WaitKey, idle_s: float) -> None:
        self.censored.append((key, idle_s))

    def outlook(
        self, key: WaitKey, idle_s: float, horizon_s: float, hint_s: float | None = None
    ) -> Outlook:
        self.asked.append((key, idle_s, horizon_s, hint_s))
        return Outlook(*self.answers[key.tool_class])


def exact(p: float = 0.5, wait_s: float = 10.0, **kw: float) -> Reaper:
    """A reaper without margins whose waits are P = p, E[W] = wait_s for every session."""
    settings: dict[str, float] = {"hysteresis": 0.0, "min_gain_s": 0.0, **kw}
    return Reaper(Fixed({None: (p, wait_s)}), tuning=ReaperTuning(**settings))  # type: ignore[arg-type]


def idle(**kw: object) -> IdleSession:
    """1,000 bytes whose re-prefill takes 1 s, in a full HBM pool, its turn done at 0 in a
    tool call."""
    base: dict[str, object] = {
        "session_id": "s",
        "resident_tokens": 64,
        "finished_at_s": 0.0,
        "ends_in_tool_call": True,
        "kv_bytes": KB,
        "recompute_s": 1.0,
        "kv_usage": 1.0,
    }
    return IdleSession(**{**base, **kw})  # type: ignore[arg-type]


def host(
    value: float | None = 0.0, *, usage: float = 1.0, free_bytes: int = 10**6
) -> HostTierReading:
    return HostTierReading(free_bytes=free_bytes, usage=usage, value=value)


BELOW, ABOVE = 1 - 1e-9, 1 + 1e-9
# With P = 0.5, E[W] = 10 s and 1,000 bytes: C_release = 0.5 x 1 s = 0.5 s and
# C_hold = v x 1,000 x 10 = 1e4 v, even at v = 5e-5 s per byte-second. With a host tier
# promoting in 0.2 s: C_demote = 1e4 v_host + 0.5 x 0.2 s.
BOUNDARIES = [
    # (description, session, action, kind)
    ("hold just cheaper than release", idle(hbm_value=5e-5 * BELOW), "hold", "hold_cheapest"),
    ("hold just dearer than release", idle(hbm_value=5e-5 * ABOVE), "release", "release_cheapest"),
    # 90% usage, pressure from 80%: half the value counts, the break-even doubles.
    (
        "half pressure, just below",
        idle(kv_usage=0.9, hbm_value=1e-4 * BELOW),
        "hold",
        "hold_cheapest",
    ),
    (
        "half pressure, just above",
        idle(kv_usage=0.9, hbm_value=1e-4 * ABOVE),
        "release",
        "release_cheapest",
    ),
    (
        "demote just cheaper than release",
        idle(hbm_value=1.0, host=host(4e-5 * BELOW), promote_s=0.2),
        "demote",
        "demote_cheapest",
    ),
    (
        "demote just dearer than release",
        idle(hbm_value=1.0, host=host(4e-5 * ABOVE), promote_s=0.2),
        "release",
        "release_cheapest",
    ),
    (
        "hold just cheaper than demote",
        idle(hbm_value=1e-5 * BELOW, host=host(usage=0.0), promote_s=0.2),
        "hold",
        "hold_cheapest",
    ),
    (
        "hold just dearer than demote",
        idle(hbm_value=1e-5 * ABOVE, host=host(usage=0.0), promote_s=0.2),
        "demote",
        "demote_cheapest",
    ),
]


@pytest.mark.parametrize(
    ("session", "action", "kind"), [row[1:] for row in BOUNDARIES], ids=[r[0] for r in BOUNDARIES]
)
def test_the_cheapest_action_wins_at_both_sides_of_each_boundary(
    session: IdleSession, action: str, kind: str
) -> None:
    decision = exact().decide(session, now=0.0)
    assert (decision.action, decision.kind) == (action, kind)


@pytest.mark.parametrize(
    ("p", "wait_s", "action"),
    [
        (1.0, DEFAULT_DISPLACED_WAIT_S * BELOW, "hold"),
        (1.0, DEFAULT_DISPLACED_WAIT_S * ABOVE, "release"),
        (0.5, DEFAULT_DISPLACED_WAIT_S / 2 * BELOW, "hold"),
        (0.5, DEFAULT_DISPLACED_WAIT_S / 2 * ABOVE, "release"),
    ],
)
def test_a_full_pool_without_a_stated_value_holds_what_is_back_sooner_than_the_displaced(
    p: float, wait_s: float, action: str
) -> None:
    # By default full HBM is worth what it saves a session like this one sure to be back
    # within the displaced wait: hold when P x that wait > E[W].
    assert exact(p, wait_s).decide(idle(), now=0.0).action == action


@pytest.mark.parametrize("usage", [0.0, 0.5, 0.8])
def test_a_pool_with_room_holds_at_no_cost_however_dear_its_bytes(usage: float) -> None:
    decision = exact(p=0.3, wait_s=MAX_S).decide(idle(kv_usage=usage, hbm_value=1e9), now=0.0)
    assert (decision.action, decision.kind) == ("hold", "pool_free")
    assert decision.figures is not None
    assert (decision.figures.v_hbm, decision.figures.c_hold) == (0.0, 0.0)


@pytest.mark.parametrize(
    ("p", "action", "kind"),
    [(0.02 * ABOVE, "hold", "pool_free"), (0.02, "evict", "not_returning")],
)
def test_a_session_unlikely_to_be_back_in_time_goes_first(p: float, action: str, kind: str) -> None:
    decision = exact(p).decide(idle(kv_usage=0.0), now=0.0)
    assert (decision.action, decision.kind) == (action, kind)


def test_a_last_step_is_evicted_however_much_room() -> None:
    decision = exact(p=1.0).decide(idle(kv_usage=0.0, ends_in_tool_call=False), now=0.0)
    assert (decision.action, decision.kind) == ("evict", "last_step")


def test_each_figure_is_the_product_the_rule_states() -> None:
    reaper = exact(p=0.5, wait_s=10.0, second_value=2.0)
    session = idle(kv_usage=0.9, hbm_value=3e-5, host=host(1e-5), promote_s=0.2)
    figures = reaper.decide(session, now=0.0).figures
    assert figures is not None
    assert figures.p_return == 0.5 and figures.expected_wait_s == 10.0
    assert figures.horizon_s == MAX_S
    assert figures.v_hbm == pytest.approx(1.5e-5)  # half pressure
    assert figures.c_hold == pytest.approx(1.5e-5 * KB * 10.0)
    assert figures.c_release == pytest.approx(0.5 * 2.0 * 1.0)  # a second of prefill: 2
    assert figures.v_host == pytest.approx(1e-5)
    assert figures.c_demote == pytest.approx(1e-5 * KB * 10.0 + 0.5 * 2.0 * 0.2)


def test_a_dearer_second_of_prefill_makes_a_hold_worth_its_bytes() -> None:
    session = idle(hbm_value=7e-5)  # C_hold 0.7 s against C_release 0.5 s at 1 s of value
    assert exact().decide(session, now=0.0).action == "release"
    assert exact(second_value=2.0).decide(session, now=0.0).action == "hold"


def test_the_reason_names_the_action_and_its_figures() -> None:
    reason = exact().decide(idle(hbm_value=1e-5, host=host(0.0), promote_s=0.2), 0.0).reason
    assert reason == (
        "hold: holding is cheapest; P 0.50 back within 1800 s, E[W] 10 s; "
        "hold 0.1, demote 0.1, release 0.5 s"
    )


# Without a host tier, or without room in it, nothing is demoted.


@given(
    p=st.floats(0, 1),
    wait_s=st.floats(0, MAX_S),
    usage=st.floats(0, 1),
    value=st.floats(0, 1) | st.none(),
    kv_bytes=st.integers(1, 2**40),
    recompute_s=st.floats(0, 100),
    promote_s=st.floats(0, 100),
)
def test_without_a_host_tier_nothing_is_demoted(
    p: float,
    wait_s: float,
    usage: float,
    value: float | None,
    kv_bytes: int,
    recompute_s: float,
    promote_s: float,
) -> None:
    session = idle(
        kv_usage=usage,
        hbm_value=value,
        kv_bytes=kv_bytes,
        recompute_s=recompute_s,
        promote_s=promote_s,
    )
    assert exact(p, wait_s).decide(session, now=0.0).action != "demote"


def test_a_host_tier_without_room_for_the_session_takes_nothing() -> None:
    session = idle(hbm_value=1.0, host=host(0.0, free_bytes=KB - 1), promote_s=0.0)
    assert exact().decide(session, now=0.0).action == "release"
    roomy = idle(hbm_value=1.0, host=host(0.0, free_bytes=KB), promote_s=0.0)
    assert exact().decide(roomy, now=0.0).action == "demote"


# Margins: a change must gain a share of the standing cost and a minimum.


@pytest.mark.parametrize(
    ("hold_over_release", "action", "kind"),
    [(0.74, "hold", "hold_cheapest"), (0.76, "release", "within_margin")],
)
def test_a_first_hold_must_beat_releasing_by_the_margin(
    hold_over_release: float, action: str, kind: str
) -> None:
    # C_release = 0.5 s; C_hold = 1e4 v. Hysteresis 0.25: a hold under 0.75 x C_release.
    session = idle(hbm_value=5e-5 * hold_over_release)
    decision = exact(hysteresis=0.25).decide(session, now=0.0)
    assert (decision.action, decision.kind) == (action, kind)


@pytest.mark.parametrize(
    ("hold_over_release", "action", "kind"),
    [(1.3, "hold", "within_margin"), (1.4, "release", "release_cheapest")],
)
def test_a_standing_hold_is_dropped_only_when_releasing_is_cheaper_by_the_margin(
    hold_over_release: float, action: str, kind: str
) -> None:
    # Standing hold: dropped when C_release < 0.75 x C_hold, i.e. C_hold > 1.33 x C_release.
    reaper = exact(hysteresis=0.25)
    assert reaper.decide(idle(kv_usage=0.0), now=0.0).action == "hold"
    again = idle(hbm_value=5e-5 * hold_over_release, standing=ResidencyAction.HOLD)
    decision = reaper.decide(again, now=5.0)
    assert (decision.action, decision.kind) == (action, kind)


@pytest.mark.parametrize(
    ("recompute_s", "action"), [(0.0049, "release"), (0.005, "release"), (0.0051, "hold")]
)
def test_a_hold_must_save_a_minimum(recompute_s: float, action: str) -> None:
    reaper = exact(p=1.0, min_gain_s=0.005)
    assert reaper.decide(idle(kv_usage=0.0, recompute_s=recompute_s), now=0.0).action == action


@given(st.lists(st.floats(0.85, 1.15), min_size=1, max_size=20))
def test_a_hold_does_not_flap_while_pressure_jitters_around_break_even(
    jitter: list[float],
) -> None:
    reaper = Reaper(Fixed({None: (0.5, 10.0)}))  # default margins
    standing = reaper.decide(idle(hbm_value=5e-5 * 0.7), now=0.0).action
    assert standing == "hold"
    for k, factor in enumerate(jitter, start=1):
        again = idle(hbm_value=5e-5 * factor, standing=standing)
        standing = reaper.decide(again, now=float(k)).action
        assert standing == "hold"


def test_a_new_idle_period_starts_without_the_last_ones_decision() -> None:
    reaper = exact(hysteresis=0.25)
    assert reaper.decide(idle(kv_usage=0.0), now=0.0).action == "hold"
    later = idle(hbm_value=5e-5 * 1.3, finished_at_s=100.0)  # within the margin of a hold
    assert reaper.decide(later, now=100.0).action == "release"


# The maximum residency, the revisits, the tenant cap.


@pytest.mark.parametrize("idle_s", [MAX_S, MAX_S + 1, 10 * MAX_S])
def test_no_session_is_held_past_the_maximum_residency(idle_s: float) -> None:
    decision = exact(p=1.0, wait_s=0.0).decide(idle(kv_usage=0.0), now=idle_s)
    assert (decision.action, decision.kind) == ("evict", "max_residency")


@given(
    p=st.floats(0.03, 1),
    wait_s=st.floats(0, MAX_S),
    idle_s=st.floats(0, MAX_S * 0.999),
    usage=st.floats(0, 1),
)
def test_a_hold_lapses_after_now_and_by_the_maximum_residency(
    p: float, wait_s: float, idle_s: float, usage: float
) -> None:
    decision = exact(p, wait_s).decide(idle(kv_usage=usage, finished_at_s=7.0), now=7.0 + idle_s)
    if decision.action is ResidencyAction.HOLD:
        assert decision.until_s is not None
        assert 7.0 + idle_s < decision.until_s <= 7.0 + MAX_S


def revisits(reaper: Reaper, session: IdleSession) -> list[tuple[float, str]]:
    """(idle time, action) of each decision, deciding again whenever a hold lapses."""
    out, now = [], session.finished_at_s
    while True:
        decision = reaper.decide(session, now)
        out.append((now - session.finished_at_s, str(decision.action)))
        if decision.until_s is None:
            return out
        now = decision.until_s


def test_a_hold_is_revisited_each_time_its_idle_time_doubles_until_the_maximum_residency() -> None:
    steps = revisits(exact(p=0.9), idle(kv_usage=0.0, finished_at_s=3.0))
    assert [idle_s for idle_s, _ in steps] == [
        0,
        1,
        2,
        4,
        8,
        16,
        32,
        64,
        128,
        256,
        512,
        1024,
        MAX_S,
    ]
    assert [action for _, action in steps] == ["hold"] * 12 + ["evict"]


PRIORS = {"file": LogNormal.from_median_p95(0.05, 1.0)}  # the workload config's file tool


def test_a_hold_lapses_when_the_waits_hazard_no_longer_pays_for_its_bytes() -> None:
    # Under pressure a file read is held while it is likely back soon; the longer it is
    # away, the less likely it is back soon, and at some revisit it is let go.
    reaper = Reaper(priors=PRIORS)
    session = idle(tool_class="file", kv_usage=0.9, recompute_s=0.26, kv_bytes=2**30)
    steps = revisits(reaper, session)
    assert steps[0] == (0.0, "hold")
    assert steps[-1][1] in ("release", "evict") and steps[-1][0] < MAX_S


@pytest.mark.parametrize(
    ("held_bytes", "tier", "action", "kind"),
    [
        (9 * KB, None, "hold", "hold_cheapest"),  # exactly at the cap
        (9 * KB + 1, None, "release", "tenant_cap"),
        (9 * KB + 1, host(usage=0.0), "demote", "tenant_cap"),
    ],
)
def test_a_hold_never_takes_the_tenant_past_its_cap(
    held_bytes: int, tier: HostTierReading | None, action: str, kind: str
) -> None:
    reaper = exact(tenant_cap_bytes=10 * KB)
    session = idle(hbm_value=1e-5, tenant_held_bytes=held_bytes, host=tier, promote_s=0.4)
    decision = reaper.decide(session, now=0.0)
    assert (decision.action, decision.kind) == (action, kind)


def test_a_held_session_over_a_lowered_cap_is_let_go_whatever_the_margin() -> None:
    reaper = exact(hysteresis=0.9, tenant_cap_bytes=10 * KB)
    assert reaper.decide(idle(kv_usage=0.0), now=0.0).action == "hold"
    over = idle(hbm_value=1e-5, tenant_held_bytes=9 * KB + 1, standing=ResidencyAction.HOLD)
    assert reaper.decide(over, now=1.0).action == "release"


# Learning from what the caller reports.


def test_a_return_teaches_the_gap_and_the_hint_under_the_sessions_key() -> None:
    model = Fixed({"test": (0.5, 10.0)})
    reaper = Reaper(model)
    reaper.observe_return(idle(tenant="acme", tool_class="test", expected_wait_s=30.0), 0.25)
    assert model.gaps == [(WaitKey("acme", "test"), 0.25, 30.0)]
    assert model.censored == []


def test_an_abandonment_teaches_a_censored_wait() -> None:
    model = Fixed({"test": (0.5, 10.0)})
    reaper = Reaper(model)
    reaper.observe_abandoned(idle(tenant="acme", tool_class="test", finished_at_s=100.0), 100.5)
    assert model.censored == [(WaitKey("acme", "test"), 0.5)]
    assert model.gaps == []


def test_a_class_seen_coming_back_quickly_earns_its_holds_under_pressure() -> None:
    reaper = Reaper(WaitSurvival(half_life_obs=1e9))
    session = idle(tool_class="probe", kv_usage=0.9, recompute_s=0.26, kv_bytes=2**30)
    assert reaper.decide(session, now=0.0).action == "release"  # the default prior: slow
    for k in range(200):
        turn = idle(session_id=f"t{k}", tool_class="probe", finished_at_s=10.0 * k)
        reaper.decide(turn, now=10.0 * k)
        reaper.observe_return(turn, now=10.0 * k + 0.5)
    assert reaper.decide(session, now=0.0).action == "hold"


# The eviction order: value density, the lowest given back first.

probabilities = st.floats(0, 1)
waits = st.floats(0, MAX_S)
sizes = st.integers(1, 2**40)
prefills = st.floats(1e-3, 100)


@given(probabilities, probabilities, waits, waits, sizes, prefills)
def test_a_sooner_surer_return_is_worth_more_per_byte(
    p1: float, p2: float, w1: float, w2: float, kv_bytes: int, saved_s: float
) -> None:
    (p_soon, p_late), (w_soon, w_late) = sorted((p1, p2), reverse=True), sorted((w1, w2))
    assert value_density(p_soon, w_soon, saved_s, kv_bytes) >= value_density(
        p_late, w_late, saved_s, kv_bytes
    )


def held(session_id: str, tokens: int = 64, decided: IdleSession | None = None) -> HeldSession:
    """A hold, with the session as it was decided on (None: one the reaper never saw)."""
    return HeldSession(session_id, tokens, held_since_s=0.0, until_s=60.0, idle=decided)


@given(probabilities, probabilities, waits, waits, sizes, prefills, st.floats(0, MAX_S))
def test_a_session_sure_to_return_sooner_is_never_given_back_before_one_that_is_not(
    p1: float, p2: float, w1: float, w2: float, kv_bytes: int, recompute_s: float, now: float
) -> None:
    (p_soon, p_late), (w_soon, w_late) = sorted((p1, p2), reverse=True), sorted((w1, w2))
    reaper = Reaper(Fixed({"soon": (p_soon, w_soon), "late": (p_late, w_late)}))
    soon, late = (
        held(name, decided=idle(tool_class=name, kv_bytes=kv_bytes, recompute_s=recompute_s))
        for name in ("soon", "late")
    )
    assert reaper.priority(soon, now) >= reaper.priority(late, now)


@given(probabilities, waits, sizes, sizes, prefills)
def test_of_two_sessions_alike_but_in_size_the_larger_is_given_back_first(
    p: float, wait_s: float, b1: int, b2: int, recompute_s: float
) -> None:
    small, large = sorted((b1, b2))
    reaper = Reaper(Fixed({None: (p, wait_s)}))
    h_small, h_large = (
        held("s", decided=idle(kv_bytes=kv_bytes, recompute_s=recompute_s))
        for kv_bytes in (small, large)
    )
    assert reaper.priority(h_large, 1.0) <= reaper.priority(h_small, 1.0)


@given(st.floats(0.01, 100), st.floats(100, 1000), st.floats(0, 0.005))
def test_by_class_priors_a_tool_that_ends_sooner_is_kept_longer(
    median_s: float, ratio: float, idle_s: float
) -> None:
    # Narrow waits (p95 = 1.05 x median), the slow one at least 100x the fast one.
    priors = {
        "fast": LogNormal.from_median_p95(median_s, 1.05 * median_s),
        "slow": LogNormal.from_median_p95(median_s * ratio, 1.05 * median_s * ratio),
    }
    reaper = Reaper(priors=priors)
    fast, slow = (held(name, decided=idle(tool_class=name)) for name in ("fast", "slow"))
    assert reaper.priority(fast, idle_s) >= reaper.priority(slow, idle_s)


def test_a_session_past_the_maximum_residency_or_done_is_worth_nothing() -> None:
    reaper = exact(p=1.0, wait_s=1.0)
    done = held("done", decided=idle(ends_in_tool_call=False))
    old = held("old", decided=idle(finished_at_s=1000.0))
    assert reaper.priority(done, now=1.0) == 0.0
    assert reaper.priority(old, now=1000.0 + MAX_S) == 0.0
    assert reaper.priority(old, now=1000.0 + MAX_S - 1) > 0.0


def test_a_session_the_reaper_never_saw_ranks_as_a_new_one_of_its_size() -> None:
    reaper = Reaper()
    twin = held("twin", 640, decided=IdleSession("twin", 640, finished_at_s=0.0))
    assert reaper.priority(held("stranger", 640), 5.0) == reaper.priority(twin, 5.0)


# What existing callers send still gets an answer.


def test_a_session_described_only_by_the_original_fields_is_decided() -> None:
    reaper = Reaper()
    session = IdleSession("s", 4096, finished_at_s=10.0, recompute_s=0.13, kv_usage=0.2)
    decision = reaper.decide(session, now=10.0)
    assert (decision.action, decision.kind) == ("hold", "pool_free")
    bare = reaper.decide(IdleSession("t", 4096, finished_at_s=10.0), now=10.0)
    assert bare.kind in set(ResidencyKind)


@pytest.mark.parametrize(
    ("setting", "value"),
    [
        ("max_residency_s", 0.0),
        ("second_value", float("inf")),
        ("displaced_wait_s", -1.0),
        ("pressure_from", 1.0),
        ("hysteresis", -0.1),
        ("p_gone", 1.0),
        ("min_gain_s", -0.001),
        ("hysteresis", 1.0),
        ("pressure_from", -0.1),
        ("kv_bytes_per_token", 0),
        ("prefill_tokens_per_s", float("nan")),
        ("copy_bytes_per_s", -5.0),
    ],
)
def test_settings_out_of_range_are_refused(setting: str, value: float) -> None:
    with pytest.raises(ValueError, match=setting):
        ReaperTuning(**{setting: value})  # type: ignore[arg-type]


def test_a_session_the_host_tier_takes_back_cheaply_is_given_back_before_one_it_cannot() -> None:
    reaper = exact(p=1.0, wait_s=1.0)
    holds = {
        "promotable": held("p", decided=idle(host=host(free_bytes=KB))),  # 20 ns
        "no room": held("r", decided=idle(host=host(free_bytes=0), promote_s=0.1)),
        "no tier": held("t", decided=idle()),
    }
    order = sorted(holds, key=lambda s: reaper.priority(holds[s], 1.0))
    assert order[0] == "promotable"
    assert reaper.priority(holds["no room"], 1.0) == reaper.priority(holds["no tier"], 1.0)


def test_unstated_sizes_and_speeds_are_the_bundled_profiles() -> None:
    # 3,000 tokens of Llama-3-8B (128 KiB a token), prefilled at 30k tokens/s, copied at
    # 50 GB/s; P = 0.5, E[W] = 10 s, HBM full at 1e-12 s per byte-second, host free.
    session = IdleSession(
        "s",
        3000,
        0.0,
        ends_in_tool_call=True,
        kv_usage=1.0,
        hbm_value=1e-12,
        host=HostTierReading(free_bytes=2**40),
    )
    figures = exact().decide(session, now=0.0).figures
    assert figures is not None
    assert figures.c_release == pytest.approx(0.5 * 3000 / 30_000)
    assert figures.c_hold == pytest.approx(1e-12 * 3000 * 131_072 * 10.0)
    assert figures.c_demote == pytest.approx(0.5 * 3000 * 131_072 / 50e9)


def test_the_reason_without_a_host_tier_leaves_demotion_out() -> None:
    reason = exact(p=0.25, wait_s=2.5).decide(idle(kv_usage=0.0), 0.0).reason
    assert reason == (
        "hold: HBM has room; P 0.25 back within 1800 s, E[W] 2.5 s; hold 0, release 0.25 s"
    )


def test_settings_at_the_edges_of_their_ranges_are_accepted() -> None:
    reaper = Reaper(
        tuning=ReaperTuning(pressure_from=0.0, hysteresis=0.0, p_gone=0.0, min_gain_s=0.0)
    )
    assert reaper.decide(idle(kv_usage=0.0), now=0.0).kind is not None


def test_the_wait_model_is_asked_with_the_hint_for_the_residency_left() -> None:
    model = Fixed({"test": (0.5, 10.0)})
    session = idle(tenant="acme", tool_class="test", expected_wait_s=30.0, finished_at_s=50.0)
    figures = Reaper(model).decide(session, now=150.0).figures
    assert figures is not None and figures.horizon_s == MAX_S - 100.0
    assert set(model.asked) == {(WaitKey("acme", "test"), 100.0, MAX_S - 100.0, 30.0)}


def test_a_full_host_tier_as_large_as_the_pool_is_priced_as_hbm_is() -> None:
    session = idle(host=host(None, usage=1.0), promote_s=0.2)
    figures = exact().decide(session, now=0.0).figures
    assert figures is not None and figures.v_host == figures.v_hbm > 0


@pytest.mark.parametrize(("turnover", "action"), [(1.0, "release"), (4.0, "demote")])
def test_a_full_host_tier_k_times_the_pool_is_worth_1_in_k_of_hbm(
    turnover: float, action: str
) -> None:
    """Full once warm, the tier displaces what it has kept `turnover` times as long as the
    pool would have. P = 0.5, E[W] = 10 s, 1 s of re-prefill, a full pool: C_release =
    0.5 s, C_hold = 1 s, C_demote = 1 s / turnover + 0.5 x 0.2 s (1.1 s at 1, 0.35 s at 4)."""
    tier = HostTierReading(free_bytes=10**6, usage=1.0, turnover=turnover)
    decision = exact().decide(idle(host=tier, promote_s=0.2), now=0.0)
    assert decision.figures is not None
    assert decision.figures.v_host == pytest.approx(decision.figures.v_hbm / turnover)
    assert decision.figures.c_demote == pytest.approx(1.0 / turnover + 0.1)
    assert decision.action == action


def test_a_forced_eviction_says_why() -> None:
    reaper = exact()
    last = reaper.decide(idle(session_id="a", ends_in_tool_call=False), now=0.0)
    old = reaper.decide(idle(session_id="b"), now=2000.0)
    assert last.reason == "last step: not coming back"
    assert old.reason == "idle 2000 s: past the 1800 s maximum residency"


@pytest.mark.parametrize(
    ("signal", "action", "kind"),
    [
        ({}, "release", "no_signal"),
        ({"ends_in_tool_call": True}, "hold", "hold_cheapest"),
        ({"tool_class": "test"}, "hold", "hold_cheapest"),
        ({"expected_wait_s": 5.0}, "hold", "hold_cheapest"),
    ],
)
def test_with_a_host_tier_a_turn_with_no_signal_is_left_to_the_engines_lru(
    signal: dict[str, object], action: str, kind: str
) -> None:
    """P = 0.9, E[W] = 0.1 s, HBM worth its default: holding is cheapest (0.01 s against
    0.9 s) once anything tells of the next turn; with nothing, the host tier and LRU keep it."""
    session = idle(**{"ends_in_tool_call": None, "host": host(None), "promote_s": 0.2, **signal})
    waits = Fixed({None: (0.9, 0.1), "test": (0.9, 0.1)})
    reaper = Reaper(waits, tuning=ReaperTuning(hysteresis=0.0, min_gain_s=0.0))  # type: ignore[arg-type]
    decision = reaper.decide(session, now=0.0)
    assert (decision.action, decision.kind) == (action, kind)


def test_without_a_host_tier_a_turn_with_no_signal_is_weighed() -> None:
    session = idle(ends_in_tool_call=None)
    decision = exact(p=0.9, wait_s=0.1).decide(session, now=0.0)
    assert (decision.action, decision.kind) == ("hold", "hold_cheapest")
