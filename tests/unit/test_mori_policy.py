"""MORI's residency policy (the anchor): idleness as measured from a program's turns and
waits, its ranks, and where each rank puts a program's KV when HBM is full."""

from __future__ import annotations

import pytest

from appliance.policy import mori as mori_module
from appliance.policy.mori import NOT_ACTIVE, Mori, MoriTuning
from appliance.policy.residency import (
    HeldSession,
    HostTierReading,
    IdleSession,
    ResidencyAction,
    ResidencyKind,
)
from appliance.policy.residency_by_name import residency_policy

KB = 1000


def idle(sid: str, end: float, **kw: object) -> IdleSession:
    """A program's turn ended at `end`: 1,000 bytes, 1 s of prefill, HBM with room."""
    base: dict[str, object] = {
        "session_id": sid,
        "resident_tokens": 64,
        "finished_at_s": end,
        "ends_in_tool_call": True,
        "kv_bytes": KB,
        "recompute_s": 1.0,
        "kv_usage": 0.0,
    }
    return IdleSession(**{**base, **kw})  # type: ignore[arg-type]


def host(free_bytes: int = 10**6) -> HostTierReading:
    return HostTierReading(free_bytes=free_bytes, usage=1.0)


def held(sid: str, since: float = 0.0) -> HeldSession:
    return HeldSession(sid, 64, since, since + 1.0)


def run(m: Mori, sid: str, turns: list[tuple[float, float]]) -> None:
    """Turns of a program, each (arrival, end); the first's arrival is not reported."""
    for i, (arrival, end) in enumerate(turns):
        if i:
            m.observe_return(idle(sid, 0.0), arrival)
        m.decide(idle(sid, end), end)


IDLE_END, BUSY_END = 32.0, 40.0


def busy_and_idle(m: Mori) -> None:
    """Two programs, "idle" from 0 (its first turn's 1 s prefill before its end at 1), done at
    32 after a 30 s wait; "busy" from 36 (a mean turn seen, 1 s), done at 40 after a 1 s wait.
    At t = 40: "idle" has waited 38 s of 40 (0.95), "busy" 1 s of 4 (0.25)."""
    run(m, "idle", [(0.0, 1.0), (31.0, IDLE_END)])
    run(m, "busy", [(36.0, 37.0), (38.0, BUSY_END)])


def test_idleness_is_the_share_of_the_programs_life_spent_waiting_on_tools() -> None:
    m = Mori()
    m.decide(idle("p", 10.0, recompute_s=2.0), 10.0)  # first turn: arrived at 8 (its prefill)
    assert m.idleness("p", 10.0) == 0.0
    assert m.idleness("p", 14.0) == pytest.approx(4 / 6)  # the wait under way counts
    m.observe_return(idle("p", 0.0), 20.0)
    assert m.idleness("p", 22.0) == pytest.approx(10 / 14)  # back: busy again
    m.decide(idle("p", 25.0), 25.0)
    assert m.idleness("p", 25.0) == pytest.approx(10 / 17)
    assert m.idleness("p", 35.0) == pytest.approx(20 / 27)
    assert m.idleness("stranger", 35.0) is None


def test_a_new_programs_first_turn_counts_as_long_as_the_turns_seen_so_far() -> None:
    m = Mori()
    run(m, "a", [(0.0, 1.0), (5.0, 8.0), (10.0, 15.0)])  # turns seen arrive: 3 s and 5 s busy
    m.decide(idle("b", 100.0, recompute_s=0.5), 100.0)
    assert m.idleness("b", 104.0) == pytest.approx(4 / 8)  # 4 s on 4 s busy, not 0.5 s


def test_without_returns_reported_the_gap_less_a_mean_turn_is_the_wait() -> None:
    m = Mori()
    run(m, "a", [(0.0, 1.0), (5.0, 9.0)])  # one turn seen: 4 s busy
    m.decide(idle("b", 10.0), 10.0)  # started at 6 (a mean turn before)
    m.decide(idle("b", 30.0), 30.0)  # 20 s gap, no return reported: 16 s waited
    assert m.idleness("b", 30.0) == pytest.approx(16 / 24)


