"""`run_replay`: load a trace, compute the bounds, replay every policy, report.

Policies run one after another, or `jobs` at a time in forked processes (each replay is
single-threaded and independent; results do not depend on `jobs`).
"""

from __future__ import annotations

import multiprocessing
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from appliance.replay.bounds import block_keys, compute_bounds, trace_stats_check
from appliance.replay.report import write_report
from appliance.replay.routers import POLICY_NAMES
from appliance.replay.runner import DEFAULT_BLOCK_SIZE, fitting, make_setup, replay_policy
from appliance.replay.traces import load_trace, trace_stats_file


def run_replay(
    trace: Path,
    *,
    policies: list[str] | None = None,
    workers: int = 8,
    gpu_profile: Path | None = None,
    hbm_gib: float | None = None,
    report: Path | None = None,
    progress: bool = False,
    jobs: int = 1,
    limit: int | None = None,
    block_size: int = DEFAULT_BLOCK_SIZE,
) -> dict[str, Any]:
    """Replay `trace` through each policy (default: all, the appliance's first) on `workers`
    simulated GPUs of `gpu_profile` with `hbm_gib` of KV cache each; returns the report and
    writes it (JSON, and a PNG beside it when matplotlib is there) to `report`.
    `limit` replays only the first N requests. ValueError for an unknown policy."""
    names = list(policies) if policies else list(POLICY_NAMES)
    unknown = [p for p in names if p not in POLICY_NAMES]
    if unknown:
        raise ValueError(
            f"unknown routing policy {', '.join(unknown)}; known: {', '.join(POLICY_NAMES)}"
        )
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
    results: dict[str, dict[str, object]] = {}
    if jobs > 1 and len(names) > 1:
        ctx = multiprocessing.get_context("fork")
        with ProcessPoolExecutor(max_workers=min(jobs, len(names)), mp_context=ctx) as pool:
            futures = {
                name: pool.submit(
                    replay_policy, replayed, name, setup, latency, optimal_fresh=optimal_fresh
                )
                for name in names
            }
            for name, future in futures.items():
                results[name] = future.result()
                if progress:
                    sys.stderr.write(f"{name:<20} done in {results[name]['wall_s']} s\n")
    else:
        for name in names:
            results[name] = replay_policy(
                replayed, name, setup, latency, optimal_fresh=optimal_fresh, progress=progress
            )
    out["policies"] = results
    if report is not None:
        out["files"] = [str(p) for p in write_report(out, Path(report))]
    return out
