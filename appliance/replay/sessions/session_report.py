"""`run_sessions`: recorded agent sessions (a folder of kv-cache-tester session files, or
one) through each stack (`session_replay.STACKS`) at a fixed number of users, or the
capacity of each: the most users whose steady-state TTFT p95 meets an SLO.

Stacks run one after another, or `jobs` at a time in forked processes (each replay is
single-threaded and independent; results do not depend on `jobs`). Each capacity step is
printed as it ends (`say`). The report: `rows` (one per stack, with `capacity_sessions`
and its `steps` in a capacity search; with a capacity search also the clairvoyant bound's,
stack `bound`, `session_bound.py`, its capacity also as `bound_sessions`), the sessions'
summary, the simulated box, the window, and the TTFT floor
(`session_bound.session_ttft_floor`: each request alone, so no stack's TTFT is lower).
"""

from __future__ import annotations

import json
import math
import multiprocessing
import random
import sys
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

from appliance.perf.latency import LatencyModel
from appliance.replay.runner import DEFAULT_MAX_MODEL_LEN, ReplaySetup, make_setup
from appliance.replay.sessions.capacity_search import SEARCH_FACTOR, capacity, first_count
from appliance.replay.sessions.run_window import RunWindow
from appliance.replay.sessions.session_bound import session_ttft_floor
from appliance.replay.sessions.session_replay import (
    BOUND,
    DEFAULT_WINDOW,
    STACKS,
    replay_stack,
    stack_plan,
)
from appliance.replay.sessions.ttft_at_p95 import BAND, LONG_PREFILL_TOKENS
from appliance.workload.agent_traces import AgentSessionTrace, read_agent_sessions
from appliance.workload.session_columns import SESSION_COLUMNS
from appliance.workload.session_summary import sessions_summary

SESSION_BLOCK_SIZE = 64
"""The traces' own block: one hash id, one block (vLLM on CUDA takes any multiple of 16)."""
_SHOWN = (
    *SESSION_COLUMNS,
    "restores",
    "restored_unused_share",
    "wall_s",
)


