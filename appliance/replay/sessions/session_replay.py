"""Recorded agent sessions (`agent_traces.py`) through one stack a self-hoster could run:
a routing policy, a residency policy and a host tier, at `users` sessions at once
(`session_loop.py`); the capacity search over `users` is `capacity_search.py`.

Model of the world: as `workload_replay.py` for the agent workload (the same simulated
workers, router and residency adapter), the requests released by completions plus think
times. The figures count the requests that arrive after the warm-up and by the end of the
window (`warmup_s` < arrival <= `SessionLoop.end_s`: the last session's start in one pass,
else `duration_s`), so the users' ramp and the drain after the end are not in them.

Stacks (`STACKS`), each as its authors ship it at its best settings (the routing anchors'
and residency anchors' docstrings cite their sources):
- `vllm`: vLLM as shipped behind vllm-router's consistent hash on the session: LRU, no
  host tier;
- `vllm-offload`: the same with vLLM's native CPU offloading (an LRU host tier);
- `llm-d`: llm-d's precise prefix scorer with load scorers, vLLM's offloading;
- `dynamo`: Dynamo's KV router (overlap minus load), its KVBM host tier (LRU);
- `sglang`: SGLang's cache-aware router, HiCache (an LRU host tier);
- `cachettl`: CacheTTL (formerly Continuum, arXiv 2511.02230) on vLLM: TTL pins on turns
  that end in a tool call, sessions by consistent hash, no host tier;
- `mori`: MORI (arXiv 2606.00866): sessions ranked by idleness, the idlest demoted to the
  host tier, sessions by consistent hash;
- `appliance`: the appliance's router, its idle reaper, the host tier;
- `appliance-restore`: the same with restore ahead of the predicted return (below), off by
  default live too (`residency.restore_ahead`): on the recorded sessions it restored next
  to nothing and did not lower the TTFT (docs/benchmarks.md).

Restore ahead (`Stack.restore`): the live box's decision code (`residency.restore_ahead`
on), `PrefetchPolicy` with `RESTORE_AHEAD_TRIGGERS` and no prefill (the live box only
promotes), driven by the replay's `PrefetchDriver` (`prefetch.py`) on the live box's due
times (`return_due.RESTORE_AHEAD`): at each turn's end the reaper's wait model, learned per
tenant, tool class from the answer (`tool_use`, or the person) and depth, says when the
next turn becomes likely (the `HAZARD` signal), and again a second on while it stays
likely; then, if the session's prefix is in the host tier and not in HBM on the worker its
turn would go to, it is copied back. The row counts restores (`restores`, `restores_used`),
the bytes restored and those no turn used (`restored_unused_share`), and the driver's
summary (`restore`: by trigger, signals skipped by kind, TTFT saved).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import Protocol

from appliance.domain.block_hash import BlockHash, BlockHasher, HashAlgo
from appliance.perf.agent_batching import (
    AGENT_BATCH_TOKENS,
    AGENT_PREFILL_CAP_TOKENS,
    AGENT_SCHEDULING_POLICY,
)
from appliance.perf.latency import LatencyModel
from appliance.policy.prefetch import RESTORE_AHEAD_TRIGGERS, PrefetchPolicy, PrefetchTuning
from appliance.policy.residency_by_name import residency_plan
from appliance.policy.return_due import RESTORE_AHEAD
from appliance.replay.kv_residency.prefetch import PrefetchDriver
from appliance.replay.kv_residency.residency import PolicyResidency
from appliance.replay.metrics import policy_metrics
from appliance.replay.routers import PolicyRouter
from appliance.replay.runner import ReplaySetup, make_engines, with_decision_counts
from appliance.replay.sessions.run_window import RunWindow
from appliance.replay.sessions.session_bound import (
    BOUND_ROUTING,
    ClairvoyantResidency,
    free_restores,
)
from appliance.replay.sessions.session_loop import SessionLoop
from appliance.replay.sessions.session_usage import SessionUsage
from appliance.replay.sessions.ttft_at_p95 import ttft_at_p95
from appliance.sim.core.engine import SimEngine
from appliance.sim.engine_io import StepResult
from appliance.sim.runtime.virtual import Arrival, ReplayResult, RequestRecord, Timer, replay
from appliance.workload.agent_traces import AgentSessionTrace


@dataclass(frozen=True, slots=True)
class Stack:
    routing: str
    residency: str
    host: bool
    """Whether it keeps KV in host memory (the replay's `--host-gib`)."""
    restore: bool = False
    """Whether a session's KV is restored from host memory ahead of its predicted return."""
    appliance_workers: bool = False
    """Whether its workers run with the scheduler settings the appliance gives its own
    (`perf/agent_batching.py`: step budget, prefill cap, priority scheduling); else vLLM's
    defaults on an H200."""
    ends_overflowed: bool = False
    """Whether a session whose next prompt overflows the window ends there, its own KV
    dropped on every tier, as the appliance's reaper loop ends it live (vLLM keeps it)."""


STACKS: dict[str, Stack] = {
    "vllm": Stack("session-hash", "lru", host=False),
    "vllm-offload": Stack("session-hash", "lru", host=True),
    "llm-d": Stack("llm-d-precise", "lru", host=True),
    "dynamo": Stack("dynamo-kv", "lru", host=True),
    "sglang": Stack("sglang-cache-aware", "lru", host=True),
    "cachettl": Stack("session-hash", "ttl-pin", host=False),
    "mori": Stack("session-hash", "mori", host=True),
    "appliance": Stack(
        "appliance", "reaper", host=True, appliance_workers=True, ends_overflowed=True
    ),
    "appliance-restore": Stack(
        "appliance",
        "reaper",
        host=True,
        restore=True,
        appliance_workers=True,
        ends_overflowed=True,
    ),
}
BOUND = "bound"
"""The clairvoyant bound's row (`session_bound.py`), replayed like a stack."""
_BOUND_STACK = Stack(
    BOUND_ROUTING, "clairvoyant", host=True, appliance_workers=True, ends_overflowed=True
)


DEFAULT_WINDOW = RunWindow()


def stack_plan(stack: str) -> Stack:
    """The stack's plan (the bound's too)."""
    return _BOUND_STACK if stack == BOUND else STACKS[stack]


def replay_stack(
    sessions: Sequence[AgentSessionTrace],
    stack: str,
    setup: ReplaySetup,
    latency: LatencyModel,
    *,
    users: int,
    window: RunWindow = DEFAULT_WINDOW,
) -> dict[str, object]:
    """One run of `stack` (or the clairvoyant `BOUND`) at `users` sessions at once: its
    figures (see the module)."""
    bound = stack == BOUND
    plan = stack_plan(stack)
    if not plan.host:
        setup = replace(setup, host_blocks_per_worker=0, host_gib_per_worker=0.0)
    if plan.appliance_workers:
        setup = replace(
            setup,
            max_num_batched_tokens=AGENT_BATCH_TOKENS,
            long_prefill_token_threshold=AGENT_PREFILL_CAP_TOKENS,
            prompt_a_step=True,
            scheduling_policy=AGENT_SCHEDULING_POLICY,
        )
    hasher = BlockHasher(HashAlgo.SHA256, setup.block_size)  # as `make_engines` hashes
    loop = SessionLoop(
        sessions,
        users=users,
        hasher=hasher,
        max_model_len=setup.max_model_len,
        window=window,
        clairvoyant=bound,
    )
    if bound:
        latency = free_restores(latency)
    policy = ClairvoyantResidency() if bound else residency_plan(plan.residency).policy
    ahead = restore_driver(policy, latency) if plan.restore else None
    hold = PolicyResidency(
        policy, latency=latency, block_size=setup.block_size, hints=loop.hint, watch=ahead
    )
    engines = make_engines(setup, latency, hold)
    if plan.ends_overflowed:
        loop.on_overflow = partial(end_overflowed, engines, hold)
    router = PolicyRouter(plan.routing, workers=setup.workers, hasher=hasher, latency=latency)
    usage = SessionUsage(engines)
    t0 = time.perf_counter()
    result = _replay_watched(engines, loop, router, [router, usage, *([ahead] if ahead else [])])
    if ahead is not None:
        ahead.finish()
    wall_s = time.perf_counter() - t0
    counted = _in_window(result, window.warmup_s, loop.end_s)
    out: dict[str, object] = {"stack": stack, "users": users, **plan_fields(plan)}
    out |= worker_settings(engines[0])
    out |= policy_metrics(counted, loop.sessions(), workers=setup.workers)
    out["hit_rate"] = out["hit_ratio"]
    out["ttft_at_p95"] = ttft_at_p95(counted.records, latency, prompt_chunk(engines[0]))
    out |= loop_fields(loop)
    out |= restore_fields(ahead)
    out |= usage.fields(window.warmup_s, loop.end_s, loop.ended)
    return with_decision_counts(out, router, hold, wall_s)


def loop_fields(loop: SessionLoop) -> dict[str, object]:
    """A row's figures of the sessions' loop: its window, what it skipped, started, ended."""
    return {
        "window_end_s": round(loop.end_s, 1),
        "gave_up_s": round(loop.gave_up_s, 1) if math.isfinite(loop.gave_up_s) else None,
        "skipped_for_window": loop.counts.skipped_for_window,
        "sessions_started": loop.counts.sessions_started,
        "sessions_finished": loop.counts.sessions_finished,
        "subagents": loop.counts.subagents,
    }


def end_overflowed(
    engines: Sequence[SimEngine],
    hold: PolicyResidency,
    session_id: str,
    own: Sequence[BlockHash],
    now: float,
) -> None:
    """A session whose next prompt overflows the window ends as the live reaper loop ends
    it (`WaitingSession.ended_why`, then its `_session_ended`): its own blocks go on every
    tier, and its idle period ends unreturned."""
    for engine in engines:
        engine.release_session(session_id, own, now)
    hold.driver.abandoned(session_id, now)


def restore_driver(policy: object, latency: LatencyModel) -> PrefetchDriver:
    """Restore ahead of the predicted return for `policy` (a reaper: its wait model)."""
    tuning = getattr(policy, "tuning", None)
    return PrefetchDriver(
        PrefetchPolicy(PrefetchTuning(prefill=False, triggers=RESTORE_AHEAD_TRIGGERS)),
        latency=latency,
        survival=getattr(policy, "survival", None),
        horizon_s=float(getattr(tuning, "max_residency_s", 1800.0)),
        due=RESTORE_AHEAD,
    )


class _Watcher(Protocol):
    def on_step(self, i: int, now: float, result: StepResult) -> None: ...


def _replay_watched(
    engines: list[SimEngine], loop: SessionLoop, router: PolicyRouter, watchers: list[_Watcher]
) -> ReplayResult:
    """The replay, each step shown to every watcher in turn; a restore driver among them is
    bound to the engines and also hears of each finished request."""
    ahead = next((w for w in watchers if isinstance(w, PrefetchDriver)), None)
    if ahead is not None:
        ahead.bind(engines, router.predict)

    def on_finish(rec: RequestRecord) -> list[Arrival | Timer]:
        return [*loop.on_finish(rec), *(ahead.on_finish(rec) if ahead else ())]

    def on_step(i: int, now: float, result: StepResult) -> None:
        for w in watchers:
            w.on_step(i, now, result)

    return replay(engines, loop.arrivals(), router, on_step=on_step, on_finish=on_finish)


def restore_fields(ahead: PrefetchDriver | None) -> dict[str, object]:
    """A row's restore figures: restores issued, used, restored bytes and the share of them
    no turn used (None without restore ahead), and the summary without its rows."""
    if ahead is None:
        return dict.fromkeys((*_RESTORE_FIELDS, "restore"))
    summary = ahead.summary()
    summary.pop("rows")
    out: dict[str, object] = {k: summary[s] for k, s in _RESTORE_FIELDS.items()}
    out["restore"] = summary
    return out


_RESTORE_FIELDS = {
    "restores": "prefetches",
    "restores_used": "used",
    "restored_bytes": "restored_bytes",
    "restored_unused_bytes": "unused_bytes",
    "restored_unused_share": "unused_bytes_share",
}
"""A row's restore figure -> the driver's summary's."""


def plan_fields(plan: Stack) -> dict[str, object]:
    return {
        "routing": plan.routing,
        "residency": plan.residency,
        "host_tier": plan.host,
        "appliance_workers": plan.appliance_workers,
    }


def prompt_chunk(engine: SimEngine) -> int:
    """The most tokens of one prompt a worker computes in a step beside other work: the whole
    step with one prompt a step, else vLLM's long prefill threshold (0: none)."""
    if engine.prompt_a_step:
        return engine.max_num_batched_tokens
    return engine.long_prefill_token_threshold


def worker_settings(engine: SimEngine) -> dict[str, object]:
    """The scheduler settings a stack's workers ran with."""
    return {
        "scheduling_policy": engine.policy,
        "max_num_batched_tokens": engine.max_num_batched_tokens,
        "long_prefill_token_threshold": engine.long_prefill_token_threshold,
        "prompt_a_step": engine.prompt_a_step,
    }


def _in_window(result: ReplayResult, start_s: float, end_s: float) -> ReplayResult:
    kept = [r for r in result.records if start_s < r.arrival_s <= end_s]
    return ReplayResult(kept, result.engine_stats, result.end_s, result.num_steps)
