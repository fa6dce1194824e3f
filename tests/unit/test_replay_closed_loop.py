"""Closed-loop agent workloads in the replay: turns released by completions plus tool waits,
prompts that grow by what the engine generated, fan-out joined before the parent's next
turn, and the task figures; hand-built `appliance.workload` tasks."""

from __future__ import annotations

import pytest

from appliance.replay import run_workload
from appliance.replay.closed_loop import ClosedLoop
from appliance.replay.runner import make_engines, make_setup
from appliance.sim.engine_io import SimRequest
from appliance.sim.runtime.virtual import Arrival, RequestRecord, replay
from appliance.workload import AgentTask, AgentTurn

BLOCK = 512


def task(
    task_id: str,
    turns: list[AgentTurn],
    *,
    start: float = 0.0,
    tenant: str = "acme",
    deadline: float | None = None,
    parent: str | None = None,
    succeeds: bool = True,
    verified: bool = True,
    prefix: int = 1024,
) -> AgentTask:
    return AgentTask(
        task_id,
        parent,
        tenant,
        "fix",
        start,
        deadline,
        succeeds,
        verified,
        "fix/0",
        prefix,
        tuple(turns),
    )


def t(
    appended: int,
    output: int,
    tool: str | None = None,
    wait_s: float = 0.0,
    spawns: tuple[str, ...] = (),
    discards: tuple[str, ...] = (),
) -> AgentTurn:
    return AgentTurn(appended, output, tool, wait_s, spawns, discards=discards)


def run_loop(tasks: list[AgentTask], hbm_gib: float = 4.0) -> dict[str, RequestRecord]:
    setup, latency = make_setup(workers=1, hbm_gib=hbm_gib)
    loop = ClosedLoop(tasks, max_model_len=setup.max_model_len)
    engines = make_engines(setup, latency)
    result = replay(engines, loop.arrivals(), on_finish=loop.on_finish)
    return {r.request_id: r for r in result.records}


def test_turns_follow_completions_and_resend_the_conversation() -> None:
    recs = run_loop(
        [
            task("t1", [t(600, 30, "bash", 5.0), t(100, 20, "test", 2.0), t(50, 10)]),
            task("t2", [t(300, 10)], start=1.0),  # same tenant and prefix
            task("t3", [t(300, 10)], start=2.0, tenant="other"),  # same prefix, other tenant
        ]
    )
    assert list(recs) == ["t1/0", "t2/0", "t3/0", "t1/1", "t1/2"]
    first, second, third = recs["t1/0"], recs["t1/1"], recs["t1/2"]
    assert second.arrival_s == first.finish_s + 5.0 and third.arrival_s == second.finish_s + 2.0
    # prefix + appended; then + the 30 generated tokens + 100; then + 20 + 50
    assert [r.prompt_tokens for r in (first, second, third)] == [1624, 1754, 1824]
    # A turn reuses the full blocks its predecessor computed (prompt and all but the last
    # generated token): 1653 and 1773 tokens, 3 blocks each.
    assert [r.cached_tokens for r in (first, second, third)] == [0, 3 * BLOCK, 3 * BLOCK]
    assert recs["t2/0"].cached_tokens == 2 * BLOCK  # the shared prefix
    assert recs["t3/0"].cached_tokens == 0  # tenants never share (cache salt)
    assert all(
        r.output_tokens == n for r, n in zip((first, second, third), (30, 20, 10), strict=True)
    )


def test_children_start_after_the_spawning_turn_and_the_parent_joins_them() -> None:
    recs = run_loop(
        [
            task("p", [t(200, 10, "subagent", 1.0, ("p.0", "p.1")), t(100, 10)], prefix=BLOCK),
            task("p.0", [t(100, 5, "bash", 3.0), t(50, 5)], start=0.5, parent="p", prefix=BLOCK),
            task("p.1", [t(80, 5)], parent="p", prefix=BLOCK),
        ]
    )
    spawn = recs["p/0"].finish_s
    assert recs["p.1/0"].arrival_s == spawn and recs["p.0/0"].arrival_s == spawn + 0.5
    assert recs["p.0/1"].arrival_s == recs["p.0/0"].finish_s + 3.0
    joined = max(recs["p.0/1"].finish_s, recs["p.1/0"].finish_s)
    assert recs["p/1"].arrival_s == joined + 1.0
    assert recs["p.0/0"].cached_tokens == BLOCK  # the prefix the parent computed