def test_a_programs_rank_moves_with_its_idleness() -> None:
    m = Mori()
    busy_and_idle(m)
    at_40 = [m.priority(held("busy"), 40.0), m.priority(held("idle"), 40.0)]
    assert at_40 == pytest.approx([-1 / 4, -38 / 40])
    assert at_40[0] > at_40[1]  # the idle one goes first
    # "busy" waits on while "idle" is back at work from 41: by t = 200 they have swapped.
    m.observe_return(idle("idle", 0.0), 41.0)
    assert m.priority(held("busy"), 200.0) == pytest.approx(-161 / 164)
    assert m.priority(held("idle"), 200.0) == pytest.approx(-39 / 200)
    assert m.priority(held("busy"), 200.0) < m.priority(held("idle"), 200.0)


def test_a_hold_the_policy_never_saw_ranks_as_the_idlest() -> None:
    m = Mori()
    busy_and_idle(m)
    assert m.priority(held("stranger"), 40.0) == -1.0
    assert m.priority(held("stranger"), 40.0) < m.priority(held("idle"), 40.0)


@pytest.mark.parametrize("usage", [0.0, 0.5, 0.8 - 1e-9])
def test_while_hbm_has_room_every_active_program_is_held(usage: float) -> None:
    m = Mori()
    busy_and_idle(m)
    d = m.decide(idle("idle", IDLE_END, kv_usage=usage, hbm_value=0.0, host=host()), 40.0)
    assert (d.action, d.kind) == (ResidencyAction.HOLD, ResidencyKind.POOL_FREE)
    assert d.until_s == 48.0  # idle 8 s: ranked again at 16


def test_under_pressure_the_idlest_is_demoted_and_the_busiest_held() -> None:
    m = Mori()
    busy_and_idle(m)
    full = {"kv_usage": 0.8, "host": host()}
    busy_rank, idle_rank = m.priority(held("busy"), 40.0), m.priority(held("idle"), 40.0)
    idle_d = m.decide(idle("idle", IDLE_END, hbm_value=busy_rank, **full), 40.0)
    busy_d = m.decide(idle("busy", BUSY_END, hbm_value=idle_rank, **full), 40.0)
    assert (idle_d.action, idle_d.kind) == (ResidencyAction.DEMOTE, ResidencyKind.DEMOTE_CHEAPEST)
    assert idle_d.reason == "HBM full: idleness 0.95 is past the idlest hold's 0.25: to host memory"
    assert (busy_d.action, busy_d.kind) == (ResidencyAction.HOLD, ResidencyKind.HOLD_CHEAPEST)
    assert busy_d.reason == "HBM full: idleness 0.25 ranks in HBM (the idlest hold's 0.95)"


@pytest.mark.parametrize(
    ("idlest_other", "action"),
    [(-0.5 + 1e-9, ResidencyAction.DEMOTE), (-0.5, ResidencyAction.HOLD)],
    ids=["just idler than every hold", "as idle as the idlest hold"],
)
def test_under_pressure_a_program_is_held_unless_idler_than_every_other_hold(
    idlest_other: float, action: ResidencyAction
) -> None:
    m = Mori()
    run(m, "p", [(0.0, 1.0), (2.0, 3.0)])  # from 0: 1 s waited, done at 3
    now = 4.0  # 2 s waited of 4 s: idleness 0.5
    d = m.decide(idle("p", 3.0, kv_usage=1.0, hbm_value=idlest_other, host=host()), now)
    assert d.action is action


def test_under_pressure_with_no_other_hold_the_program_is_held() -> None:
    m = Mori()
    busy_and_idle(m)
    d = m.decide(idle("idle", IDLE_END, kv_usage=1.0, hbm_value=None, host=host()), 40.0)
    assert d.action is ResidencyAction.HOLD
    assert d.reason == "HBM full: idleness 0.95 ranks in HBM (no other hold)"


