"""`replay`: a trace, an agent workload or recorded agent sessions, in virtual time."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from appliance.start import bootstrap


def replay_command(
    trace: Annotated[
        Path | None,
        typer.Argument(
            help=(
                "Trace file (Mooncake jsonl or Azure csv), or recorded agent sessions: a "
                "folder of kv-cache-tester session files (*.json, *.json.gz) or one."
            )
        ),
    ] = None,
    workload: Annotated[
        Path | None,
        typer.Option(help="Replay a closed-loop agent workload from this spec (YAML) instead."),
    ] = None,
    tasks: Annotated[int, typer.Option(help="Root tasks generated from --workload.")] = 100,
    seed: Annotated[
        int | None, typer.Option(help="Seed of the --workload draw (default: the file's).")
    ] = None,
    policy: Annotated[
        list[str] | None,
        typer.Option("--policy", help="Routing policy to replay (repeat; default: all)."),
    ] = None,
    residency: Annotated[
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
    ] = None,
    workers: Annotated[int, typer.Option(help="Simulated workers.")] = 8,
    gpu_profile: Annotated[
        Path | None, typer.Option(help="GPU profile JSON (default: the bundled H200).")
    ] = None,
    hbm_gib: Annotated[
        float | None, typer.Option(help="KV cache capacity per worker in GiB.")
    ] = None,
    host_gib: Annotated[
        float,
        typer.Option(help="Pinned host memory for KV per worker in GiB (0: no host tier).", min=0),
    ] = 0.0,
    report: Annotated[
        Path | None, typer.Option(help="Write the JSON report (and a PNG beside it) here.")
    ] = None,
    limit: Annotated[int | None, typer.Option(help="Replay only the first N requests.")] = None,
    jobs: Annotated[int, typer.Option(help="Policies replayed at once (processes).")] = 1,
    stack: Annotated[
        list[str] | None,
        typer.Option(
            "--stack",
            help=(
                "Agent sessions: a stack to replay (repeat; default all): vllm, vllm-offload, "
                "llm-d, dynamo, sglang, cachettl, mori, appliance."
            ),
        ),
    ] = None,
    users: Annotated[
        int | None, typer.Option(help="Agent sessions: sessions at once (recycled).", min=1)
    ] = None,
    capacity: Annotated[
        bool,
        typer.Option(
            "--capacity", help="Agent sessions: find each stack's capacity (--slo-ttft-p95)."
        ),
    ] = False,
    slo_ttft_p95: Annotated[
        float | None,
        typer.Option("--slo-ttft-p95", help="The capacity's SLO: TTFT p95 in seconds.", min=0),
    ] = None,
    duration: Annotated[
        float | None,
        typer.Option(
            help="Agent sessions: virtual seconds of the run (default: until every session "
            "has started once).",
            min=1,
        ),
    ] = None,
    warmup: Annotated[
        float,
        typer.Option(help="Agent sessions: virtual seconds not counted at the start.", min=0),
    ] = 600.0,
    worker_reaper: Annotated[
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
    ] = None,
) -> None:
    """Replay a trace (or an agent workload) through every routing policy in virtual time;
    recorded agent sessions through every stack, closed loop."""
    if trace is not None and bootstrap.is_session_trace(trace):
        if capacity != (slo_ttft_p95 is not None):
            raise typer.BadParameter("--capacity goes with --slo-ttft-p95 S")
        typer.echo(
            bootstrap.session_table(
                trace,
                stacks=stack,
                users=users,
                slo_ttft_p95_s=slo_ttft_p95,
                workers=workers,
                gpu_profile=gpu_profile,
                hbm_gib=hbm_gib,
                host_gib=host_gib,
                duration_s=duration,
                warmup_s=warmup,
                jobs=jobs,
                report=report,
            )
        )
        return
    if stack or users is not None or capacity:
        raise typer.BadParameter(
            "--stack, --users and --capacity replay agent sessions: "
            "give a folder of session files (or one .json/.json.gz)"
        )
    typer.echo(
        bootstrap.replay_table(
            trace,
            workload=workload,
            tasks=tasks,
            seed=seed,
            policies=policy,
            residencies=residency,
            workers=workers,
            gpu_profile=gpu_profile,
            hbm_gib=hbm_gib,
            host_gib=host_gib,
            report=report,
            limit=limit,
            jobs=jobs,
            worker_reapers=worker_reaper,
        )
    )