def test_the_parent_drops_the_children_it_discards_when_it_joins_them() -> None:
    """A best-of-three keeps p.1: p.0 and p.2 are discarded branches from the join on, and
    so is p.0's own child; a root that never fanned out is nobody's branch."""
    spawn = t(200, 10, "subagent", 1.0, ("p.0", "p.1", "p.2"), discards=("p.0", "p.2"))
    tasks = [
        task("p", [spawn, t(100, 10)], prefix=BLOCK),
        task("p.0", [t(100, 5, "subagent", 0.0, ("p.0.0",)), t(10, 5)], parent="p", prefix=BLOCK),
        task("p.0.0", [t(30, 5)], parent="p.0", prefix=BLOCK),
        task("p.1", [t(80, 5, "bash", 2.0), t(20, 5)], parent="p", prefix=BLOCK),
        task("p.2", [t(60, 5)], parent="p", prefix=BLOCK),
        task("q", [t(50, 5)], start=0.5),
    ]
    setup, latency = make_setup(workers=1, hbm_gib=4.0)
    loop = ClosedLoop(tasks, max_model_len=setup.max_model_len)
    branches = [task.task_id for task in tasks]
    seen: dict[str, list[str]] = {}

    def on_finish(rec: RequestRecord) -> list[Arrival]:
        seen[rec.request_id] = [b for b in branches if loop.discarded(b)]  # before it
        return loop.on_finish(rec)  # type: ignore[return-value]

    replay(make_engines(setup, latency), loop.arrivals(), on_finish=on_finish)
    # Nothing is dropped until the last child ends; the parent's next turn comes after.
    assert seen.pop("p/1") == ["p.0", "p.0.0", "p.2"]
    assert len(seen) == 8 and not any(seen.values())
    outcomes = {o.task_id: o.discarded for o in loop.outcomes({})}
    assert outcomes == {
        "p": False,
        "p.0": True,
        "p.0.0": True,
        "p.1": False,
        "p.2": True,
        "q": False,
    }


def test_a_turn_may_discard_only_the_children_it_spawns() -> None:
    tasks = [
        task("p", [t(200, 10, "subagent", 1.0, ("p.0",), discards=("q",)), t(10, 5)]),
        task("p.0", [t(10, 5)], parent="p"),
        task("q", [t(10, 5)]),
    ]
    with pytest.raises(ValueError, match="task p discards a child it does not spawn"):
        ClosedLoop(tasks, max_model_len=8192)


def test_a_turn_that_no_longer_fits_ends_its_task() -> None:
    # 1 GiB: 16 blocks, max_model_len 8192; the second turn would pass it.
    recs = run_loop([task("t", [t(600, 30, "bash", 1.0), t(7000, 10)])], hbm_gib=1.0)
    assert list(recs) == ["t/0"]


def test_a_follow_up_before_the_finish_is_refused() -> None:
    setup, latency = make_setup(workers=1, hbm_gib=1.0)
    first = Arrival(0.0, SimRequest("a", list(range(100)), 2))

    def too_early(rec: RequestRecord) -> list[Arrival]:
        return [Arrival(0.0, SimRequest("b", list(range(100)), 2))] if rec.request_id == "a" else []

    with pytest.raises(ValueError, match="would arrive before a finished"):
        replay(make_engines(setup, latency), [first], on_finish=too_early)


@pytest.fixture(scope="module")
def report() -> dict:
    tasks = [
        task("a", [t(600, 30, "bash", 5.0), t(100, 20, "test", 2.0), t(50, 10)], deadline=600.0),
        task("b", [t(300, 10)], start=1.0, deadline=0.01, verified=False),  # cannot make it
        task("c", [t(300, 10, "bash", 1.0), t(20, 5)], start=2.0, succeeds=False),
    ]
    return run_workload(
        tasks,
        policies=["round-robin"],
        residencies=["lru", "ttl-pin"],
        workers=1,
        hbm_gib=4.0,
        gpu_second=1.0,
    )


def test_workload_rows_carry_the_task_figures(report: dict) -> None:
    assert list(report["policies"]) == ["round-robin", "round-robin+ttl-pin"]
    assert report["bounds"] == {} and report["trace"]["requests"] == 6
    for m in report["policies"].values():
        assert m["tasks"] == m["tasks_completed"] == 3 and m["finished"] == 6
        assert m["deadline_goodput"] == 0.5  # a met its deadline, b did not
        # Priced at 1 per GPU-second; a is the only verified success.
        assert m["cost_per_success"] == pytest.approx(m["gpu_s"], abs=2e-3)
        assert m["sessions"] == 3


def test_ttl_pin_pins_only_turns_that_end_in_a_tool_call(report: dict) -> None:
    lru, pin = report["policies"]["round-robin"], report["policies"]["round-robin+ttl-pin"]
    assert lru["pins"] == 0
    assert pin["pins"] == 3 and pin["pins_resumed"] == 3  # a/0, a/1, c/0; each came back
    assert pin["residency_by_reason"] == {
        "pinned for the N s TTL": 3,
        "last step: nothing to pin for": 3,
    }


def test_the_routers_index_finds_a_tenants_blocks() -> None:
    """The engines hash a tenant's prompts with its salt; the router's index lookups must
    too, or no worker ever looks resident and placement ignores reuse."""
    from appliance.replay.routers import PolicyRouter

    setup, latency = make_setup(workers=2, hbm_gib=4.0)
    tasks = [task("a", [t(2 * BLOCK, 8, "file", 1.0), t(100, 8)])]
    loop = ClosedLoop(tasks, max_model_len=setup.max_model_len)
    engines = make_engines(setup, latency)
    router = PolicyRouter("appliance", workers=2, hasher=engines[0].hasher, latency=latency)
    seen: list[tuple[str, str]] = []

    def route(req: SimRequest, views: list) -> int:  # type: ignore[type-arg]
        w = router(req, views)
        seen.append((req.request_id, router.reasons.most_common(1)[0][0]))
        return w

    replay(engines, loop.arrivals(), route, on_step=router.on_step, on_finish=loop.on_finish)
    assert [rid for rid, _ in seen] == ["a/0", "a/1"]
    assert router.reasons["prefix_resident"] == 1  # the second turn: 3 blocks resident
