"""Replay a closed-loop agent workload (`closed_loop.py`) with one routing policy and one
residency policy, and the reaper's options the residency name asks for: restore on lead
time (`prefetch.py`) and branch-local state (`branches.py`).

Model of the world: as `runner.replay_policy` for a trace (the same simulated workers,
router and residency adapter), the turns released by completions plus tool waits. The
closed loop tells its listeners of the clients' announcements and of child tasks' ends;
the prefetch driver watches every turn end and arrival through the residency adapter, and
the branch keeper has the last word on a child's residency decision. The KV ended
branches still hold is measured in every row (released only under `+branches`).

Figures beyond a trace's (`metrics.py`): the task figures, reuse by the tool a turn waited
on, `prefill_s` (modelled prefill seconds of every turn's fresh tokens, speculative
prefills included), `prefetch` (null without `+lead-time`; the unused share of the restored
bytes also as `prefetch_unused_share`) and `branches` (null without child tasks), `power`
(null without `--worker-reaper`: `power.py`).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from appliance.perf.latency import LatencyModel
from appliance.policy.residency import ResidencyPolicy
from appliance.policy.residency_by_name import ResidencyPlan, residency_plan
from appliance.policy.wait_curves import LogNormal
from appliance.replay.closed_loop import AgentTaskLike, ClosedLoop, GpuSeconds
from appliance.replay.kv_residency.branches import BranchKeeper
from appliance.replay.kv_residency.prefetch import PrefetchDriver
from appliance.replay.kv_residency.residency import PolicyResidency
from appliance.replay.metrics import policy_metrics, task_metrics
from appliance.replay.power import ReaperSetting, WorkerReaper, awake_cost_per_success
from appliance.replay.routers import PolicyRouter
from appliance.replay.runner import (
    DEFAULT_GPU_SECOND,
    DEFAULT_RESIDENCY,
    ReplaySetup,
    make_engines,
    with_decision_counts,
    worker_reaper,
)
from appliance.sim.engine_io import StepResult
from appliance.sim.runtime.virtual import Arrival, ReplayResult, RequestRecord, Timer, replay


class _Listeners:
    """The closed loop's listener: the prefetch driver (if any) and the branch keeper."""

    def __init__(self, keeper: BranchKeeper, prefetch: PrefetchDriver | None) -> None:
        self.keeper, self.prefetch = keeper, prefetch

    def tool_finished(self, session_id: str, now: float) -> list[Timer]:
        return self.prefetch.tool_finished(session_id, now) if self.prefetch else []

    def task_ended(self, task_id: str, now: float) -> list[Timer]:
        return self.keeper.task_ended(task_id, now)


@dataclass(frozen=True, slots=True)
class WorkloadRun:
    """One closed-loop replay and the parts that watched it."""

    result: ReplayResult
    loop: ClosedLoop
    hold: PolicyResidency
    router: PolicyRouter
    gpu: GpuSeconds
    prefetch: PrefetchDriver | None
    keeper: BranchKeeper
    wall_s: float
    power: WorkerReaper | None = None


def replay_workload(
    tasks: Sequence[AgentTaskLike],
    policy: str,
    setup: ReplaySetup,
    latency: LatencyModel,
    *,
    residency: str | ResidencyPolicy | ResidencyPlan = DEFAULT_RESIDENCY,
    gpu_second: float = DEFAULT_GPU_SECOND,
    pooled_host: bool = False,
    wait_priors: Mapping[str, LogNormal] | None = None,
    reaper: ReaperSetting | None = None,
) -> dict[str, object]:
    """Replay a closed-loop workload with `policy` routing and `residency` holding: each
    task's next turn arrives when its last one finished plus its tool wait. `wait_priors`
    (tool class -> its wait) are the reaper's priors; `reaper` watches (and sleeps) the
    workers. Returns the same metrics as `replay_policy`, the task figures and the
    module's own filled in."""
    run = replay_closed_loop(
        tasks,
        policy,
        setup,
        latency,
        residency=residency,
        pooled_host=pooled_host,
        wait_priors=wait_priors,
        reaper=reaper,
    )
    loop, prefetch = run.loop, run.prefetch
    outcomes = loop.outcomes(run.gpu.by_request)
    out = policy_metrics(
        run.result,
        loop.sessions(),
        workers=setup.workers,
        tasks=task_metrics(outcomes, gpu_second=gpu_second),
        pooled_host=pooled_host,
    )
    out["power"] = None
    if run.power is not None:
        power = run.power.summary(run.result.end_s)
        power["awake_cost_per_success"] = awake_cost_per_success(
            power, outcomes, gpu_second=gpu_second
        )
        out["power"] = power
    out["reuse_by_tool"] = reuse_by_tool(run.result.records, loop)
    prefill_s = turn_prefill_s(run.result.records, latency)
    out["prefetch"] = out["prefetch_unused_share"] = None
    if prefetch is not None:
        summary = prefetch.summary()
        out["prefetch"], out["prefetch_unused_share"] = summary, summary["unused_bytes_share"]
        prefill_s += sum(d.prefill_s for r in prefetch.rows if (d := r.done) is not None)
    out["prefill_s"] = round(prefill_s, 3)
    out["branches"] = run.keeper.summary() if any(loop.branch(t.task_id) for t in tasks) else None
    return with_decision_counts(out, run.router, run.hold, run.wall_s)


