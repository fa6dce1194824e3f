"""The options of `replay`, one reusable annotated type each, so its signature stays short."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

TraceArg = Annotated[
    Path | None,
    typer.Argument(
        help=(
            "Trace file (Mooncake jsonl or Azure csv), or recorded agent sessions: a "
            "folder of kv-cache-tester session files (*.json, *.json.gz) or one."
        )
    ),
]
WorkloadOpt = Annotated[
    Path | None,
    typer.Option(help="Replay a closed-loop agent workload from this spec (YAML) instead."),
]
TasksOpt = Annotated[int, typer.Option(help="Root tasks generated from --workload.")]
SeedOpt = Annotated[
    int | None,
    typer.Option(
        help="Seed of the --workload draw (default: the file's); for recorded sessions, of the "
        "order they start in (default: the files')."
    ),
]
PolicyOpt = Annotated[
    list[str] | None,
    typer.Option("--policy", help="Routing policy to replay (repeat; default: all)."),
]
ResidencyOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--residency",
        help=(
            "Residency policy: lru, ttl-pin, ttl-pin:SECONDS, mori, reaper, or the reaper with "
            "restore on lead time and/or branch-local state (--workload only): "
            "reaper+lead-time[:TRIGGER,...], reaper+branches, reaper+lead-time+branches "
            "(triggers: tool_finished, tool_due, hazard; default tool_finished). "
            "Repeat; default: lru."
        ),
    ),
]
WorkersOpt = Annotated[int, typer.Option(help="Simulated workers.")]
GpuProfileOpt = Annotated[
    Path | None, typer.Option(help="GPU profile JSON (default: the bundled H200).")
]
HbmGibOpt = Annotated[float | None, typer.Option(help="KV cache capacity per worker in GiB.")]
HostGibOpt = Annotated[
    float,
    typer.Option(help="Pinned host memory for KV per worker in GiB (0: no host tier).", min=0),
]
ReportOpt = Annotated[
    Path | None, typer.Option(help="Write the JSON report (and a PNG beside it) here.")
]
LimitOpt = Annotated[int | None, typer.Option(help="Replay only the first N requests.")]
JobsOpt = Annotated[int, typer.Option(help="Policies replayed at once (processes).")]
StackOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--stack",
        help=(
            "Agent sessions: a stack to replay (repeat; default all): vllm, vllm-offload, "
            "llm-d, dynamo, sglang, cachettl, mori, appliance."
        ),
    ),
]
UsersOpt = Annotated[
    int | None, typer.Option(help="Agent sessions: sessions at once (recycled).", min=1)
]
CapacityOpt = Annotated[
    bool,
    typer.Option("--capacity", help="Agent sessions: find each stack's capacity (--slo-ttft-p95)."),
]
SloTtftP95Opt = Annotated[
    float | None,
    typer.Option("--slo-ttft-p95", help="The capacity's SLO: TTFT p95 in seconds.", min=0),
]
DurationOpt = Annotated[
    float | None,
    typer.Option(
        help="Agent sessions: virtual seconds of the run (default: until every session "
        "has started once).",
        min=1,
    ),
]
WarmupOpt = Annotated[
    float,
    typer.Option(help="Agent sessions: virtual seconds not counted at the start.", min=0),
]
WorkerReaperOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--worker-reaper",
        help=(
            "Idle workers sleep or stop: IDLE_S[:MAX_WAKE_S[:MIN_AWAKE]] adds a row of the "
            "first policy whose workers go, after IDLE_S idle, to the cheapest state that "
            "wakes within MAX_WAKE_S, keeping MIN_AWAKE awake; every other row is the "
            "always-awake baseline. Repeat."
        ),
    ),
]