def run_sessions(
    path: Path,
    *,
    stacks: list[str] | None = None,
    users: int | None = None,
    slo_ttft_p95_s: float | None = None,
    workers: int = 8,
    gpu_profile: Path | None = None,
    hbm_gib: float | None = None,
    host_gib: float = 0.0,
    window: RunWindow = DEFAULT_WINDOW,
    jobs: int = 1,
    report: Path | None = None,
    seed: int | None = None,
    say: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Replay the sessions at `path` through each of `stacks` (default: all) at `users`
    sessions at once, or (with `slo_ttft_p95_s`) find each one's capacity; returns the
    report and writes it (JSON) to `report`. The sessions start in the files' order, or
    in one drawn from `seed`."""
    names = _checked(stacks, users, slo_ttft_p95_s)
    sessions = session_order(read_agent_sessions(path), seed)
    setup, latency = make_setup(
        workers=workers,
        gpu_profile=gpu_profile,
        hbm_gib=hbm_gib,
        host_gib=host_gib,
        block_size=SESSION_BLOCK_SIZE,
        max_model_len=DEFAULT_MAX_MODEL_LEN,
    )
    job = partial(
        _stack_row,
        sessions=sessions,
        setup=setup,
        latency=latency,
        users=users,
        slo=slo_ttft_p95_s,
        window=window,
        say=say or _to_stderr,
    )
    if slo_ttft_p95_s is not None and BOUND not in names:
        names = [*names, BOUND]  # the clairvoyant bound's capacity, as a last row
    rows = _run_all(job, names, jobs)
    out: dict[str, Any] = {
        "source": str(path),
        "seed": seed,
        "sessions": sessions_summary(sessions),
        "setup": setup.to_json(),
        "window": {"duration_s": window.duration_s, "warmup_s": window.warmup_s},
        "slo_ttft_p95_s": slo_ttft_p95_s,
        "ttft_floor": session_ttft_floor(sessions, latency, setup.max_model_len),
        "rows": rows,
        "bound_sessions": next(
            (r.get("capacity_sessions") for r in rows if r["stack"] == BOUND), None
        ),
    }
    if report is not None:
        report.write_text(json.dumps(out, indent=1, default=str))
    return out


def session_order(sessions: list[AgentSessionTrace], seed: int | None) -> list[AgentSessionTrace]:
    """The order users take the sessions in: the files' (`seed` None), or a shuffle drawn
    from `seed`. Which sessions run side by side moves a pass's TTFT p95 by a few per cent
    (at 149 users, 1.35 to 1.44 s between neighbouring counts); passes over several orders
    tell a policy's gain from that noise."""
    if seed is None:
        return sessions
    drawn = list(sessions)
    random.Random(seed).shuffle(drawn)
    return drawn


_JOB: Callable[[str], dict[str, Any]] | None = None
"""The stack replay of the report being made, for forked workers to inherit."""


def _checked(stacks: list[str] | None, users: int | None, slo: float | None) -> list[str]:
    """The stacks to run (default: all); ValueError for a bad request."""
    names = stacks or list(STACKS)
    unknown = [s for s in names if s not in STACKS and s != BOUND]
    if unknown:
        raise ValueError(f"unknown stack {unknown[0]!r}; known: {', '.join([*STACKS, BOUND])}")
    if (users is None) == (slo is None):
        raise ValueError("give --users N, or --capacity with --slo-ttft-p95 S")
    if users is not None and users < 1:
        raise ValueError(f"--users must be at least 1, got {users}")
    return names


def _run_all(
    job: Callable[[str], dict[str, Any]], names: list[str], jobs: int
) -> list[dict[str, Any]]:
    """`job` for each stack: in turn, or `jobs` at a time in forked processes."""
    global _JOB
    _JOB = job
    try:
        if jobs > 1 and len(names) > 1:
            ctx = multiprocessing.get_context("fork")  # the children inherit `_JOB`
            with ProcessPoolExecutor(max_workers=min(jobs, len(names)), mp_context=ctx) as pool:
                return list(pool.map(_run_job, names))
        return [_run_job(name) for name in names]
    finally:
        _JOB = None


def _run_job(stack: str) -> dict[str, Any]:
    assert _JOB is not None
    return _JOB(stack)


def _to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _stack_row(
    stack: str,
    *,
    sessions: list[AgentSessionTrace],
    setup: ReplaySetup,
    latency: LatencyModel,
    users: int | None,
    slo: float | None,
    window: RunWindow,
    say: Callable[[str], None],
) -> dict[str, Any]:
    if slo is not None:
        window = replace(window, give_up_over_p95_s=slo)  # a step that must miss ends there

    def run(n: int) -> dict[str, object]:
        return replay_stack(sessions, stack, setup, latency, users=n, window=window)

    if users is not None:
        return run(users)
    assert slo is not None
    # One pass counts every session at any count: a single miss above the best says enough.
    confirm = 1 if window.duration_s == math.inf else 2
    start = first_count(sessions, setup, host=stack_plan(stack).host)
    found, steps = capacity(
        run, slo, start=start, factor=SEARCH_FACTOR, confirm_misses=confirm, say=say
    )
    at = [r for r in steps if r["users"] == found]
    row: dict[str, Any] = dict(at[0]) if at else {"stack": stack, "users": 0}
    row["capacity_sessions"] = found
    row["steps"] = [{k: r[k] for k in ("users", "ttft_p95_s", "hit_rate")} for r in steps]
    return row


def render_session_report(out: dict[str, Any]) -> str:
    """The report as a table: a line per stack."""
    s = out["sessions"]
    setup = out["setup"]
    order = "" if out.get("seed") is None else f" in the order of seed {out['seed']}"
    lines = [
        f"{s['sessions']} sessions ({s['requests']} requests) from {out['source']}{order}; "
        f"{setup['workers']} workers x {setup['kv_gib_per_worker']} GiB KV, host "
        f"{setup['host_gib_per_worker']} GiB each; counted from {out['window']['warmup_s']:g} s "
        f"to {_window_end(out['window']['duration_s'])}",
    ]
    slo = out["slo_ttft_p95_s"]
    head = ["stack", *(["capacity"] if slo is not None else []), *_SHOWN]
    table = [head]
    for row in out["rows"]:
        cap = [str(row["capacity_sessions"])] if slo is not None else []
        table.append([row["stack"], *cap, *(_cell(row.get(k)) for k in _SHOWN)])
    widths = [max(len(r[i]) for r in table) for i in range(len(head))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in table]
    floor = out["ttft_floor"]
    lines.append(
        f"TTFT floor (each request alone, its session's prefix cached): p50 "
        f"{floor['p50_s']} s, p95 {floor['p95_s']} s, p99 {floor['p99_s']} s"
    )
    lines += [
        _at_p95_line(row) for row in out["rows"] if row.get("ttft_at_p95", {}).get("requests")
    ]
    if slo is not None:
        lines.append(
            f"capacity: the most users whose TTFT p95 is at most {slo:g} s; the "
            f"clairvoyant bound: {out['bound_sessions']}"
        )
    return "\n".join(lines)


def _at_p95_line(row: dict[str, Any]) -> str:
    """Where the stack's TTFT p95 went (`ttft_at_p95.py`)."""
    t = row["ttft_at_p95"]
    return (
        f"{row['stack']} at {row['users']} users: the {t['requests']} requests within "
        f"{BAND:.0%} of its TTFT p95, on average: own prefill {t['own_prefill_s']} s, chunking "
        f"{t['chunking_s']} s, host copies {t['host_load_s']} s, waiting {t['waiting_s']} s; "
        f"{t['long_prefill_share']:.0%} prefilled over {LONG_PREFILL_TOKENS:,} tokens"
    )


def _window_end(duration_s: float) -> str:
    return "the last session's start" if duration_s == float("inf") else f"{duration_s:g} s"


def _cell(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "-" if value is None else str(value)
