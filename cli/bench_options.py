"""The options of `bench`, one reusable annotated type each, so its signature stays short."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

BenchTraceOpt = Annotated[
    Path | None,
    typer.Option(
        help="Drive a recorded trace (Mooncake jsonl, Azure csv) instead, or recorded "
        "agent sessions (a folder of kv-cache-tester session files, or one) with --users."
    ),
]
BenchUsersOpt = Annotated[
    int | None,
    typer.Option(help="Recorded agent sessions: sessions at once (recycled).", min=1),
]
BenchWarmupOpt = Annotated[
    float,
    typer.Option(help="Recorded agent sessions: seconds not counted at the start.", min=0),
]
BenchDurationOpt = Annotated[
    float, typer.Option(help="Seconds during which new turns start.", min=0.001)
]
BenchWorkloadOpt = Annotated[
    Path | None,
    typer.Option(help="Workload YAML (default: configs/workload.yaml)."),
]
ConcurrencyOpt = Annotated[
    int, typer.Option(help="Root tasks running at once (children add to them).", min=1)
]
BenchSeedOpt = Annotated[int | None, typer.Option(help="Workload seed (default: the file's).")]
TimeScaleOpt = Annotated[
    float,
    typer.Option(
        help="Multiplies tool waits, or recorded sessions' think times (0.01: 100x faster).",
        min=0,
    ),
]
DrainOpt = Annotated[
    float, typer.Option(help="Seconds in-flight turns may finish after the duration.", min=0)
]
ApiKeyOpt = Annotated[
    str | None,
    typer.Option(help="API key for every tenant (default: each tenant's from the data dir)."),
]
BenchReportOpt = Annotated[Path | None, typer.Option(help="Also write the JSON report here.")]
