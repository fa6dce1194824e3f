"""The replay report: JSON (bounds, per-policy metrics, the check against the trace's own
statistics) and the comparison table as text.

Report layout (token counts in tokens, times in seconds):
    {"trace": {...}, "setup": {...},
     "bounds": {"no_cache" | "unbounded" | "optimal" | "optimal_with_host":
                {"fresh_prefill_tokens", "cached_tokens", "hit_ratio", "capacity_blocks"}},
     "ttft_floor": {"p50_s", "p95_s", "p99_s"},        # a trace's only (bounds.py)
     "trace_stats_check": {"no_cache" | "unbounded":
                {"expected_fresh_tokens", "replayed_fresh_tokens", "relative_error",
                 "within_1pct"}},                      # when *.stats.json sits beside it
     "policies": {NAME: {"fresh_prefill_tokens", "cached_tokens", "hit_ratio",
                         "vs_optimal", "vs_optimal_with_host", "host_hit_tokens",
                         "host_load_s", "ttft_p50_s", "ttft_p95_s", "ttft_p99_s",
                         "step_p50_s", "step_p95_s", "step_p99_s", "session_p50_s",
                         "session_p95_s", "imbalance", "requests_imbalance",
                         "prefill_imbalance", "preemptions", "pins", "pins_expired",
                         "pins_resumed", "pins_reclaimed", "demotions", "evictions",
                         "tasks", "tasks_completed", "deadline_goodput", "gpu_s",
                         "cost_per_success", "discarded_branches",
                         "discarded_cost_share", "routed_by_reason", "residency_by_reason",
                         "residency_by_action", ...,
                         "prefill_s", "prefetch": {...} | null,
                         "prefetch_unused_share", "branches": {...} | null,
                         "power": {"setting", "awake_gpu_h", "asleep_gpu_h",
                                   "stopped_gpu_h", "waking_gpu_h", "wakes",
                                   "waited_turns", "released_sessions", "sleeps",
                                   "awake_gpu_s", "added_ttft_p95_s",
                                   "awake_cost_per_success"} | null}},
     "pooled_host_gain": {NAME: {"versus", "fresh_prefill_saved_tokens",
                                 "host_hit_tokens_gained", "ttft_p95_change_s"}}}
                                                       # with a host tier only
NAME is the routing policy, `+RESIDENCY` when that is not `lru` (`appliance+ttl-pin`),
`+pooled-host` for the run with the workers' host tiers pooled. The task figures are null
for a trace; a closed-loop workload has no bounds, and adds `prefill_s`, `prefetch`
(`workload_replay.py`: restore on lead time, `+lead-time` rows) and `branches` (the KV
ended child tasks still hold). The table shows the host-tier columns only when the workers
have one, and a line per row with prefetches, child tasks or discarded branches (children
whose results their parent did not keep, and their share of the attempted cost).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

COLUMNS = (
    # header, key, format
    ("fresh Mtok", "fresh_prefill_tokens", lambda v: f"{v / 1e6:.2f}"),
    ("hit", "hit_ratio", lambda v: f"{v:.1%}"),
    ("x opt", "vs_optimal", lambda v: f"{v:.3f}"),
    ("TTFT p50", "ttft_p50_s", lambda v: f"{v:.3f}"),
    ("TTFT p95", "ttft_p95_s", lambda v: f"{v:.2f}"),
    ("TTFT p99", "ttft_p99_s", lambda v: f"{v:.2f}"),
    ("step p95", "step_p95_s", lambda v: f"{v:.1f}"),
    ("sess p50", "session_p50_s", lambda v: f"{v:.1f}"),
    ("sess p95", "session_p95_s", lambda v: f"{v:.1f}"),
    ("imbal", "imbalance", lambda v: f"{v:.3f}"),
    ("preempt", "preemptions", lambda v: f"{v}"),
    ("goodput", "deadline_goodput", lambda v: f"{v:.1%}"),
    ("cost/success", "cost_per_success", lambda v: f"{v:.4f}"),
)
HOST_COLUMNS = (
    ("host Mtok", "host_hit_tokens", lambda v: f"{v / 1e6:.2f}"),
    ("x opt+host", "vs_optimal_with_host", lambda v: f"{v:.3f}"),
)


def render_table(report: Mapping[str, Any]) -> str:
    """The per-policy comparison, the bounds and the trace-statistics check, as text."""
    setup: Mapping[str, Any] = report.get("setup", {})
    host = bool(setup.get("host_blocks_per_worker"))
    lines = _policy_rows(report.get("policies", {}), host)
    lines += _bounds_line(report.get("bounds", {}))
    lines += _floor_line(report.get("ttft_floor"))
    lines += _check_line(report.get("trace_stats_check", {}))
    lines += _gain_lines(report.get("pooled_host_gain", {}))
    lines += _prefetch_lines(report.get("policies", {}))
    lines += _branch_lines(report.get("policies", {}))
    lines += _discard_lines(report.get("policies", {}))
    lines += _power_lines(report.get("policies", {}))
    lines += _setup_line(setup, report.get("trace", {}), host)
    return "\n".join(lines)


def _policy_rows(policies: Mapping[str, Mapping[str, Any]], host: bool) -> list[str]:
    """One row per policy under a header, columns aligned."""
    columns = (*COLUMNS[:3], *HOST_COLUMNS, *COLUMNS[3:]) if host else COLUMNS
    rows = [["policy", *(h for h, _, _ in columns)]]
    for name, m in policies.items():
        rows.append([name, *(_cell(m.get(key), fmt) for _, key, fmt in columns)])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [
        "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w)
            for i, (c, w) in enumerate(zip(r, widths, strict=True))
        )
        for r in rows
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return lines


def _bounds_line(bounds: Mapping[str, Mapping[str, Any]]) -> list[str]:
    if not bounds:
        return []
    parts = []
    for name in ("no_cache", "unbounded", "optimal", "optimal_with_host"):
        b = bounds.get(name)
        if b is None:
            continue
        cap = f", {b['capacity_blocks']} blocks pooled" if b.get("capacity_blocks") else ""
        parts.append(
            f"{name} {b['fresh_prefill_tokens'] / 1e6:.2f} Mtok ({b['hit_ratio']:.1%} hit{cap})"
        )
    return ["bounds (fresh prefill): " + "; ".join(parts)]


def _floor_line(floor: Mapping[str, float] | None) -> list[str]:
    if not floor:
        return []
    return [
        "TTFT floor (each request alone on an idle worker, every earlier prompt cached): "
        f"p50 {floor['p50_s']:.3f} s, p95 {floor['p95_s']:.2f} s, p99 {floor['p99_s']:.2f} s"
    ]


def _check_line(check: Mapping[str, Any]) -> list[str]:
    checks = [
        f"{name} {c['relative_error']:+.3%}"
        for name in ("no_cache", "unbounded")
        if isinstance(c := check.get(name), Mapping)
    ]
    if not checks:
        return []
    ok = all(check[n]["within_1pct"] for n in ("no_cache", "unbounded") if n in check)
    verdict = "within 1%" if ok else "NOT within 1%"
    return [f"vs the trace's own statistics: {', '.join(checks)} ({verdict})"]


def _gain_lines(gains: Mapping[str, Mapping[str, Any]]) -> list[str]:
    lines = []
    for name, g in gains.items():
        ttft = g.get("ttft_p95_change_s")
        lines.append(
            f"{name} vs {g['versus']}: fresh prefill "
            f"{-g['fresh_prefill_saved_tokens'] / 1e6:+.2f} Mtok, host hits "
            f"{g['host_hit_tokens_gained'] / 1e6:+.2f} Mtok, TTFT p95 "
            + ("-" if ttft is None else f"{ttft:+.3f} s")
        )
    return lines


def _prefetch_lines(policies: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """Per row with restore on lead time: what it did, what went unused, what it saved, and
    how often it was switched off."""
    lines = []
    for name, m in policies.items():
        p = m.get("prefetch")
        if not isinstance(p, Mapping):
            continue
        skipped = p.get("skipped", {})
        off = skipped.get("lead_too_short", 0) + skipped.get("low_accuracy", 0)
        share = p.get("unused_bytes_share")
        lines.append(
            f"{name}: {p['prefetches']} prefetches, {p['used']} used "
            f"({_cell(p.get('accuracy'), lambda v: f'{v:.0%}')}); "
            f"{p['restored_bytes'] / 2**30:.1f} GiB restored, "
            f"{_cell(share, lambda v: f'{v:.0%}')} unused; "
            f"{p['prefill_s']:.1f} s prefilled ({p['unused_prefill_s']:.1f} s unused); "
            f"TTFT saved {p['ttft_saved_s']:.1f} s; switched off {off} times"
        )
    return lines


def _branch_lines(policies: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """Per row of a workload with child tasks: the KV ended branches still held."""
    lines = []
    for name, m in policies.items():
        b = m.get("branches")
        if isinstance(b, Mapping):
            lines.append(
                f"{name}: {b['ended']} branches ended; their own KV held at most "
                f"{b['held_bytes_max'] / 2**20:.0f} MiB, a tick after an end "
                f"{b['held_bytes_max_after_tick'] / 2**20:.0f} MiB"
            )
    return lines


def _discard_lines(policies: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """Per row with discarded branches: how many, and their share of the attempted cost."""
    lines = []
    for name, m in policies.items():
        n, share = m.get("discarded_branches"), m.get("discarded_cost_share")
        if n and share is not None:
            lines.append(
                f"{name}: {n} discarded branches (results their parent did not keep), "
                f"{share:.1%} of the attempted cost"
            )
    return lines


def _power_lines(policies: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """Per row whose workers' power states were watched: awake time, wakes and their cost."""
    lines = []
    for name, m in policies.items():
        p = m.get("power")
        if not isinstance(p, Mapping):
            continue
        added = _cell(p.get("added_ttft_p95_s"), lambda v: f"{v:+.2f} s")
        lines.append(
            f"{name}: {p['awake_gpu_h']:.2f} GPU-h awake ({p['asleep_gpu_h']:.2f} asleep, "
            f"{p['stopped_gpu_h']:.2f} stopped); {p['wakes']} wakes, {p['waited_turns']} turns "
            f"waited, {p['released_sessions']} sessions released; TTFT p95 {added} vs always "
            f"awake; cost/success on awake time "
            f"{_cell(p.get('awake_cost_per_success'), lambda v: f'{v:.4f}')}"
        )
    return lines


def _setup_line(setup: Mapping[str, Any], trace: Mapping[str, Any], host: bool) -> list[str]:
    if not (setup and trace):
        return []
    host_kv = (
        f" + {setup.get('host_gib_per_worker')} GiB host "
        f"({setup.get('host_blocks_per_worker')} blocks)"
        if host
        else ""
    )
    return [
        f"{trace.get('requests')} requests, {trace.get('sessions')} sessions; "
        f"{setup.get('workers')} workers x {setup.get('kv_gib_per_worker')} GiB KV "
        f"({setup.get('kv_blocks_per_worker')} blocks of {setup.get('block_size')})"
        f"{host_kv}, profile {setup.get('gpu_profile')}"
    ]


def _cell(value: object, fmt: Any) -> str:
    return "-" if value is None else str(fmt(value))


def write_report(report: Mapping[str, Any], path: Path) -> list[Path]:
    """Write the JSON report and, when matplotlib is importable, the plot beside it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1) + "\n")
    written = [path]
    from appliance.replay.plot import plot_report  # matplotlib is optional

    png = plot_report(report, path.with_suffix(".png"))
    if png is not None:
        written.append(png)
    return written
