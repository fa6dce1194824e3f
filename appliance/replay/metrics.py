"""Per-policy figures from one replay: prefill, cache hits, latency tails, balance.

Definitions (times in virtual seconds, token counts in tokens):
- fresh_prefill_tokens: prompt tokens computed at a request's first scheduling, i.e.
  prompt minus `cached_tokens`, the prefix-cache hit then, on the GPU or loaded from the
  host tier (vLLM's `prompt_tokens_by_source`); recomputation after a preemption is not
  included. host_hit_tokens: of `cached_tokens`, those loaded from the host tier (vLLM's
  `prompt_tokens_cached_by_source{source="host"}`); host_load_s: the seconds of those
  host -> GPU copies, each within its request's TTFT; host_stored_blocks,
  host_evicted_blocks: blocks copied to and evicted from the host tiers.
- ttft: first token minus arrival. step: finish minus arrival (one agent step, one LLM
  call). session: the last finish of a session minus its first arrival (tool and think
  time between turns included, as the trace spaces them).
- imbalance: the busiest worker's GPU time over the mean (1.0 = even); requests_imbalance
  and prefill_imbalance the same over requests routed and fresh prefill tokens computed.
- vs_optimal: fresh_prefill_tokens over the optimal bound's (1.0 = as good as Belady);
  vs_optimal_with_host: the same over Belady's at HBM + host capacity (when there is a
  host tier).
- preemptions: requests the engines sent back to waiting; pins, pins_expired,
  pins_resumed, pins_reclaimed: residency holds taken, and how they ended (their TTL ran
  out; the session came back; an allocation took them back early); demotions, evictions:
  turns (or held sessions) whose blocks went to the host tier, or first in the GPU's
  eviction order.
- Tasks (closed-loop workloads only; null for a trace, which has neither deadlines nor
  outcomes): deadline_goodput is the share of tasks with a deadline that finished all their
  turns by it (null when no task has one); cost_per_success is `appliance.policy.costs`'s
  rule, all tasks' GPU-seconds priced per GPU-second over root tasks that succeeded with
  verified=true (null when none did); discarded_branches counts the child tasks whose
  results their parent dropped when it joined them (a fan-out's `keep`; their descendants
  too), and discarded_cost_share is their share of all tasks' attempted cost at the same
  price (0.0 when none was dropped; null when nothing was spent).
Percentiles are nearest-rank.
"""

from __future__ import annotations

from collections.abc import Sequence

from appliance.domain.percentile import nearest_rank
from appliance.domain.records import CostMode, Price, TaskStatus
from appliance.policy.costs import AttemptRow, TaskRow, attempt_cost, cost_per_success
from appliance.replay.closed_loop import TaskOutcome
from appliance.sim.core.engine_stats import EngineStats
from appliance.sim.runtime.virtual import ReplayResult, RequestRecord

TASK_KEYS = (
    "tasks",
    "tasks_completed",
    "deadline_goodput",
    "gpu_s",
    "cost_per_success",
    "discarded_branches",
    "discarded_cost_share",
)


def _r(x: float | None, digits: int = 4) -> float | None:
    return None if x is None else round(x, digits)


def _max_over_mean(values: Sequence[float]) -> float | None:
    mean = sum(values) / len(values) if values else 0.0
    return round(max(values) / mean, 4) if mean else None


def policy_metrics(
    result: ReplayResult,
    sessions: dict[str, str],
    *,
    optimal_fresh: int | None = None,
    optimal_with_host_fresh: int | None = None,
    workers: int,
    pooled_host: bool = False,
    tasks: dict[str, object] | None = None,
) -> dict[str, object]:
    """`sessions` maps request id to session id; `tasks` is `task_metrics` of a
    closed-loop workload (None: a trace, whose task figures are null); `pooled_host`: the
    engines share one host tier."""
    recs, stats = result.records, result.engine_stats
    step = [r.finish_s - r.arrival_s for r in recs if r.finish_s is not None]
    prefill = _prefill(recs, stats, optimal_fresh, optimal_with_host_fresh, pooled_host)
    return {
        "requests": len(recs),
        "finished": len(step),
        **prefill,
        **_latency(recs, step, sessions),
        **_balance(recs, stats, workers),
        **_engine_counts(stats),
        **(tasks if tasks is not None else dict.fromkeys(TASK_KEYS)),
        "generated_tokens": sum(s.generation_tokens_total for s in stats),
        "engine_steps": result.num_steps,
        "sim_span_s": round(result.end_s, 3),
    }


def _prefill(
    recs: Sequence[RequestRecord],
    stats: Sequence[EngineStats],
    optimal_fresh: int | None,
    optimal_with_host_fresh: int | None,
    pooled_host: bool,
) -> dict[str, object]:
    """Prompt tokens computed and found in the caches, against the optimal bounds."""
    prompt = sum(r.prompt_tokens for r in recs)
    cached = sum(r.cached_tokens for r in recs)
    fresh = prompt - cached
    return {
        "prompt_tokens": prompt,
        "fresh_prefill_tokens": fresh,
        "cached_tokens": cached,
        "hit_ratio": round(cached / prompt, 6) if prompt else 0.0,
        "vs_optimal": round(fresh / optimal_fresh, 4) if optimal_fresh else None,
        "vs_optimal_with_host": (
            round(fresh / optimal_with_host_fresh, 4) if optimal_with_host_fresh else None
        ),
        "host_hit_tokens": sum(r.host_cached_tokens for r in recs),
        "host_load_s": round(sum(s.host_load_s_total for s in stats), 3),
        "host_stored_blocks": _host_blocks(stats, "host_stored_blocks_total", pooled=pooled_host),
        "host_evicted_blocks": _host_blocks(stats, "host_evicted_blocks_total", pooled=pooled_host),
    }


