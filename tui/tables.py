"""The terminal tables of `appliance status`, `sessions`, `tasks [--tree]`, `costs` and
`events`.

Pure functions: a `/admin/v1/state` snapshot (the JSON as a dict) in, text out; no Textual,
no terminal codes, so the output pipes and diffs cleanly. `json_view` is what `--json`
prints. A reading the appliance does not have is "-".
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from typing import Any, Literal

from appliance.api.admin.schemas import AdminStateView, CostsView, TaskStateView, convert_state
from tui import format as fmt

View = Literal["status", "sessions", "tasks", "costs", "events"]


def table(
    headers: Sequence[str], rows: Sequence[Sequence[str]], right: set[int] | None = None
) -> str:
    """Columns two spaces apart; the columns in `right` are right-aligned."""
    right = right or set()
    widths = [len(h) for h in headers]
    for row in rows:
        for i, cell in enumerate(row):
            widths[i] = max(widths[i], len(cell))

    def line(cells: Sequence[str]) -> str:
        out = [
            c.rjust(w) if i in right else c.ljust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ]
        return "  ".join(out).rstrip()

    return "\n".join([line(headers), *(line(r) for r in rows)])


def _state(state: dict[str, Any] | AdminStateView) -> AdminStateView:
    return state if isinstance(state, AdminStateView) else convert_state(state)


def render_status(state: dict[str, Any] | AdminStateView) -> str:
    """Workers (engine, GPUs, state, load, KV use: cached blocks included, `fmt.kv_fill`;
    restarts, their latest wake's seconds),
    GPUs, sessions and tasks in a few lines."""
    s = _state(state)
    out = [f"appliance state at {fmt.clock(s.time)}"]
    out += _worker_lines(s)
    out += _gpu_lines(s)
    out += _session_and_task_lines(s)
    return "\n".join(out)


def _worker_lines(s: AdminStateView) -> list[str]:
    """The workers' table, after a blank line; or that there are none."""
    if not s.workers:
        return ["", "workers: none"]
    rows = [
        [
            w.id,
            fmt.text(w.engine),
            ",".join(map(str, w.gpus)) or "-",
            fmt.worker_state(w.state, w.healthy, w.draining, w.sleep_level, w.lifecycle),
            fmt.num(w.running),
            fmt.num(w.waiting),
            fmt.fine_pct(fmt.kv_fill(w.kv_usage, w.kv_tokens, w.kv_capacity_tokens)),
            fmt.pct(w.prefix_hit_rate),
            fmt.times(w.prefill_slowdown),
            str(w.restarts),
            fmt.seconds(w.last_wake_s),
        ]
        for w in s.workers
    ]
    return [
        "",
        table(
            [
                "worker",
                "engine",
                "gpus",
                "state",
                "running",
                "waiting",
                "kv",
                "prefix",
                "prefill",
                "restarts",
                "wake",
            ],
            rows,
            right={4, 5, 6, 7, 8, 9, 10},
        ),
    ]


def _gpu_lines(s: AdminStateView) -> list[str]:
    """The GPUs' table, after a blank line, and the driver when it is simulated; or that NVML
    reports none."""
    if not s.gpus:
        return ["", "gpus: none reported (NVML sees no NVIDIA GPU on the appliance's host)"]
    rows = [
        [
            str(g.index),
            g.name,
            f"{fmt.gib(g.mem_used_bytes)}/{fmt.gib(g.mem_total_bytes)} GiB",
            fmt.gib(g.kv_bytes),
            fmt.pct(g.util),
            "-" if g.temp_c is None else f"{g.temp_c:.0f}C",
            "-" if g.power_w is None else f"{g.power_w:.0f}W",
        ]
        for g in s.gpus
    ]
    out = [
        "",
        table(["gpu", "name", "hbm used", "kv GiB", "util", "temp", "power"], rows, {4, 5, 6}),
    ]
    if s.gpu_driver is not None and s.gpu_driver.startswith("simulated"):
        out.append(f"gpus: {s.gpu_driver}")
    return out


def _session_and_task_lines(s: AdminStateView) -> list[str]:
    """After a blank line: the sessions and what they hold on GPU, the tasks by status."""
    gpu_tokens = sum(x.resident_tokens.gpu for x in s.sessions)
    gpu_bytes = sum(x.resident_bytes.gpu for x in s.sessions)
    statuses = Counter(t.status for t in s.tasks)
    return [
        "",
        f"sessions: {len(s.sessions):,}, resident on GPU {gpu_tokens:,} tokens "
        f"({fmt.size(gpu_bytes)})",
        f"tasks: {len(s.tasks):,}"
        + "".join(f", {n:,} {status}" for status, n in sorted(statuses.items())),
    ]


def render_sessions(state: dict[str, Any] | AdminStateView) -> str:
    """One row per session, the most GPU-resident first: its prefix on GPU (of it held, and
    until when), in host memory, and gone."""
    s = _state(state)
    if not s.sessions:
        return "no sessions"
    ordered = sorted(s.sessions, key=lambda x: (-x.resident_tokens.gpu, x.id))
    rows = [
        [
            x.id,
            x.tenant,
            fmt.text(x.task_id),
            fmt.text(x.worker),
            str(x.resident_tokens.gpu),
            str(x.resident_tokens.gpu_held),
            fmt.clock(x.held_until),
            str(x.resident_tokens.host),
            str(x.resident_tokens.gone),
            fmt.size(x.resident_bytes.gpu),
            fmt.size(x.resident_bytes.host),
            fmt.seconds(x.idle_s),
            str(x.turns),
            fmt.text(x.tool_class),
            fmt.seconds(x.expected_wait_s),
            fmt.text(x.decision),
            fmt.text(x.reason),
        ]
        for x in ordered
    ]
    headers = [
        "session",
        "tenant",
        "task",
        "worker",
        "gpu_tokens",
        "held_tokens",
        "held_until",
        "host_tokens",
        "gone_tokens",
        "gpu_bytes",
        "host_bytes",
        "idle",
        "turns",
        "tool",
        "wait",
        "decision",
        "reason",
    ]
    return table(headers, rows, right={4, 5, 7, 8, 9, 10, 11, 12, 14})


def _task_row(t: TaskStateView, now: float) -> list[str]:
    slack = None if t.deadline_at is None else t.deadline_at - now
    return [
        t.tenant,
        fmt.text(t.task_class),
        t.status,
        fmt.signed_seconds(slack),
        str(t.tokens),
        fmt.money(t.cost),
        str(len(t.children)),
        str(t.kv_inherited_tokens),
        str(t.kv_own_tokens),
        str(t.kv_own_kept_tokens),
        fmt.num(t.kv_reclaimed_tokens),
        fmt.clock(t.kv_reclaimed_at),
    ]


TASK_HEADERS = [
    "tenant",
    "class",
    "status",
    "slack",
    "tokens",
    "cost",
    "children",
    "kv_inherited",
    "kv_own",
    "kv_own_kept",
    "kv_reclaimed",
    "reclaimed_at",
]
"""A task's KV: its sessions' now, shared with its parent or its own (of it, held or on a
host tier); what its end reclaimed, when."""


def render_tasks(state: dict[str, Any] | AdminStateView, *, tree: bool = False) -> str:
    """Tasks in the appliance's order; with `tree`, each root followed by its fan-out."""
    s = _state(state)
    if not s.tasks:
        return "no tasks"
    if not tree:
        rows = [[t.id, fmt.text(t.parent_id), *_task_row(t, s.time)] for t in s.tasks]
        return table(["task", "parent", *TASK_HEADERS], rows, right={5, 6, 7, 8, 9, 10, 11, 12})
    by_id = {t.id: t for t in s.tasks}
    roots = [t for t in s.tasks if t.parent_id is None or t.parent_id not in by_id]
    rows = []
    placed: set[str] = set()

    def walk(t: TaskStateView, prefix: str, last: bool, depth: int) -> None:
        placed.add(t.id)
        branch = "" if depth == 0 else ("└─ " if last else "├─ ")
        rows.append([prefix + branch + t.id, *_task_row(t, s.time)])
        kids = [by_id[c] for c in t.children if c in by_id and c not in placed]
        below = prefix + ("" if depth == 0 else ("   " if last else "│  "))
        for i, kid in enumerate(kids):
            if kid.id not in placed:
                walk(kid, below, i == len(kids) - 1, depth + 1)

    for root in roots:
        if root.id not in placed:
            walk(root, "", True, 0)
    return table(["task", *TASK_HEADERS], rows, right={4, 5, 6, 7, 8, 9, 10, 11})


def render_costs(state: dict[str, Any] | AdminStateView) -> str:
    """Cost per successful task by task class and tenant."""
    costs: CostsView = _state(state).costs
    if costs.groups is None:
        return (
            "costs: not reported in the appliance's state yet "
            "(`appliance costs --db` reads the ledger)"
        )
    if not costs.groups:
        return "costs: no finished tasks yet"
    rows = [
        [
            fmt.text(g.task_class),
            fmt.text(g.tenant),
            str(g.tasks),
            str(g.succeeded),
            str(g.attempts),
            fmt.money(g.cost),
            fmt.money(g.overhead),
            fmt.money(g.total_cost),
            fmt.money(g.cost_per_success),
            fmt.text(g.currency or costs.currency),
        ]
        for g in costs.groups
    ]
    headers = [
        "task_class",
        "tenant",
        "tasks",
        "succeeded",
        "attempts",
        "cost",
        "overhead",
        "total",
        "per_success",
        "currency",
    ]
    return table(headers, rows, right={2, 3, 4, 5, 6, 7, 8})


def render_events(state: dict[str, Any] | AdminStateView) -> str:
    """The appliance's recent events, newest first."""
    events = _state(state).events
    if events is None:
        return "events: not reported in the appliance's state yet"
    if not events:
        return "no events"
    rows = [[fmt.clock(e.at), e.kind, e.subject, fmt.text(e.tenant), e.detail] for e in events]
    return table(["time", "kind", "subject", "tenant", "detail"], rows)


def json_view(state: dict[str, Any], view: View) -> str:
    """What `--json` prints: the whole snapshot for status, else its one section."""
    if view == "status":
        data: Any = state
    elif view == "costs":
        data = state.get("costs", {})
    else:
        data = {view: state.get(view, [])}
    return json.dumps(data, indent=2)
