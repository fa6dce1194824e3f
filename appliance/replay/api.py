"""`run_replay`: load a trace, compute the bounds, replay every routing policy under every
residency policy, report; `run_workload`: the same for a closed-loop agent workload.

Rows run one after another, or `jobs` at a time in forked processes (each replay is
single-threaded and independent; results do not depend on `jobs`).

With a host tier (`host_gib` per worker), the report adds the bound `optimal_with_host`
(Belady at HBM + host capacity, `bounds.py`) and, for the first routing policy under each
residency policy, a `+pooled-host` row: the same replay with one host tier of all
workers' host memory shared by every worker. That is a run, not a bound: a bound of a
pooled host tier is the pooled optimum already given, and says nothing about what the
sharing gains under real placement. `pooled_host_gain` compares each such row with its
per-worker twin: fresh prefill saved, host hits gained, TTFT p95 change.

With worker-reaper settings (`worker_reapers`, `power.py`), every row watches its workers'
power states (all always awake: the baseline), and the first routing policy under the
first residency policy adds a `+worker-reaper:SETTING` row per setting, its workers
sleeping or stopping when idle; each such row's `power.added_ttft_p95_s` is its TTFT p95
less the always-awake row's.
"""

from __future__ import annotations

import multiprocessing
import sys
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

from appliance.perf.latency import LatencyModel
from appliance.policy.residency_by_name import residency_plan
from appliance.policy.wait_curves import LogNormal
from appliance.replay.bounds import (
    block_keys,
    compute_bounds,
    trace_stats_check,
    ttft_floor,
    unbounded_hits,
)
from appliance.replay.closed_loop import AgentTaskLike
from appliance.replay.power import ReaperSetting, parse_worker_reaper
from appliance.replay.report import write_report
from appliance.replay.routers import POLICY_NAMES
from appliance.replay.runner import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_GPU_SECOND,
    DEFAULT_RESIDENCY,
    ReplaySetup,
    Row,
    fitting,
    make_setup,
    replay_policy,
)
from appliance.replay.traces import Trace, load_trace, trace_stats_file
from appliance.replay.workload_replay import replay_workload


def run_replay(
    trace: Path,
    *,
    policies: list[str] | None = None,
    residencies: list[str] | None = None,
    workers: int = 8,
    gpu_profile: Path | None = None,
    hbm_gib: float | None = None,
    host_gib: float = 0.0,
    report: Path | None = None,
    progress: bool = False,
    jobs: int = 1,
    limit: int | None = None,
    block_size: int = DEFAULT_BLOCK_SIZE,
    worker_reapers: list[str] | None = None,
) -> dict[str, Any]:
    """Replay `trace` through each routing policy (default: all, the appliance's first)
    under each residency policy (default: `lru`) on `workers` simulated GPUs of
    `gpu_profile` with `hbm_gib` of KV cache and `host_gib` of host memory each; returns
    the report and writes it (JSON, and a PNG beside it when matplotlib is there) to
    `report`. `limit` replays only the first N requests; `worker_reapers`: settings of
    idle workers' sleep (`IDLE_S[:MAX_WAKE_S[:MIN_AWAKE]]`). ValueError for an unknown
    policy."""
    setup, latency = make_setup(
        workers=workers,
        gpu_profile=gpu_profile,
        hbm_gib=hbm_gib,
        host_gib=host_gib,
        block_size=block_size,
    )
    rows = _rows(policies, residencies, setup, workload=False, reapers=worker_reapers)
    loaded = load_trace(trace, limit=limit)
    replayed = fitting(loaded, setup)
    bs, host = setup.block_size, setup.pooled_host_blocks
    keys = block_keys(replayed, bs)
    hits = unbounded_hits([r.input_length for r in replayed.records], keys, bs)
    bounds = compute_bounds(replayed, bs, setup.pooled_blocks, keys, host_blocks=host, hits=hits)
    floor = ttft_floor(replayed, hits, latency, setup.max_num_batched_tokens)
    optimal_fresh = bounds["optimal"].fresh_prefill_tokens
    with_host = bounds.get("optimal_with_host")
    out: dict[str, Any] = {
        "trace": {
            **replayed.summary(),
            "skipped_requests": len(loaded.records) - len(replayed.records),
        },
        "setup": setup.to_json(),
        "bounds": {name: b.to_json() for name, b in bounds.items()},
        "ttft_floor": floor.to_json(),
    }
    stats = trace_stats_file(Path(trace))
    if stats is not None and limit is None and replayed is loaded:
        out["trace_stats_check"] = trace_stats_check(stats, bounds)
    optima = (optimal_fresh, with_host.fresh_prefill_tokens if with_host else None)
    one = partial(_trace_row, replayed, setup, latency, optima)
    return _with_rows(out, rows, one, jobs=jobs, progress=progress, report=report)


