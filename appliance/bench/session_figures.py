"""What a live run of recorded sessions measured, as the replay's session report counts it,
plus what the router spent.

Definitions (the replay's, `replay/metrics.py`, in real seconds): a request counts when it
was sent after the warm-up and by the end of the run (`warmup_s < sent <= end_s`). TTFT runs
from sending it to the stream's first chunk (the answer's role, with its first token); step
from sending it to the stream's end; a session's span from its first counted request's
sending to its last counted answer's end. Hit rate: cached over prompt tokens of the counted
requests that succeeded, the appliance's own `usage` (the chat template's tokens included).
Percentiles are nearest-rank, as the replay's.

The router's CPU: `appliance_process_cpu_seconds` (the appliance process's CPU time, every
thread: parsing, tokenising, placing, relaying, KV events, the ledger) over the turns it
placed (`appliance_routed_turns`) between the run's start and end, from `/metrics`; its own
wall time per turn to forwarding from `appliance_forward_seconds`. None where the appliance
does not publish them.
"""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

from appliance.bench.report import AgentStepResult
from appliance.domain.percentile import nearest_rank
from appliance.workload.session_columns import SESSION_COLUMNS

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}\n]*\})? (\S+)", re.MULTILINE)
_SHOWN = (
    *SESSION_COLUMNS,
    "router_cpu_ms_per_turn",
)


@dataclass(frozen=True, slots=True)
class LiveTurn:
    session_id: str
    sent_s: float
    """When it was sent, seconds from the run's start."""
    input_tokens: int
    """The trace's `in`."""
    tool_call: bool
    """Its answer was asked to call a tool."""
    result: AgentStepResult


@dataclass
class SessionRecorder:
    turns: list[LiveTurn] = field(default_factory=list)
    sessions_started: int = 0
    sessions_finished: int = 0
    subagents: int = 0
    skipped_for_window: int = 0
    skipped_tokens: int = 0
    refused_for_window: int = 0
    """Skipped requests sent as a harness sends them, whose prompt alone overflowed the window:
    refused by the box (400), which drops the session's KV then."""
    abandoned: int = 0
    """Requests still streaming when the drain ran out (cancelled by the client)."""
    errors: Counter[str] = field(default_factory=Counter)

    def error(self, message: str) -> None:
        self.errors[re.sub(r"\d+(\.\d+)?", "#", message)] += 1


def _r(value: float | None, digits: int = 4) -> float | None:
    return None if value is None else round(value, digits)


def session_figures(rec: SessionRecorder, *, warmup_s: float, end_s: float) -> dict[str, Any]:
    """The counted requests' figures (see the module)."""
    counted = [t for t in rec.turns if warmup_s < t.sent_s <= end_s]
    ok = [t for t in counted if t.result.ok]
    ttft = [t.result.ttft_s for t in ok if t.result.ttft_s is not None]
    step = [t.result.e2e_s for t in ok]
    spans: dict[str, list[float]] = defaultdict(lambda: [float("inf"), 0.0])
    for t in ok:
        span = spans[t.session_id]
        span[0] = min(span[0], t.sent_s)
        span[1] = max(span[1], t.sent_s + t.result.e2e_s)
    session_s = [b - a for a, b in spans.values()]
    prompt = sum(t.result.prompt_tokens for t in ok)
    cached = sum(t.result.cached_tokens for t in ok)
    return {
        "requests": len(counted),
        "finished": len(ok),
        "failed": len(counted) - len(ok),
        "ttft_p50_s": _r(nearest_rank(ttft, 0.50)),
        "ttft_p95_s": _r(nearest_rank(ttft, 0.95)),
        "ttft_p99_s": _r(nearest_rank(ttft, 0.99)),
        "ttft_mean_s": _r(sum(ttft) / len(ttft) if ttft else None),
        "hit_rate": round(cached / prompt, 6) if prompt else 0.0,
        "step_p50_s": _r(nearest_rank(step, 0.50)),
        "step_p95_s": _r(nearest_rank(step, 0.95)),
        "session_p50_s": _r(nearest_rank(session_s, 0.50), 2),
        "sessions": len(session_s),
        "prompt_tokens": prompt,
        "trace_input_tokens": sum(t.input_tokens for t in ok),
        "cached_tokens": cached,
        "output_tokens": sum(t.result.output_tokens for t in ok),
        "tool_calls_asked": sum(t.tool_call for t in ok),
        "tool_calls_answered": sum(t.result.finish_reason == "tool_calls" for t in ok),
    }


def metric_sums(text: str) -> dict[str, float]:
    """Prometheus text as sample name -> value, summed over labels."""
    out: dict[str, float] = defaultdict(float)
    for name, _, value in _SAMPLE.findall(text):
        try:
            out[name] += float(value)
        except ValueError:
            continue
    return dict(out)


def router_figures(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    """The router's CPU and forwarding time per turn placed between two `/metrics` reads."""

    def delta(name: str) -> float | None:
        """None where the appliance does not publish it (a family without samples yet is 0)."""
        if name not in after:
            return None
        return after[name] - before.get(name, 0.0)

    cpu = delta("appliance_process_cpu_seconds_total")
    turns = delta("appliance_routed_turns_total")
    fwd_s, fwd_n = delta("appliance_forward_seconds_sum"), delta("appliance_forward_seconds_count")
    per_turn = cpu / turns if cpu is not None and turns else None
    return {
        "router_cpu_s": _r(cpu, 3),
        "router_turns": None if turns is None else int(turns),
        "router_cpu_ms_per_turn": _r(per_turn * 1000 if per_turn is not None else None, 2),
        "router_forward_ms_mean": _r(
            1000 * fwd_s / fwd_n if fwd_s is not None and fwd_n else None, 2
        ),
    }


def render_live_sessions(report: dict[str, Any]) -> str:
    """The report as the replay's session table: one line, for the live run."""
    run, fig = report["run"], report["figures"]
    head = ["stack", *_SHOWN]
    row = ["live", *(_cell(fig.get(key, run.get(key))) for key in _SHOWN)]
    widths = [max(len(a), len(b)) for a, b in zip(head, row, strict=True)]
    lines = [
        f"appliance bench: {run['sessions_in_trace']} sessions from {run['workload']} against "
        f"{run['url']} (model {run['model']}, window {run['max_model_len']}); {run['users']} "
        f"users, counted from {run['warmup_s']:g} s to {run['duration_s']:g} s "
        f"(+{run['wall_s'] - run['duration_s']:.1f} s drain), time scale "
        f"{run['time_scale']:g}, run {run['run_tag']}",
        "  ".join(c.ljust(w) for c, w in zip(head, widths, strict=True)),
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)),
        f"sessions {fig['sessions_started']} started, {fig['sessions_finished']} finished, "
        f"{fig['subagents']} sub-agents; {fig['finished']} of {fig['requests']} counted "
        f"requests answered, {fig['abandoned']} abandoned, {fig['refused_for_window']} "
        "refused for the window (their sessions compact); tool calls asked "
        f"{fig['tool_calls_asked']}, answered {fig['tool_calls_answered']}",
        f"router: {_cell(fig['router_cpu_s'])} CPU s over {_cell(fig['router_turns'])} turns "
        f"({_cell(fig['router_cpu_ms_per_turn'])} ms a turn), forwarding "
        f"{_cell(fig['router_forward_ms_mean'])} ms a turn; this client: "
        f"{_cell(fig['client_cpu_s'])} CPU s",
    ]
    if report["errors"]:
        lines += ["errors:"] + [f"  {n} x {e}" for e, n in report["errors"].items()]
    return "\n".join(lines)


def _cell(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "-" if value is None else str(value)
