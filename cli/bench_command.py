"""`bench`: drive a running appliance over HTTP and report its latency."""

from __future__ import annotations

import typer

from cli.bench_options import (
    ApiKeyOpt,
    BenchDurationOpt,
    BenchReportOpt,
    BenchSeedOpt,
    BenchTraceOpt,
    BenchUsersOpt,
    BenchWarmupOpt,
    BenchWorkloadOpt,
    ConcurrencyOpt,
    DrainOpt,
    TimeScaleOpt,
)
from cli.options import DEFAULT_URL, DataDirOpt, JsonOpt, UrlOpt


def bench(
    url: UrlOpt = DEFAULT_URL,
    trace: BenchTraceOpt = None,
    users: BenchUsersOpt = None,
    warmup: BenchWarmupOpt = 0.0,
    duration: BenchDurationOpt = 60.0,
    workload: BenchWorkloadOpt = None,
    concurrency: ConcurrencyOpt = 8,
    seed: BenchSeedOpt = None,
    time_scale: TimeScaleOpt = 1.0,
    drain: DrainOpt = 30.0,
    api_key: ApiKeyOpt = None,
    data_dir: DataDirOpt = None,
    as_json: JsonOpt = False,
    report: BenchReportOpt = None,
) -> None:
    """Drive a running appliance with concurrent agent sessions; report step and task latency
    (recorded sessions: the replay's figures and the router's CPU per turn)."""
    from appliance.bench import run_bench  # the HTTP client side; loaded only for this command

    typer.echo(
        run_bench(
            url=url,
            workload=workload,
            trace=trace,
            duration_s=duration,
            concurrency=concurrency,
            seed=seed,
            time_scale=time_scale,
            drain_s=drain,
            api_key=api_key,
            data_dir=data_dir,
            as_json=as_json,
            report=report,
            users=users,
            warmup_s=warmup,
        )
    )
