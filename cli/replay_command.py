"""`replay`: a trace, an agent workload or recorded agent sessions, in virtual time."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

from appliance.start import bootstrap
from cli.replay_options import (
    CapacityOpt,
    DurationOpt,
    GpuProfileOpt,
    HbmGibOpt,
    HostGibOpt,
    JobsOpt,
    LimitOpt,
    PolicyOpt,
    ReportOpt,
    ResidencyOpt,
    SeedOpt,
    SloTtftP95Opt,
    StackOpt,
    TasksOpt,
    TraceArg,
    UsersOpt,
    WarmupOpt,
    WorkerReaperOpt,
    WorkersOpt,
    WorkloadOpt,
)


def replay_command(
    trace: TraceArg = None,
    workload: WorkloadOpt = None,
    tasks: TasksOpt = 100,
    seed: SeedOpt = None,
    policy: PolicyOpt = None,
    residency: ResidencyOpt = None,
    workers: WorkersOpt = 8,
    gpu_profile: GpuProfileOpt = None,
    hbm_gib: HbmGibOpt = None,
    host_gib: HostGibOpt = 0.0,
    report: ReportOpt = None,
    limit: LimitOpt = None,
    jobs: JobsOpt = 1,
    stack: StackOpt = None,
    users: UsersOpt = None,
    capacity: CapacityOpt = False,
    slo_ttft_p95: SloTtftP95Opt = None,
    duration: DurationOpt = None,
    warmup: WarmupOpt = 600.0,
    worker_reaper: WorkerReaperOpt = None,
) -> None:
    """Replay a trace (or an agent workload) through every routing policy in virtual time;
    recorded agent sessions through every stack, closed loop."""
    machine = _simulated_machine(workers, gpu_profile, hbm_gib, host_gib, jobs, report)
    if trace is not None and bootstrap.is_session_trace(trace):
        _check_capacity_options(capacity, slo_ttft_p95)
        typer.echo(
            bootstrap.session_table(
                trace,
                stacks=stack,
                users=users,
                slo_ttft_p95_s=slo_ttft_p95,
                duration_s=duration,
                warmup_s=warmup,
                seed=seed,
                **machine,
            )
        )
        return
    _refuse_session_options(stack, users, capacity)
    typer.echo(
        bootstrap.replay_table(
            trace,
            workload=workload,
            tasks=tasks,
            seed=seed,
            policies=policy,
            residencies=residency,
            limit=limit,
            worker_reapers=worker_reaper,
            **machine,
        )
    )


def _simulated_machine(
    workers: int,
    gpu_profile: Path | None,
    hbm_gib: float | None,
    host_gib: float,
    jobs: int,
    report: Path | None,
) -> dict[str, Any]:
    """The options both kinds of replay share: the simulated workers, and where the run goes."""
    return {
        "workers": workers,
        "gpu_profile": gpu_profile,
        "hbm_gib": hbm_gib,
        "host_gib": host_gib,
        "jobs": jobs,
        "report": report,
    }


def _check_capacity_options(capacity: bool, slo_ttft_p95: float | None) -> None:
    """A capacity search needs its SLO, and an SLO is only for a capacity search."""
    if capacity != (slo_ttft_p95 is not None):
        raise typer.BadParameter("--capacity goes with --slo-ttft-p95 S")


def _refuse_session_options(stack: list[str] | None, users: int | None, capacity: bool) -> None:
    """--stack, --users and --capacity mean nothing to a trace or a workload."""
    if stack or users is not None or capacity:
        raise typer.BadParameter(
            "--stack, --users and --capacity replay agent sessions: "
            "give a folder of session files (or one .json/.json.gz)"
        )