def test_without_a_host_tier_nothing_is_demoted_the_idlest_is_released() -> None:
    m = Mori()
    busy_and_idle(m)
    ends = {"idle": IDLE_END, "busy": BUSY_END}
    for usage in (0.0, 0.9, 1.0):
        for sid, other in (("idle", "busy"), ("busy", "idle")):
            rank = m.priority(held(other), 40.0)
            d = m.decide(idle(sid, ends[sid], kv_usage=usage, hbm_value=rank), 40.0)
            assert d.action is not ResidencyAction.DEMOTE
    rank = m.priority(held("busy"), 40.0)
    d = m.decide(idle("idle", IDLE_END, kv_usage=1.0, hbm_value=rank), 40.0)
    assert (d.action, d.kind) == (ResidencyAction.RELEASE, ResidencyKind.RELEASE_CHEAPEST)
    assert d.reason.endswith("no host tier: released")


@pytest.mark.parametrize(("free", "action"), [(KB, "demote"), (KB - 1, "release")])
def test_host_memory_admits_a_program_only_with_room_for_its_kv(free: int, action: str) -> None:
    m = Mori()
    busy_and_idle(m)
    others = m.priority(held("busy"), 40.0)
    d = m.decide(idle("idle", IDLE_END, kv_usage=1.0, hbm_value=others, host=host(free)), 40.0)
    assert d.action == action


def test_a_hold_is_ranked_again_each_time_its_idle_time_doubles() -> None:
    m = Mori()
    busy_and_idle(m)
    untils = []
    now = 40.0
    for _ in range(4):
        d = m.decide(idle("busy", BUSY_END, host=host()), now)
        assert d.action is ResidencyAction.HOLD and d.until_s is not None
        untils.append(d.until_s)
        now = d.until_s
    assert untils == [41.0, 42.0, 44.0, 48.0]


def test_a_revisit_under_pressure_moves_the_hold_gone_idlest_down() -> None:
    m = Mori()
    busy_and_idle(m)
    assert m.decide(idle("busy", BUSY_END, host=host()), 40.0).action is ResidencyAction.HOLD
    m.observe_return(idle("idle", 0.0), 41.0)  # "idle" at work again; "busy" waits on
    m.decide(idle("idle", 50.0), 50.0)  # "idle" done again and held too
    now = 120.0  # "busy": 81 s waited of 84 (0.96); "idle": 39 + 70 of 120 (0.91)
    other = m.priority(held("idle"), now)
    d = m.decide(idle("busy", BUSY_END, kv_usage=1.0, hbm_value=other, host=host()), now)
    assert d.action is ResidencyAction.DEMOTE
    back = m.decide(idle("idle", 50.0, kv_usage=1.0, hbm_value=m.priority(held("busy"), now)), now)
    assert back.action is ResidencyAction.HOLD


def test_a_last_step_ends_the_program_and_is_released_however_much_room() -> None:
    m = Mori()
    busy_and_idle(m)
    m.observe_return(idle("busy", 0.0), 41.0)
    d = m.decide(idle("busy", 60.0, ends_in_tool_call=False), 60.0)
    assert (d.action, d.kind) == (ResidencyAction.RELEASE, ResidencyKind.LAST_STEP)
    assert m.idleness("busy", 60.0) is None


def test_an_unknown_last_step_keeps_the_program_active() -> None:
    m = Mori()
    d = m.decide(idle("p", 10.0, ends_in_tool_call=None), 10.0)
    assert d.action is ResidencyAction.HOLD and m.idleness("p", 10.0) == 0.0


def test_an_abandoned_program_is_no_longer_ranked() -> None:
    m = Mori()
    busy_and_idle(m)
    m.observe_abandoned(idle("idle", 0.0), 100.0)
    assert m.idleness("idle", 100.0) is None and m.idleness("busy", 100.0) is not None


