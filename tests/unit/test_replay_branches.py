"""Branch-local state in the closed-loop replay: sixteen children forked from a parent's
conversation, each adding its own context, leave nothing of their own held on any tier
once they end (within one reaper tick), while the parent's prefix still hits; and the
seed failure mode "fan-out storm" under branch quotas keeps other tenants' warm sessions."""

from __future__ import annotations

from appliance.policy.branches import BranchQuota
from appliance.policy.reaper import Reaper
from appliance.policy.residency_by_name import ResidencyPlan
from appliance.replay.kv_residency.branches import TICK_S
from appliance.replay.kv_residency.residency import wait_priors
from appliance.replay.runner import make_setup
from appliance.replay.workload_replay import replay_closed_loop, replay_workload
from appliance.workload import AgentTask, AgentTurn, WorkloadSpec

BLOCK = 512
KV_BYTES_PER_TOKEN = 131_072


def t(
    appended: int, tool: str | None = None, wait_s: float = 0.0, spawns: tuple[str, ...] = ()
) -> AgentTurn:
    return AgentTurn(appended, 8, tool, wait_s, spawns, forks=bool(spawns))


def child(j: int, parent: str = "p") -> AgentTask:
    """Two turns with 2 blocks of its own, or (one child in four) a last tool call that
    never answers: the child is abandoned there."""
    turns = [t(2 * BLOCK, "file", 0.5), t(BLOCK)]
    if j % 4 == 3:
        turns = [t(2 * BLOCK, "file", 0.5), t(BLOCK, "test", 5.0)]
    return AgentTask(
        f"{parent}.{j}", parent, "acme", "fix", 0.0, None, True, True, "c", BLOCK, tuple(turns)
    )


def fan_out_of_16() -> list[AgentTask]:
    children = [child(j) for j in range(16)]
    parent = AgentTask(
        "p",
        None,
        "acme",
        "fix",
        0.0,
        None,
        True,
        True,
        "p",
        BLOCK,
        (t(3 * BLOCK), t(100, "subagent", 0.0, tuple(c.task_id for c in children)), t(100)),
    )
    return [parent, *children]


def test_sixteen_ended_branches_hold_nothing_of_their_own_within_a_tick() -> None:
    setup, latency = make_setup(workers=2, hbm_gib=8.0, host_gib=8.0)
    kept = replay_workload(fan_out_of_16(), "appliance", setup, latency, residency="reaper")
    released = replay_closed_loop(
        fan_out_of_16(), "appliance", setup, latency, residency="reaper+branches"
    )
    branches = released.keeper.summary()
    assert branches["ended"] == 16 and branches["released"] is True
    assert branches["held_bytes_max"] == branches["held_bytes_max_after_tick"] == 0
    ends = [s for s in released.keeper.series if s[2] == "end"]
    ticks = [s for s in released.keeper.series if s[2] == "tick"]
    assert len(ends) == len(ticks) == 16
    assert all(b == 0 for _, b, _ in ticks)
    assert sorted(t for t, _, _ in ticks) == sorted(t + TICK_S for t, _, _ in ends)
    # Without the release their own blocks stay behind (offloaded to the host tier).
    before = kept["branches"]
    assert isinstance(before, dict) and before["held_bytes_max_after_tick"] > 0
    # The parent's prefix still hits after they all ended: its next turn finds its whole
    # conversation (prefix, 3 blocks, its spawning turn) cached.
    (resumed,) = [r for r in released.result.records if r.request_id == "p/2"]
    assert resumed.cached_tokens >= 4 * BLOCK
    (own_first,) = [r for r in released.result.records if r.request_id == "p.0/0"]
    assert own_first.cached_tokens >= 4 * BLOCK  # a branch starts from the parent's blocks


def fan_out_storm() -> list[AgentTask]:
    """As the reaper's seed failure mode: tenant `other` has 8 sessions of 3 blocks waiting
    8 s on searches; at t=1 a parent of tenant `acme` spawns 12 children of 3 blocks, which
    finish and wait a minute on tests; at t=4 a 30-block prompt of a third tenant needs
    room in the 64-block pool."""
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
            (t(2 * BLOCK, "test", 60.0), t(100)),
        )
        for j in range(12)
    ]
    parent = AgentTask(
        "p",
        None,
        "acme",
        "fix",
        1.0,
        None,
        True,
        True,
        "p",
        512,
        (AgentTurn(100, 8, "subagent", 0.0, tuple(c.task_id for c in children)), t(100)),
    )
    others = [
        AgentTask(
            f"o{i}",
            None,
            "other",
            "fix",
            i * 0.05,
            None,
            True,
            True,
            f"o{i}",
            512,
            (t(3 * BLOCK - 600, "search", 8.0), t(100)),
        )
        for i in range(8)
    ]
    third = AgentTask(
        "big", None, "third", "fix", 4.0, None, True, True, "big", 512, (t(30 * BLOCK),)
    )
    return [parent, *children, *others, third]


def test_a_fan_out_storm_under_branch_quotas_keeps_other_tenants_warm_sessions() -> None:
    setup, latency = make_setup(workers=1, hbm_gib=4.0)
    priors = wait_priors(WorkloadSpec().tool_classes)
    plan = ResidencyPlan(
        Reaper(priors=priors, name="reaper+branches"),
        branches=BranchQuota(quota_bytes=BLOCK * KV_BYTES_PER_TOKEN),  # a block of its own
    )
    lru = replay_workload(fan_out_storm(), "appliance", setup, latency, residency="lru")
    bounded = replay_workload(fan_out_storm(), "appliance", setup, latency, residency=plan)
    assert bounded["preemptions"] == lru["preemptions"] == 0
    kinds = bounded["residency_by_kind"]
    assert isinstance(kinds, dict) and kinds.get("branch_quota", 0) > 0
    warm = bounded["reuse_by_tool"]["search"]  # type: ignore[index]
    cold = lru["reuse_by_tool"]["search"]  # type: ignore[index]
    assert warm["cached_tokens"] >= 8 * 2 * BLOCK  # every other session's return hits
    assert cold["cached_tokens"] < 8 * 2 * BLOCK


def test_the_table_says_what_ended_branches_held_and_what_prefetches_did() -> None:
    from appliance.replay import render_table, run_workload

    out = run_workload(
        fan_out_of_16(),
        policies=["appliance"],
        workers=2,
        hbm_gib=8.0,
        residencies=["reaper", "reaper+lead-time+branches"],
    )
    text = render_table(out)
    assert "appliance+reaper: 16 branches ended" in text
    assert (
        "appliance+reaper+lead-time+branches: 16 branches ended; their own KV held at most 0 MiB"
        in text
    )
    assert "appliance+reaper+lead-time+branches: 0 prefetches" in text