def replay_closed_loop(
    tasks: Sequence[AgentTaskLike],
    policy: str,
    setup: ReplaySetup,
    latency: LatencyModel,
    *,
    residency: str | ResidencyPolicy | ResidencyPlan = DEFAULT_RESIDENCY,
    pooled_host: bool = False,
    wait_priors: Mapping[str, LogNormal] | None = None,
    reaper: ReaperSetting | None = None,
) -> WorkloadRun:
    """The replay behind `replay_workload`, its records and watchers for a caller to read."""
    if isinstance(residency, str):
        plan = residency_plan(residency, priors=wait_priors)
    else:
        plan = residency if isinstance(residency, ResidencyPlan) else ResidencyPlan(residency)
    loop = ClosedLoop(tasks, max_model_len=setup.max_model_len, seed=setup.token_seed)
    prefetch = _driver(plan, latency)
    keeper = BranchKeeper(loop, latency=latency, quota=plan.branches)
    loop.listener = _Listeners(keeper, prefetch)
    hold = PolicyResidency(
        plan.policy,
        latency=latency,
        block_size=setup.block_size,
        hints=loop.hint,
        watch=prefetch,
        bound=keeper.bound,
    )
    engines = make_engines(setup, latency, hold, pooled_host=pooled_host, sleepy=bool(reaper))
    router = PolicyRouter(policy, workers=setup.workers, hasher=engines[0].hasher, latency=latency)
    power = worker_reaper(reaper, setup, engines, router) if reaper is not None else None
    keeper.bind(engines)
    if prefetch is not None:
        prefetch.bind(engines, router.predict)
    gpu = GpuSeconds()

    def on_step(i: int, now: float, result: StepResult) -> None:
        router.on_step(i, now, result)
        gpu.on_step(i, now, result)
        if prefetch is not None:
            prefetch.on_step(i, now, result)
        if power is not None:
            power.on_step(i, now, result)

    def on_finish(rec: RequestRecord) -> list[Arrival | Timer]:
        follow = loop.on_finish(rec)
        return follow + prefetch.on_finish(rec) if prefetch is not None else follow

    t0 = time.perf_counter()
    route = power.routed(router) if power is not None else router
    result = replay(engines, loop.arrivals(), route, on_step=on_step, on_finish=on_finish)
    wall_s = time.perf_counter() - t0
    if prefetch is not None:
        prefetch.finish()
    return WorkloadRun(result, loop, hold, router, gpu, prefetch, keeper, wall_s, power)


def _driver(plan: ResidencyPlan, latency: LatencyModel) -> PrefetchDriver | None:
    if plan.prefetch is None:
        return None
    tuning = getattr(plan.policy, "tuning", None)
    return PrefetchDriver(
        plan.prefetch,
        latency=latency,
        survival=getattr(plan.policy, "survival", None),
        horizon_s=float(getattr(tuning, "max_residency_s", 1800.0)),
    )


def turn_prefill_s(records: Sequence[RequestRecord], latency: LatencyModel) -> float:
    """Modelled prefill seconds of every turn's fresh tokens (at its first scheduling)."""
    return sum(
        latency.prefill_s(r.prompt_tokens - r.cached_tokens, r.cached_tokens)
        for r in records
        if r.prompt_tokens > r.cached_tokens
    )


def reuse_by_tool(records: Sequence[RequestRecord], loop: ClosedLoop) -> dict[str, object]:
    """Tool class -> how much of the turns that follow a wait on it was found cached: the
    turns, their prompt and cached tokens, and the hit ratio."""
    sums: dict[str, list[int]] = {}
    for r in records:
        tool = loop.previous_tool(r.request_id)
        if tool is not None:
            s = sums.setdefault(tool, [0, 0, 0])
            s[0] += 1
            s[1] += r.prompt_tokens
            s[2] += r.cached_tokens
    return {
        tool: {"turns": n, "prompt_tokens": p, "cached_tokens": c, "hit": round(c / p, 4)}
        for tool, (n, p, c) in sorted(sums.items())
    }