def _latency(
    recs: Sequence[RequestRecord], step: Sequence[float], sessions: dict[str, str]
) -> dict[str, object]:
    """TTFT, step and session tails."""
    ttft = [t for r in recs if (t := r.ttft_s) is not None]
    session_s = _session_spans(recs, sessions)
    return {
        "ttft_p50_s": _r(nearest_rank(ttft, 0.50)),
        "ttft_p95_s": _r(nearest_rank(ttft, 0.95)),
        "ttft_p99_s": _r(nearest_rank(ttft, 0.99)),
        "ttft_mean_s": _r(sum(ttft) / len(ttft) if ttft else None),
        "step_p50_s": _r(nearest_rank(step, 0.50)),
        "step_p95_s": _r(nearest_rank(step, 0.95)),
        "step_p99_s": _r(nearest_rank(step, 0.99)),
        "session_p50_s": _r(nearest_rank(session_s, 0.50), 2),
        "session_p95_s": _r(nearest_rank(session_s, 0.95), 2),
        "sessions": len(session_s),
    }


def _session_spans(recs: Sequence[RequestRecord], sessions: dict[str, str]) -> list[float]:
    """Each session's last finish minus its first arrival (finished requests only)."""
    span: dict[str, list[float]] = {}
    for r in recs:
        if r.finish_s is None:
            continue
        s = span.setdefault(sessions.get(r.request_id, r.request_id), [r.arrival_s, r.finish_s])
        s[0] = min(s[0], r.arrival_s)
        s[1] = max(s[1], r.finish_s)
    return [b - a for a, b in span.values()]


def _balance(
    recs: Sequence[RequestRecord], stats: Sequence[EngineStats], workers: int
) -> dict[str, object]:
    """The busiest worker over the mean, by GPU time, requests and fresh prefill."""
    per_worker = [0] * workers
    fresh_per_worker = [0] * workers
    for r in recs:
        per_worker[r.worker] += 1
        fresh_per_worker[r.worker] += r.prompt_tokens - r.cached_tokens
    return {
        "imbalance": _max_over_mean([s.busy_s_total for s in stats]),
        "requests_imbalance": _max_over_mean([float(x) for x in per_worker]),
        "prefill_imbalance": _max_over_mean([float(x) for x in fresh_per_worker]),
    }


def _engine_counts(stats: Sequence[EngineStats]) -> dict[str, object]:
    """Preemptions and residency actions, summed over the engines."""
    return {
        "preemptions": sum(s.num_preemptions_total for s in stats),
        "pins": sum(s.pins_total for s in stats),
        "pins_expired": sum(s.pins_expired_total for s in stats),
        "pins_resumed": sum(s.pins_resumed_total for s in stats),
        "pins_reclaimed": sum(s.pins_reclaimed_total for s in stats),
        "demotions": sum(s.demotions_total for s in stats),
        "evictions": sum(s.evictions_total for s in stats),
    }


def _host_blocks(stats: Sequence[EngineStats], field: str, *, pooled: bool) -> int:
    """A host-tier counter summed over the workers' tiers (one tier when pooled)."""
    values = [int(getattr(s, field)) for s in stats]
    return values[0] if pooled and values else sum(values)


def task_metrics(outcomes: Sequence[TaskOutcome], *, gpu_second: float) -> dict[str, object]:
    """Deadline goodput, cost per successful task and the discarded branches' share of the
    cost of a closed-loop workload's tasks, each task's GPU-seconds priced at `gpu_second`
    (gpu_seconds mode)."""
    with_deadline = [o for o in outcomes if o.deadline_s is not None]
    met = sum(1 for o in with_deadline if o.met_deadline)
    price = Price(CostMode.GPU_SECONDS, effective_from=0.0, gpu_second=gpu_second)
    rows = [
        TaskRow(
            task_id=o.task_id,
            tenant=o.tenant,
            created_at=o.start_s,
            parent_task_id=o.parent_id,
            task_class=o.task_class,
            status=TaskStatus.SUCCEEDED if o.completed and o.succeeds else TaskStatus.FAILED,
            verified=o.verified,
        )
        for o in outcomes
    ]
    attempts = [
        AttemptRow(o.task_id, o.tenant, o.start_s, attempt_cost(price, gpu_s=o.gpu_s), o.turns_done)
        for o in outcomes
    ]
    groups = cost_per_success(rows, attempts, by=())
    per_success = groups[0].cost_per_success if groups else None
    spent = sum(a.cost or 0.0 for a in attempts)
    dropped = [a for a, o in zip(attempts, outcomes, strict=True) if o.discarded]
    dropped_cost = sum(a.cost or 0.0 for a in dropped)
    return {
        "tasks": len(outcomes),
        "tasks_completed": sum(1 for o in outcomes if o.completed),
        "deadline_goodput": round(met / len(with_deadline), 6) if with_deadline else None,
        "gpu_s": round(sum(o.gpu_s for o in outcomes), 3),
        "cost_per_success": None if per_success is None else round(per_success, 8),
        "discarded_branches": len(dropped),
        "discarded_cost_share": round(dropped_cost / spent, 6) if spent > 0 else None,
    }
