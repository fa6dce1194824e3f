"""`bench`: drive a running appliance over HTTP and report its latency."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from cli.options import DEFAULT_URL, DataDirOpt, JsonOpt, UrlOpt


def bench(
    url: UrlOpt = DEFAULT_URL,
    trace: Annotated[
        Path | None,
        typer.Option(
            help="Drive a recorded trace (Mooncake jsonl, Azure csv) instead, or recorded "
            "agent sessions (a folder of kv-cache-tester session files, or one) with --users."
        ),
    ] = None,
    users: Annotated[
        int | None,
        typer.Option(help="Recorded agent sessions: sessions at once (recycled).", min=1),
    ] = None,
    warmup: Annotated[
        float,
        typer.Option(help="Recorded agent sessions: seconds not counted at the start.", min=0),
    ] = 0.0,
    duration: Annotated[
        float, typer.Option(help="Seconds during which new turns start.", min=0.001)
    ] = 60.0,
    workload: Annotated[
        Path | None,
        typer.Option(help="Workload YAML (default: configs/workload.yaml)."),
    ] = None,
    concurrency: Annotated[
        int, typer.Option(help="Root tasks running at once (children add to them).", min=1)
    ] = 8,
    seed: Annotated[int | None, typer.Option(help="Workload seed (default: the file's).")] = None,
    time_scale: Annotated[
        float,
        typer.Option(
            help="Multiplies tool waits, or recorded sessions' think times (0.01: 100x faster).",
            min=0,
        ),
    ] = 1.0,
    drain: Annotated[
        float, typer.Option(help="Seconds in-flight turns may finish after the duration.", min=0)
    ] = 30.0,
    api_key: Annotated[
        str | None,
        typer.Option(help="API key for every tenant (default: each tenant's from the data dir)."),
    ] = None,
    data_dir: DataDirOpt = None,
    as_json: JsonOpt = False,
    report: Annotated[Path | None, typer.Option(help="Also write the JSON report here.")] = None,
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