def run_workload(
    tasks: Sequence[AgentTaskLike],
    *,
    policies: list[str] | None = None,
    residencies: list[str] | None = None,
    workers: int = 8,
    gpu_profile: Path | None = None,
    hbm_gib: float | None = None,
    host_gib: float = 0.0,
    report: Path | None = None,
    progress: bool = False,
    jobs: int = 1,
    block_size: int = DEFAULT_BLOCK_SIZE,
    gpu_second: float = DEFAULT_GPU_SECOND,
    source: str = "workload",
    wait_priors: Mapping[str, LogNormal] | None = None,
    worker_reapers: list[str] | None = None,
) -> dict[str, Any]:
    """Replay closed-loop agent `tasks` (`closed_loop.py`) through each routing policy under
    each residency policy, as `run_replay` does a trace; no bounds (a closed loop's order
    depends on the policy), the task figures (deadline goodput, cost per successful task at
    `gpu_second` per GPU-second) filled in; `wait_priors` (tool class -> its wait, e.g.
    `residency.wait_priors(spec.tool_classes)`) are the reaper's priors."""
    setup, latency = make_setup(
        workers=workers,
        gpu_profile=gpu_profile,
        hbm_gib=hbm_gib,
        host_gib=host_gib,
        block_size=block_size,
    )
    rows = _rows(policies, residencies, setup, workload=True, reapers=worker_reapers)
    out: dict[str, Any] = {
        "trace": {
            "path": source,
            "format": "closed-loop",
            "requests": sum(len(t.turns) for t in tasks),
            "sessions": len(tasks),
            "session_source": "tasks",
        },
        "setup": setup.to_json(),
        "bounds": {},
    }
    one = partial(_workload_row, tasks, setup, latency, gpu_second, wait_priors)
    return _with_rows(out, rows, one, jobs=jobs, progress=progress, report=report)


def _trace_row(
    trace: Trace,
    setup: ReplaySetup,
    latency: LatencyModel,
    optima: tuple[int, int | None],
    row: Row,
    progress: bool,
) -> dict[str, object]:
    return replay_policy(
        trace,
        row.policy,
        setup,
        latency,
        residency=row.residency,
        optimal_fresh=optima[0],
        optimal_with_host_fresh=optima[1],
        pooled_host=row.pooled_host,
        progress=progress,
        reaper=row.reaper,
    )


def _workload_row(
    tasks: Sequence[AgentTaskLike],
    setup: ReplaySetup,
    latency: LatencyModel,
    gpu_second: float,
    wait_priors: Mapping[str, LogNormal] | None,
    row: Row,
    progress: bool,
) -> dict[str, object]:
    return replay_workload(
        tasks,
        row.policy,
        setup,
        latency,
        residency=row.residency,
        gpu_second=gpu_second,
        pooled_host=row.pooled_host,
        wait_priors=wait_priors,
        reaper=row.reaper,
    )


