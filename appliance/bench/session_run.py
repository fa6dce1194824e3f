"""`appliance bench --trace DIR --users N`: recorded agent sessions (a folder of
kv-cache-tester session files, or one) driven live against a running appliance
(`sessions.py`), reported as the replay reports them (`session_figures.py`).

The JSON report: `run` (what was run), `figures` (the counted requests', the router's CPU,
this client's CPU), `errors`, and `turns`: one row per request sent (session, seconds from
the start, prompt and cached tokens, TTFT, end-to-end seconds, worker), for checks that the
figures do not answer (how a session's cached tokens grow).
"""

from __future__ import annotations

import asyncio
import secrets
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from appliance.bench.client import ApplianceClient, BadInput, BenchError, probe
from appliance.bench.report import to_json
from appliance.bench.session_figures import (
    LiveTurn,
    SessionRecorder,
    metric_sums,
    render_live_sessions,
    router_figures,
    session_figures,
)
from appliance.bench.sessions import LiveSessions, SessionRunPlan
from appliance.workload.agent_traces import AgentSessionTrace, read_agent_sessions


def holds_sessions(path: Path) -> bool:
    """Recorded agent sessions: a folder, or a `.json` / `.json.gz` file."""
    return path.is_dir() or path.name.endswith((".json", ".json.gz"))


def run_session_bench(
    trace: Path,
    *,
    url: str,
    api_key: str,
    plan: SessionRunPlan,
    as_json: bool = False,
    report: Path | None = None,
) -> str:
    """Run the sessions at `trace` by `plan`; the table (or JSON), and the JSON in `report`."""
    if plan.users < 1 or not 0 <= plan.warmup_s < plan.duration_s:
        raise BadInput("bench: --users must be >= 1 and --warmup shorter than --duration")
    try:
        sessions = read_agent_sessions(trace)
    except ValueError as exc:
        raise BadInput(f"bench: {exc}") from None
    run: dict[str, Any] = {
        "url": url,
        "workload": str(trace),
        "sessions_in_trace": len(sessions),
        "users": plan.users,
        "duration_s": plan.duration_s,
        "warmup_s": plan.warmup_s,
        "drain_s": plan.drain_s,
        "time_scale": plan.time_scale,
        "run_tag": plan.run_tag,
    }
    result = asyncio.run(_run(run, sessions, api_key, plan))
    write_bench_report(result, report, answered=result["figures"]["finished"])
    return to_json(result) if as_json else render_live_sessions(result)


def write_bench_report(result: dict[str, Any], path: Path | None, *, answered: int) -> None:
    """Write the JSON report to `path` (when given); BenchError when no call of the run was
    `answered` and it had errors (the first one said)."""
    if path is not None:
        try:
            path.write_text(to_json(result) + "\n")
        except OSError as exc:
            raise BadInput(f"bench: cannot write {path} ({exc.strerror or exc})") from None
    if answered == 0 and result["errors"]:
        first = next(iter(result["errors"]))
        raise BenchError(f"bench: no model call succeeded; the first error: {first}")


def session_run_tag() -> str:
    return f"bench-{secrets.token_hex(4)}"


async def _run(
    run: dict[str, Any], sessions: list[AgentSessionTrace], api_key: str, plan: SessionRunPlan
) -> dict[str, Any]:
    url = run["url"]
    card = await probe(url, api_key, tenant="the --api-key's")
    plan = replace(plan, max_model_len=card.max_model_len)
    run = {**run, "model": card.name, "max_model_len": card.max_model_len}
    client = ApplianceClient(url, api_key, model=card.name)
    rec = SessionRecorder()
    started_at, t0, cpu0 = time.time(), time.perf_counter(), time.process_time()
    try:
        before = metric_sums(await client.metrics() or "")
        await LiveSessions(client, sessions, plan, rec).run()
        after = metric_sums(await client.metrics() or "")
    finally:
        await client.aclose()
    wall_s = time.perf_counter() - t0
    run |= {
        "wall_s": round(wall_s, 3),
        "started_at": round(started_at, 3),
        "finished_at": round(time.time(), 3),
    }
    figures = session_figures(rec, warmup_s=plan.warmup_s, end_s=plan.duration_s)
    figures |= {
        "sessions_started": rec.sessions_started,
        "sessions_finished": rec.sessions_finished,
        "subagents": rec.subagents,
        "skipped_for_window": rec.skipped_for_window,
        "skipped_tokens": rec.skipped_tokens,
        "refused_for_window": rec.refused_for_window,
        "abandoned": rec.abandoned,
        **router_figures(before, after),
        "client_cpu_s": round(time.process_time() - cpu0, 3),
    }
    return {
        "run": run,
        "figures": figures,
        "errors": dict(rec.errors.most_common(5)),
        "turns": [_row(t) for t in rec.turns],
    }


def _row(turn: LiveTurn) -> dict[str, Any]:
    r = turn.result
    return {
        "session": turn.session_id,
        "sent_s": round(turn.sent_s, 3),
        "ok": r.ok,
        "input_tokens": turn.input_tokens,
        "prompt_tokens": r.prompt_tokens,
        "cached_tokens": r.cached_tokens,
        "output_tokens": r.output_tokens,
        "tool_call": turn.tool_call,
        "finish_reason": r.finish_reason,
        "ttft_s": None if r.ttft_s is None else round(r.ttft_s, 4),
        "e2e_s": round(r.e2e_s, 4),
        "worker": r.worker,
    }
