"""What a benchmark run measured, summed into one report: a table for people, JSON for scripts.

Model of the world: a step is one model call (turn); its time to first token runs from
sending the request to the stream's first chunk (the answer's role, which comes with the
first generated token, text or tool call), its end-to-end time to the stream's end,
and its token counts are the appliance's own `usage` (cached tokens from
`prompt_tokens_details`). A task's latency runs from its creation to its outcome, tool waits
and children included. Only finished steps and tasks enter the latencies; the counts say
how many were left unfinished when the run stopped. Percentiles are the nearest rank, as
the replay's and the session bench's (`appliance.domain.percentile`).
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from appliance.domain.percentile import percentile_rank


@dataclass(frozen=True, slots=True)
class AgentStepResult:
    task_id: str
    ok: bool
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    ttft_s: float | None = None
    e2e_s: float = 0.0
    worker: str | None = None
    error: str | None = None
    rejected: bool = False
    """Admission said no (429): no attempt reached a worker, so the ledger has no turn."""
    finish_reason: str | None = None


@dataclass(frozen=True, slots=True)
class TaskResult:
    task_id: str
    root: bool
    outcome: str
    """"succeeded", "failed" (both reported to the appliance), or "unfinished"."""
    verified: bool
    turns: int
    latency_s: float
    deadline_missed: bool = False
    reason: str | None = None
    """Why a task failed or stopped early beyond its drawn outcome (an error, the context)."""


@dataclass
class Recorder:
    """Everything one run observed; the agents append, the report reads."""

    steps: list[AgentStepResult] = field(default_factory=list)
    tasks: list[TaskResult] = field(default_factory=list)
    rejected_tasks: int = 0
    abandoned_steps: int = 0
    """Steps still streaming when the drain bound ran out (cancelled by the client)."""
    events_failed: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    """Error messages with their decimal numbers masked (`#`), so alike errors count together."""

    def error(self, message: str) -> None:
        self.errors[re.sub(r"\d+\.\d+", "#", message)] += 1


def percentiles(values: Sequence[float], qs: Sequence[float] = (50, 95, 99)) -> dict[str, float]:
    """{"p50": ..., "p95": ..., "p99": ..., "mean": ...}, each percentile the nearest rank
    (`appliance.domain.percentile`, as the session reports read theirs); empty input gives
    {}."""
    if not values:
        return {}
    ordered = sorted(values)
    last = len(ordered) - 1
    out = {f"p{q:g}": ordered[min(percentile_rank(q / 100, len(ordered)), last)] for q in qs}
    out["mean"] = sum(ordered) / len(ordered)
    return out


def build_report(rec: Recorder, run: dict[str, Any], wall_s: float) -> dict[str, Any]:
    """The JSON report: `run` (what was run) plus the measured figures."""
    ok = [s for s in rec.steps if s.ok]
    prompt = sum(s.prompt_tokens for s in ok)
    cached = sum(s.cached_tokens for s in ok)
    output = sum(s.output_tokens for s in ok)
    finished = [t for t in rec.tasks if t.outcome in ("succeeded", "failed")]
    by_worker = Counter(s.worker or "?" for s in ok)
    return {
        **run,
        "wall_s": round(wall_s, 3),
        "steps": {
            "ok": len(ok),
            "failed": sum(not s.ok and not s.rejected for s in rec.steps),
            "rejected": sum(s.rejected for s in rec.steps),
            "abandoned": rec.abandoned_steps,
            "per_s": round(len(ok) / wall_s, 3) if wall_s > 0 else 0.0,
            "by_worker": dict(sorted(by_worker.items())),
        },
        "tokens": {
            "prompt": prompt,
            "cached": cached,
            "fresh": prompt - cached,
            "output": output,
            "cached_share": round(cached / prompt, 4) if prompt else 0.0,
            "output_per_s": round(output / wall_s, 1) if wall_s > 0 else 0.0,
        },
        "step_latency_s": {
            "ttft": percentiles([s.ttft_s for s in ok if s.ttft_s is not None]),
            "e2e": percentiles([s.e2e_s for s in ok]),
        },
        "tasks": {
            "started": len(rec.tasks),
            "roots_started": sum(t.root for t in rec.tasks),
            "finished": len(finished),
            "succeeded": sum(t.outcome == "succeeded" for t in finished),
            "succeeded_verified": sum(t.outcome == "succeeded" and t.verified for t in finished),
            "failed": sum(t.outcome == "failed" for t in finished),
            "unfinished": sum(t.outcome == "unfinished" for t in rec.tasks),
            "rejected": rec.rejected_tasks,
            "deadline_missed": sum(t.deadline_missed for t in finished),
            "latency_s": percentiles([t.latency_s for t in finished]),
            "root_latency_s": percentiles([t.latency_s for t in finished if t.root]),
            "turns_per_task": percentiles([float(t.turns) for t in finished]),
        },
        "events_failed": rec.events_failed,
        "errors": dict(rec.errors.most_common(5)),
    }


def to_json(report: dict[str, Any]) -> str:
    return json.dumps(report, indent=2, sort_keys=False)


def render(report: dict[str, Any]) -> str:
    """The report as a few aligned lines and two latency tables."""
    steps, tokens, tasks = report["steps"], report["tokens"], report["tasks"]
    lat = report["step_latency_s"]
    lines = [
        f"appliance bench: {report['url']}  model {report['model']}  "
        f"{report['concurrency']} concurrent tasks  {report['duration_s']:g} s "
        f"(+{report['wall_s'] - report['duration_s']:.1f} s drain)  "
        f"time scale {report['time_scale']:g}  run {report['run_tag']}",
        f"steps     {steps['ok']} ok, {steps['failed']} failed, {steps['rejected']} rejected, "
        f"{steps['abandoned']} abandoned; "
        f"{steps['per_s']:.2f}/s",
        f"tokens    prompt {tokens['prompt']:,}  cached {tokens['cached']:,} "
        f"({100 * tokens['cached_share']:.1f} %)  output {tokens['output']:,} "
        f"({tokens['output_per_s']:,.0f}/s)",
        f"tasks     {tasks['started']} started ({tasks['roots_started']} roots), "
        f"{tasks['finished']} finished: {tasks['succeeded']} succeeded "
        f"({tasks['succeeded_verified']} verified), {tasks['failed']} failed; "
        f"{tasks['unfinished']} unfinished, {tasks['rejected']} rejected, "
        f"{tasks['deadline_missed']} past deadline",
        "",
        _table(
            ["latency", "n", "p50", "p95", "p99", "mean"],
            [
                ("step TTFT s", steps["ok"], lat["ttft"]),
                ("step e2e s", steps["ok"], lat["e2e"]),
                ("task s", tasks["finished"], tasks["latency_s"]),
                ("root task s", None, tasks["root_latency_s"]),
                ("turns per task", tasks["finished"], tasks["turns_per_task"]),
            ],
        ),
    ]
    if report["errors"]:
        lines += ["", "errors:"] + [f"  {n} x {e}" for e, n in report["errors"].items()]
    return "\n".join(lines)


def _table(head: list[str], rows: list[tuple[str, int | None, dict[str, float]]]) -> str:
    cells = [head]
    for name, n, stats in rows:
        values = [_num(stats.get(k)) for k in ("p50", "p95", "p99", "mean")]
        cells.append([name, "" if n is None else str(n), *values])
    widths = [max(len(r[i]) for r in cells) for i in range(len(head))]
    return "\n".join(
        "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w)
            for i, (c, w) in enumerate(zip(r, widths, strict=True))
        )
        for r in cells
    )


def _num(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.3f}" if value < 100 else f"{value:.1f}"