def _rows(
    policies: list[str] | None,
    residencies: list[str] | None,
    setup: ReplaySetup,
    *,
    workload: bool,
    reapers: list[str] | None = None,
) -> list[Row]:
    """The report's rows, routing-major, then (with a host tier) the first routing policy
    under each residency policy with the host tier pooled, then (with worker-reaper
    settings) the first routing and residency policy under each setting; ValueError for
    unknown names, and for the reaper's options on a trace (no announcements, no child
    tasks)."""
    names = list(policies) if policies else list(POLICY_NAMES)
    unknown = [p for p in names if p not in POLICY_NAMES]
    if unknown:
        raise ValueError(
            f"unknown routing policy {', '.join(unknown)}; known: {', '.join(POLICY_NAMES)}"
        )
    plans = [residency_plan(r) for r in (residencies or [DEFAULT_RESIDENCY])]
    if not workload and any(p.prefetch or p.branches for p in plans):
        raise ValueError("+lead-time and +branches replay a closed-loop workload (--workload)")
    holds = [p.policy.name for p in plans]
    settings = [parse_worker_reaper(r) for r in reapers or ()]
    watch = ReaperSetting() if settings else None
    rows = [Row(p, r, reaper=watch) for p in names for r in holds]
    rows += [Row(names[0], holds[0], reaper=s) for s in settings]
    if len({row.name for row in rows}) != len(rows):
        raise ValueError(
            "a routing policy, residency policy or worker-reaper setting is named twice"
        )
    if setup.host_blocks_per_worker:
        rows += [Row(names[0], r, pooled_host=True) for r in holds]
    return rows


def _run_rows(
    rows: list[Row],
    one: Callable[[Row, bool], dict[str, object]],
    *,
    jobs: int,
    progress: bool,
) -> dict[str, dict[str, object]]:
    results: dict[str, dict[str, object]] = {}
    if jobs > 1 and len(rows) > 1:
        ctx = multiprocessing.get_context("fork")
        with ProcessPoolExecutor(max_workers=min(jobs, len(rows)), mp_context=ctx) as pool:
            futures = {row.name: pool.submit(one, row, False) for row in rows}
            for name, future in futures.items():
                results[name] = future.result()
                if progress:
                    sys.stderr.write(f"{name:<28} done in {results[name]['wall_s']} s\n")
    else:
        for row in rows:
            results[row.name] = one(row, progress)
    return results


def pooled_host_gain(rows: list[Row], results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Per `+pooled-host` row, what pooling the host tier gained over its per-worker twin."""
    out: dict[str, Any] = {}
    for row in rows:
        if not row.pooled_host:
            continue
        pooled, own = results[row.name], results[row.twin.name]
        out[row.name] = {
            "versus": row.twin.name,
            "fresh_prefill_saved_tokens": own["fresh_prefill_tokens"]
            - pooled["fresh_prefill_tokens"],
            "host_hit_tokens_gained": pooled["host_hit_tokens"] - own["host_hit_tokens"],
            "ttft_p95_change_s": _difference(pooled["ttft_p95_s"], own["ttft_p95_s"]),
        }
    return out


def _added_ttft(rows: list[Row], results: dict[str, dict[str, Any]]) -> None:
    """Each sleeping row's TTFT p95 less its always-awake row's, in its `power`."""
    for row in rows:
        if row.reaper is not None and row.reaper.worker_idle_s is not None:
            awake = results[Row(row.policy, row.residency, reaper=ReaperSetting()).name]
            mine = results[row.name]
            mine["power"]["added_ttft_p95_s"] = _difference(mine["ttft_p95_s"], awake["ttft_p95_s"])


def _difference(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else round(a - b, 4)


def _with_rows(
    out: dict[str, Any],
    rows: list[Row],
    one: Callable[[Row, bool], dict[str, object]],
    *,
    jobs: int,
    progress: bool,
    report: Path | None,
) -> dict[str, Any]:
    """`out` with every row's replay under "policies", written to `report` when given."""
    out["policies"] = _run_rows(rows, one, jobs=jobs, progress=progress)
    _added_ttft(rows, out["policies"])
    gain = pooled_host_gain(rows, out["policies"])
    if gain:
        out["pooled_host_gain"] = gain
    if report is not None:
        out["files"] = [str(p) for p in write_report(out, Path(report))]
    return out
