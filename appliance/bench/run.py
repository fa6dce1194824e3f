"""`appliance bench`: one call that checks its inputs, runs the agents and returns the report.

Model of the world: the workload comes from `configs/workload.yaml` (or `--workload FILE`,
or the built-in defaults when the file is not installed), or from a recorded trace
(`--trace`: a Mooncake jsonl or Azure csv); the seed makes the tasks the same run after
run. Recorded agent sessions (`--trace DIR --users N`) run as `session_run.py` says. Each
tenant of the workload sends with the API key of the same name from the data dir's
`api-keys.toml` unless `--api-key` is given (then every tenant sends as that key's
tenant). Before any load the appliance must answer `GET /v1/models` with that key: that
tells the model name and its context limit. Task and session ids of a run share a fresh
`run_tag`, so the run's rows in the ledger can be told apart from every other run's;
`started_at`/`finished_at` (Unix seconds) bound the interval.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from appliance.bench.agents import Agents, RunPlan
from appliance.bench.client import ApplianceClient, BadInput, probe
from appliance.bench.report import Recorder, build_report, render, to_json
from appliance.bench.session_run import (
    holds_sessions,
    run_session_bench,
    session_run_tag,
    write_bench_report,
)
from appliance.bench.sessions import SessionRunPlan
from appliance.config.keystore import KEYS_FILE, load_keys
from appliance.workload import TaskTree, WorkloadSpec, iter_trees, load_spec
from appliance.workload.trace import load_trace_workload

DEFAULT_WORKLOAD = Path(__file__).resolve().parents[2] / "configs" / "workload.yaml"


def run_bench(
    *,
    url: str,
    workload: Path | None = None,
    trace: Path | None = None,
    duration_s: float = 60.0,
    concurrency: int = 8,
    seed: int | None = None,
    time_scale: float = 1.0,
    drain_s: float = 30.0,
    api_key: str | None = None,
    data_dir: Path | None = None,
    as_json: bool = False,
    report: Path | None = None,
    users: int | None = None,
    warmup_s: float = 0.0,
) -> str:
    """Run the benchmark; returns the table (or JSON) and writes `report` when given.
    Recorded agent sessions (`trace` a folder or a `.json[.gz]`) run with `users` at once."""
    if duration_s <= 0 or drain_s < 0 or concurrency < 1 or time_scale < 0:
        raise BadInput(
            "bench: --duration must be > 0, --drain >= 0, --concurrency >= 1 and --time-scale >= 0"
        )
    url = url.rstrip("/").removesuffix("/v1")
    spec = load_spec(workload) if workload else _default_spec()
    seed = spec.seed if seed is None else seed
    if (users is not None) != (trace is not None and holds_sessions(trace)):
        raise BadInput(
            "bench: --users N goes with --trace DIR (recorded agent sessions: a folder of "
            "kv-cache-tester session files, or one .json/.json.gz), and such a trace needs it"
        )
    if trace is not None and users is not None:
        tenant = spec.tenants[0].name
        key = resolve_keys([tenant], api_key=api_key, data_dir=data_dir)[tenant]
        plan = SessionRunPlan(
            session_run_tag(), users, duration_s, warmup_s, drain_s, time_scale, None
        )
        return run_session_bench(
            trace, url=url, api_key=key, plan=plan, as_json=as_json, report=report
        )
    trees, tenants = _trees(spec, trace, seed)
    keys = resolve_keys(tenants, api_key=api_key, data_dir=data_dir)
    run: dict[str, Any] = {
        "url": url,
        "workload": str(trace or workload or DEFAULT_WORKLOAD),
        "seed": seed,
        "concurrency": concurrency,
        "duration_s": duration_s,
        "drain_s": drain_s,
        "time_scale": time_scale,
        "run_tag": session_run_tag(),
    }
    result = asyncio.run(_run(run, trees, keys))
    write_bench_report(result, report, answered=result["steps"]["ok"])
    return to_json(result) if as_json else render(result)


def _trees(
    spec: WorkloadSpec, trace: Path | None, seed: int
) -> tuple[Iterator[TaskTree], list[str]]:
    """The task trees to run and their tenants: the trace's (one tenant) or the spec's."""
    if trace is None:
        return iter_trees(spec, seed=seed), [t.name for t in spec.tenants]
    tenant = spec.tenants[0].name
    workload = load_trace_workload(trace, tenant=tenant, max_context_tokens=spec.max_context_tokens)
    return iter(workload.trees), [tenant]


def _default_spec() -> WorkloadSpec:
    return load_spec(DEFAULT_WORKLOAD) if DEFAULT_WORKLOAD.is_file() else WorkloadSpec()


def _default_data_dir() -> Path:
    env = os.environ.get("APPLIANCE_DATA_DIR")
    return Path(env) if env else Path.home() / ".local/share/appliance"


def resolve_keys(
    tenants: list[str], *, api_key: str | None, data_dir: Path | None
) -> dict[str, str]:
    """Tenant -> API key: `api_key` for all, else each tenant's own key from the data dir."""
    if api_key:
        return dict.fromkeys(tenants, api_key)
    path = (data_dir or _default_data_dir()).expanduser() / KEYS_FILE
    if not path.is_file():
        raise BadInput(
            f"bench: no API key: {path} does not exist; pass --api-key or --data-dir "
            "(the appliance's data dir)"
        )
    own = {k.name: k.key for k in load_keys(path) if not k.admin}
    for tenant in tenants:
        if tenant not in own:
            raise BadInput(
                f"bench: no API key named '{tenant}' in {path} (the workload's tenant); "
                f"add one with `appliance keys add {tenant}` or pass --api-key"
            )
    return {t: own[t] for t in tenants}


async def _run(
    run: dict[str, Any], trees: Iterator[TaskTree], keys: dict[str, str]
) -> dict[str, Any]:
    url = run["url"]
    card = None
    for tenant, key in keys.items():
        card = await probe(url, key, tenant=tenant)
    assert card is not None
    run = {**run, "model": card.name, "max_model_len": card.max_model_len}
    clients = {
        key: ApplianceClient(url, key, model=card.name) for key in dict.fromkeys(keys.values())
    }
    by_tenant = {tenant: clients[key] for tenant, key in keys.items()}
    plan = RunPlan(
        run_tag=run["run_tag"],
        duration_s=run["duration_s"],
        drain_s=run["drain_s"],
        time_scale=run["time_scale"],
        max_model_len=card.max_model_len,
    )
    rec = Recorder()
    started_at, t0 = time.time(), time.perf_counter()
    try:
        await Agents(by_tenant, plan, rec).run(trees, run["concurrency"])
    finally:
        for client in clients.values():
            await client.aclose()
    wall_s = time.perf_counter() - t0
    run = {**run, "started_at": round(started_at, 3), "finished_at": round(time.time(), 3)}
    return build_report(rec, run, wall_s)
