"""`run_replay`: load a trace, compute the bounds, replay every routing policy under every
residency policy, report; `run_workload`: the same for a closed-loop agent workload.

Rows run one after another, or `jobs` at a time in forked processes (each replay is
single-threaded and independent; results do not depend on `jobs`).
"""

from __future__ import annotations

import multiprocessing
import sys
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

from appliance.policy.residency import residency_policy
from appliance.replay.bounds import block_keys, compute_bounds, trace_stats_check
from appliance.replay.closed_loop import AgentTaskLike
from appliance.replay.report import write_report
from appliance.replay.routers import POLICY_NAMES
from appliance.replay.runner import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_GPU_SECOND,
    DEFAULT_RESIDENCY,
    ReplaySetup,
    fitting,
    make_setup,
    replay_policy,
    replay_workload,
    row_name,
)
from appliance.replay.traces import Trace, load_trace, trace_stats_file
from appliance.sim.latency import LatencyModel


def run_replay(
    trace: Path,
    *,
    policies: list[str] | None = None,
    residencies: list[str] | None = None,
    workers: int = 8,
    gpu_profile: Path | None = None,
    hbm_gib: float | None = None,
    report: Path | None = None,
    progress: bool = False,
    jobs: int = 1,
    limit: int | None = None,
    block_size: int = DEFAULT_BLOCK_SIZE,
) -> dict[str, Any]:
    """Replay `trace` through each routing policy (default: all, the appliance's first)
    under each residency policy (default: `lru`) on `workers` simulated GPUs of
    `gpu_profile` with `hbm_gib` of KV cache each; returns the report and writes it (JSON,
    and a PNG beside it when matplotlib is there) to `report`. `limit` replays only the
    first N requests. ValueError for an unknown policy."""
    rows = _rows(policies, residencies)
    setup, latency = make_setup(
        workers=workers, gpu_profile=gpu_profile, hbm_gib=hbm_gib, block_size=block_size
    )
    loaded = load_trace(trace, limit=limit)
    replayed = fitting(loaded, setup)
    keys = block_keys(replayed, setup.block_size)
    bounds = compute_bounds(replayed, setup.block_size, setup.pooled_blocks, keys)
    optimal_fresh = bounds["optimal"].fresh_prefill_tokens
    out: dict[str, Any] = {
        "trace": {
            **replayed.summary(),
            "skipped_requests": len(loaded.records) - len(replayed.records),
        },
        "setup": setup.to_json(),
        "bounds": {name: b.to_json() for name, b in bounds.items()},
    }
    stats = trace_stats_file(Path(trace))
    if stats is not None and limit is None and replayed is loaded:
        out["trace_stats_check"] = trace_stats_check(stats, bounds)
    one = partial(_trace_row, replayed, setup, latency, optimal_fresh)
    return _with_rows(out, rows, one, jobs=jobs, progress=progress, report=report)


def run_workload(
    tasks: Sequence[AgentTaskLike],
    *,
    policies: list[str] | None = None,
    residencies: list[str] | None = None,
    workers: int = 8,
    gpu_profile: Path | None = None,
    hbm_gib: float | None = None,
    report: Path | None = None,
    progress: bool = False,
    jobs: int = 1,
    block_size: int = DEFAULT_BLOCK_SIZE,
    gpu_second: float = DEFAULT_GPU_SECOND,
    source: str = "workload",
) -> dict[str, Any]:
    """Replay closed-loop agent `tasks` (`closed_loop.py`) through each routing policy under
    each residency policy, as `run_replay` does a trace; no bounds (a closed loop's order
    depends on the policy), the task figures (deadline goodput, cost per successful task at
    `gpu_second` per GPU-second) filled in."""
    rows = _rows(policies, residencies)
    setup, latency = make_setup(
        workers=workers, gpu_profile=gpu_profile, hbm_gib=hbm_gib, block_size=block_size
    )
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
    one = partial(_workload_row, tasks, setup, latency, gpu_second)
    return _with_rows(out, rows, one, jobs=jobs, progress=progress, report=report)


def _trace_row(
    trace: Trace,
    setup: ReplaySetup,
    latency: LatencyModel,
    optimal_fresh: int,
    policy: str,
    residency: str,
    progress: bool,
) -> dict[str, object]:
    return replay_policy(
        trace,
        policy,
        setup,
        latency,
        residency=residency,
        optimal_fresh=optimal_fresh,
        progress=progress,
    )


def _workload_row(
    tasks: Sequence[AgentTaskLike],
    setup: ReplaySetup,
    latency: LatencyModel,
    gpu_second: float,
    policy: str,
    residency: str,
    progress: bool,
) -> dict[str, object]:
    return replay_workload(
        tasks, policy, setup, latency, residency=residency, gpu_second=gpu_second
    )


def _rows(policies: list[str] | None, residencies: list[str] | None) -> list[tuple[str, str]]:
    """(routing, residency) per report row, routing-major; ValueError for unknown names."""
    names = list(policies) if policies else list(POLICY_NAMES)
    unknown = [p for p in names if p not in POLICY_NAMES]
    if unknown:
        raise ValueError(
            f"unknown routing policy {', '.join(unknown)}; known: {', '.join(POLICY_NAMES)}"
        )
    holds = [residency_policy(r).name for r in (residencies or [DEFAULT_RESIDENCY])]
    rows = [(p, r) for p in names for r in holds]
    if len({row_name(p, r) for p, r in rows}) != len(rows):
        raise ValueError("a routing or residency policy is named twice")
    return rows


def _run_rows(
    rows: list[tuple[str, str]],
    one: Callable[[str, str, bool], dict[str, object]],
    *,
    jobs: int,
    progress: bool,
) -> dict[str, dict[str, object]]:
    results: dict[str, dict[str, object]] = {}
    if jobs > 1 and len(rows) > 1:
        ctx = multiprocessing.get_context("fork")
        with ProcessPoolExecutor(max_workers=min(jobs, len(rows)), mp_context=ctx) as pool:
            futures = {row_name(p, r): pool.submit(one, p, r, False) for p, r in rows}
            for name, future in futures.items():
                results[name] = future.result()
                if progress:
                    sys.stderr.write(f"{name:<28} done in {results[name]['wall_s']} s\n")
    else:
        for p, r in rows:
            results[row_name(p, r)] = one(p, r, progress)
    return results


def _with_rows(
    out: dict[str, Any],
    rows: list[tuple[str, str]],
    one: Callable[[str, str, bool], dict[str, object]],
    *,
    jobs: int,
    progress: bool,
    report: Path | None,
) -> dict[str, Any]:
    """`out` with every row's replay under "policies", written to `report` when given."""
    out["policies"] = _run_rows(rows, one, jobs=jobs, progress=progress)
    if report is not None:
        out["files"] = [str(p) for p in write_report(out, Path(report))]
    return out