def test_host_memory_evicts_programs_no_longer_active_first_then_the_idlest() -> None:
    m = Mori()
    busy_and_idle(m)
    now = 40.0
    order = sorted(
        [held("busy"), held("idle"), held("gone-old", 1.0), held("gone-new", 30.0)],
        key=lambda h: m.host_priority(h, now),
    )
    assert [h.session_id for h in order] == ["gone-old", "gone-new", "idle", "busy"]
    assert m.host_priority(held("gone-new", 30.0), now) < NOT_ACTIVE + 1e-9


def test_past_its_limit_the_policy_forgets_the_least_recently_decided_program(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(mori_module, "MAX_PROGRAMS", 2)
    m = Mori()
    for sid, end in (("a", 1.0), ("b", 2.0), ("a", 3.0), ("c", 4.0)):
        m.decide(idle(sid, end), end)
    assert [m.idleness(s, 5.0) is not None for s in "abc"] == [True, False, True]


@pytest.mark.parametrize("pressure_from", [-0.1, 1.1])
def test_a_pressure_threshold_out_of_range_is_refused(pressure_from: float) -> None:
    with pytest.raises(ValueError, match="pressure_from"):
        MoriTuning(pressure_from)


def test_a_lower_pressure_threshold_ranks_sooner() -> None:
    m = Mori(MoriTuning(pressure_from=0.5))
    busy_and_idle(m)
    others = m.priority(held("busy"), 40.0)
    d = m.decide(idle("idle", IDLE_END, kv_usage=0.6, hbm_value=others, host=host()), 40.0)
    assert d.action is ResidencyAction.DEMOTE


def test_mori_is_built_by_name_and_takes_no_argument() -> None:
    policy = residency_policy("mori")
    assert isinstance(policy, Mori) and policy.name == "mori" and policy.revisits_holds
    assert policy.tuning.pressure_from == 0.8
    with pytest.raises(ValueError, match="unknown residency policy 'mori:3'"):
        residency_policy("mori:3")


@pytest.mark.parametrize("pressure_from", [0.0, 1.0])
def test_a_pressure_threshold_at_either_end_of_its_range_is_accepted(pressure_from: float) -> None:
    assert MoriTuning(pressure_from).pressure_from == pressure_from


def test_while_hbm_has_room_the_reason_gives_the_programs_idleness() -> None:
    m = Mori()
    busy_and_idle(m)
    d = m.decide(idle("idle", IDLE_END, kv_usage=0.5, host=host()), 40.0)
    assert d.reason == "HBM has room: held, idleness 0.95"


def test_with_no_room_in_host_memory_the_idlest_is_released_and_the_reason_says_so() -> None:
    m = Mori()
    busy_and_idle(m)
    others = m.priority(held("busy"), 40.0)
    d = m.decide(idle("idle", IDLE_END, kv_usage=1.0, hbm_value=others, host=host(0)), 40.0)
    assert (d.action, d.kind) == (ResidencyAction.RELEASE, ResidencyKind.RELEASE_CHEAPEST)
    assert d.reason == (
        "HBM full: idleness 0.95 is past the idlest hold's 0.25, no room in host memory: released"
    )


def test_a_first_turn_of_unknown_length_with_no_turn_seen_counts_as_no_time() -> None:
    m = Mori()
    d = m.decide(idle("p", 10.0, recompute_s=None), 10.0)  # started at 10: no life yet
    assert d.action is ResidencyAction.HOLD
    assert m.idleness("p", 10.0) == 0.0
    assert m.idleness("p", 14.0) == 1.0  # all of its 4 s spent waiting


def test_a_program_younger_than_a_second_has_its_idleness_measured() -> None:
    m = Mori()
    m.decide(idle("p", 10.0, recompute_s=0.5), 10.0)  # arrived at 9.5
    assert m.idleness("p", 10.25) == pytest.approx(0.25 / 0.75)


def test_idleness_never_exceeds_1_even_before_a_reported_return() -> None:
    m = Mori()
    m.decide(idle("p", 10.0), 10.0)  # arrived at 9
    m.observe_return(idle("p", 0.0), 30.0)
    assert m.idleness("p", 20.0) == 1.0  # 20 s of wait reported against 11 s of life


def test_every_wait_of_a_program_adds_to_its_idleness() -> None:
    m = Mori()
    run(m, "p", [(9.0, 10.0), (20.0, 25.0), (40.0, 45.0)])  # from 9: waits of 10 s and 15 s
    assert m.idleness("p", 45.0) == pytest.approx(25 / 36)


def test_a_turn_shorter_than_a_second_counts_as_its_length() -> None:
    m = Mori()
    run(m, "a", [(0.0, 1.0), (5.0, 5.5)])  # one turn seen: 0.5 s busy
    m.decide(idle("b", 100.0), 100.0)  # started at 99.5 (a mean turn before)
    assert m.idleness("b", 104.0) == pytest.approx(4 / 4.5)


def test_without_returns_reported_the_mean_is_over_all_the_turns_seen() -> None:
    m = Mori()
    run(m, "a", [(0.0, 1.0), (5.0, 8.0), (10.0, 15.0)])  # turns seen: 3 s and 5 s, mean 4 s
    m.decide(idle("b", 10.0), 10.0)  # started at 6
    m.decide(idle("b", 30.0), 30.0)  # 20 s gap, no return reported: 16 s waited
    assert m.idleness("b", 30.0) == pytest.approx(16 / 24)


def test_without_returns_reported_or_turns_seen_every_gap_is_all_wait() -> None:
    m = Mori()
    m.decide(idle("p", 10.0), 10.0)  # arrived at 9 (its 1 s prefill)
    m.decide(idle("p", 30.0), 30.0)
    assert m.idleness("p", 30.0) == pytest.approx(20 / 21)
    m.decide(idle("p", 50.0), 50.0)
    assert m.idleness("p", 50.0) == pytest.approx(40 / 41)


def test_without_a_return_reported_a_gap_shorter_than_a_mean_turn_is_no_wait() -> None:
    m = Mori()
    run(m, "a", [(0.0, 1.0), (5.0, 9.0)])  # one turn seen: 4 s busy
    m.decide(idle("b", 10.0), 10.0)  # started at 6
    m.decide(idle("b", 13.0), 13.0)  # 3 s gap, shorter than a 4 s turn: all busy
    assert m.idleness("b", 13.0) == 0.0


def test_a_last_step_says_the_program_is_done_even_one_never_seen() -> None:
    m = Mori()
    d = m.decide(idle("once", 5.0, ends_in_tool_call=False), 5.0)  # a single-turn program
    assert (d.action, d.kind) == (ResidencyAction.RELEASE, ResidencyKind.LAST_STEP)
    assert d.reason == "last step: the program is done"
    assert m.idleness("once", 5.0) is None


def test_news_of_a_program_never_seen_is_ignored() -> None:
    m = Mori()
    m.observe_return(idle("stranger", 0.0), 5.0)
    m.observe_abandoned(idle("stranger", 0.0), 6.0)
    assert m.idleness("stranger", 7.0) is None


def test_a_second_report_of_the_same_return_keeps_the_first() -> None:
    m = Mori()
    m.decide(idle("p", 10.0, recompute_s=2.0), 10.0)  # arrived at 8
    m.observe_return(idle("p", 0.0), 20.0)
    m.observe_return(idle("p", 0.0), 25.0)
    assert m.idleness("p", 30.0) == pytest.approx(10 / 22)


def test_host_memory_evicts_the_least_recently_used_first_even_within_a_second() -> None:
    m = Mori()
    now = 40.0
    older, newer = held("gone-older", now - 0.5), held("gone-newer", now - 0.25)
    assert m.host_priority(older, now) < m.host_priority(newer, now) < NOT_ACTIVE
