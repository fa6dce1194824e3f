"""The `appliance` command line: thin commands that each call one function.

Known failures (ApplianceError) print one line and exit with their code; a traceback is
shown only with APPLIANCE_DEBUG=1.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer

from appliance import __version__
from appliance.domain.errors import ApplianceError
from appliance.start import bootstrap


class SimScheduling(StrEnum):
    """vLLM's --scheduling-policy, for simulated workers run alone."""

    FCFS = "fcfs"
    PRIORITY = "priority"


app = typer.Typer(
    name="appliance",
    help="A single-box serving appliance for LLM agent workloads.",
    no_args_is_help=True,
    add_completion=True,  # --install-completion, --show-completion [bash|zsh|fish]
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # plain help: the rich panels showed every flag as `<bool>`
)
config_app = typer.Typer(
    help="Inspect the configuration.", no_args_is_help=True, rich_markup_mode=None
)
keys_app = typer.Typer(
    help="Manage API keys (tenants and operators).", no_args_is_help=True, rich_markup_mode=None
)
service_app = typer.Typer(
    help="The appliance as a systemd service.", no_args_is_help=True, rich_markup_mode=None
)
app.add_typer(config_app, name="config")
app.add_typer(keys_app, name="keys")
app.add_typer(service_app, name="service")


def _version(value: bool) -> None:
    if value:
        typer.echo(f"appliance {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option("--version", callback=_version, is_eager=True, help="Print the version."),
    ] = False,
) -> None:
    """A single-box serving appliance for LLM agent workloads."""


# Options shared by several commands, defined once.
ConfigOpt = Annotated[
    Path | None, typer.Option("--config", help="YAML config file (default: $APPLIANCE_CONFIG).")
]
DataDirOpt = Annotated[
    Path | None, typer.Option("--data-dir", help="Data dir (default: $APPLIANCE_DATA_DIR).")
]
UrlOpt = Annotated[str, typer.Option("--url", help="Base URL of a running appliance.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON for scripts.")]
DEFAULT_URL = "http://127.0.0.1:8080"


@app.command()
def up(
    config: ConfigOpt = None,
    engine: Annotated[str | None, typer.Option(help="auto | vllm | sim | external")] = None,
    workers: Annotated[int | None, typer.Option(help="Number of engine workers.")] = None,
    model: Annotated[str | None, typer.Option(help="Model path or name.")] = None,
    host: Annotated[str | None, typer.Option(help="Listen address.")] = None,
    port: Annotated[int | None, typer.Option(help="Listen port.")] = None,
    gpus: Annotated[
        str | None,
        typer.Option(
            help="GPU indices the workers share out, e.g. 0,1,2,3 (engine.gpus).",
            callback=lambda text: _gpu_list(text) and text,
        ),
    ] = None,
    data_dir: DataDirOpt = None,
) -> None:
    """Start the whole appliance in the foreground."""
    flags = {
        "data_dir": data_dir,
        "server": {"host": host, "port": port},
        "engine": {"kind": engine, "workers": workers, "model": model, "gpus": _gpu_list(gpus)},
    }
    settings = bootstrap.load_settings(config, **flags)
    bootstrap.run_appliance(settings, lambda: bootstrap.load_settings(config, **flags))


def _gpu_list(text: str | None) -> list[int] | None:
    if text is None:
        return None
    parts = [p.strip() for p in text.split(",")]
    if not all(p.isdigit() for p in parts):
        raise typer.BadParameter(f"{text!r}: give GPU indices separated by commas, e.g. 0,1,2,3")
    return [int(p) for p in parts]


TimeoutOpt = Annotated[
    float, typer.Option("--timeout", help="Seconds to wait for the appliance.", min=0)
]


@app.command()
def stop(config: ConfigOpt = None, data_dir: DataDirOpt = None, timeout: TimeoutOpt = 120) -> None:
    """Stop the appliance running on the data dir: it drains (requests in flight finish),
    stops its workers and exits; waits until it has."""
    typer.echo(bootstrap.stop_appliance(config, data_dir=data_dir, timeout_s=timeout))


@app.command()
def reload(config: ConfigOpt = None, data_dir: DataDirOpt = None, timeout: TimeoutOpt = 30) -> None:
    """Make the appliance running on the data dir read its API keys and its config again:
    applies log_level, costs and admission at once, names what needs a restart."""
    typer.echo(bootstrap.reload_appliance(config, data_dir=data_dir, timeout_s=timeout))


KeyOpt = Annotated[
    str | None,
    typer.Option("--key", help="Operator key (default: the first admin key in the data dir)."),
]


def _view(
    view: str, url: str, key: str | None, data_dir: Path | None, as_json: bool, **kw: bool
) -> None:
    from tui import client, tables  # the console's renderers; loaded only for these commands

    api_key, source = client.console_key(key, data_dir) or (None, None)
    try:
        state = client.fetch_state(url, api_key, key_source=source)
    except client.ConsoleError as exc:
        print(f"appliance: {exc.message}", file=sys.stderr)
        raise typer.Exit(1) from None
    if as_json:
        typer.echo(tables.json_view(state, view))  # type: ignore[arg-type]
        return
    render = {
        "status": tables.render_status,
        "sessions": tables.render_sessions,
        "tasks": lambda s: tables.render_tasks(s, tree=kw.get("tree", False)),
        "events": tables.render_events,
    }[view]
    typer.echo(render(state))


@app.command()
def status(
    url: UrlOpt = DEFAULT_URL,
    key: KeyOpt = None,
    data_dir: DataDirOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Workers, sessions and tasks in a few lines; exit 1 if the appliance is not reachable."""
    _view("status", url, key, data_dir, as_json)


@app.command()
def top(url: UrlOpt = DEFAULT_URL, key: KeyOpt = None, data_dir: DataDirOpt = None) -> None:
    """The operator console."""
    from tui.app import run_console

    run_console(url, key, data_dir)


@app.command()
def sessions(
    url: UrlOpt = DEFAULT_URL,
    key: KeyOpt = None,
    data_dir: DataDirOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Agent sessions of the running appliance."""
    _view("sessions", url, key, data_dir, as_json)


@app.command()
def tasks(
    url: UrlOpt = DEFAULT_URL,
    tree: Annotated[bool, typer.Option("--tree", help="Show fan-out trees.")] = False,
    key: KeyOpt = None,
    data_dir: DataDirOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Tasks of the running appliance."""
    _view("tasks", url, key, data_dir, as_json, tree=tree)


@app.command()
def events(
    url: UrlOpt = DEFAULT_URL,
    key: KeyOpt = None,
    data_dir: DataDirOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Recent events of the running appliance (restarts, releases, cancellations), newest
    first."""
    _view("events", url, key, data_dir, as_json)


@app.command()
def costs(
    db: Annotated[
        Path | None,
        typer.Option("--db", help="Ledger file to read offline (default: the data dir's)."),
    ] = None,
    by: Annotated[
        str, typer.Option(help="Group by: comma-separated of task_class, tenant.")
    ] = "task_class,tenant",
    since: Annotated[float | None, typer.Option(help="Unix time: roots created from.")] = None,
    until: Annotated[float | None, typer.Option(help="Unix time: roots created before.")] = None,
    config: ConfigOpt = None,
    data_dir: DataDirOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Cost per successful task, read from a ledger file (read-only): per group the direct
    cost, its share of the box's overhead (gpu_seconds mode) and their total."""
    if db is None:
        db = bootstrap.load_settings(config, data_dir=data_dir).ledger_path
    groups = tuple(g.strip() for g in by.split(",") if g.strip())
    rows = bootstrap.read_cost_report(db, by=groups, since=since, until=until)
    if as_json:
        typer.echo(json.dumps(rows, indent=2))
    else:
        typer.echo(_cost_table(rows))


_COST_HIDDEN = ("overhead_idle", "overhead_energy", "overhead_box", "direct_cost_per_success")


def _cost_table(rows: list[dict[str, object]]) -> str:
    """The report's table, and the overhead's parts below it (`--json` has them by group)."""
    shown = [{k: v for k, v in r.items() if k not in _COST_HIDDEN} for r in rows]
    parts = [sum(_number(r.get(k)) for r in rows) for k in _COST_HIDDEN[:3]]
    if not rows or not sum(parts):
        return _table(shown)
    currency = rows[0].get("currency") or ""
    return _table(shown) + (
        f"\noverhead {_fmt(sum(parts))} {currency}: idle GPU time {_fmt(parts[0])}, energy "
        f"{_fmt(parts[1])}, the box {_fmt(parts[2])}; shared by GPU-seconds"
    )


def _number(value: object) -> float:
    return float(value) if isinstance(value, int | float) else 0.0


@app.command("replay")
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


@app.command()
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


@app.command()
def sim(
    port: Annotated[int, typer.Option(help="HTTP port of worker 0; worker i uses port+i.")] = 8100,
    workers: Annotated[int, typer.Option(help="Number of simulated workers.")] = 1,
    gpu_profile: Annotated[
        Path | None, typer.Option(help="GPU profile JSON (default: the bundled H200).")
    ] = None,
    model: Annotated[
        str | None, typer.Option(help="Model directory whose tokenizer to use.")
    ] = None,
    served_model_name: Annotated[str, typer.Option(help="Model name clients use.")] = "sim",
    block_size: Annotated[int, typer.Option(help="KV block size in tokens.")] = 32,
    max_model_len: Annotated[int, typer.Option(help="Longest prompt + output.")] = 32768,
    kv_events_endpoint: Annotated[
        str | None, typer.Option(help="ZMQ endpoint of worker 0's KV events; worker i: port+i.")
    ] = None,
    hash_algo: Annotated[str, typer.Option(help="sha256 or sha256_cbor.")] = "sha256_cbor",
    python_hash_seed: Annotated[str, typer.Option(help="The engines' PYTHONHASHSEED.")] = "0",
    time_scale: Annotated[float, typer.Option(help="2.0 runs twice as slow as the GPU.")] = 1.0,
    scheduling_policy: Annotated[
        SimScheduling, typer.Option(help="fcfs, or priority (the lowest value first).")
    ] = SimScheduling.FCFS,
    num_gpu_blocks_override: Annotated[
        int | None, typer.Option(help="KV blocks, the null block included (default: the GPU's).")
    ] = None,
    retention_endpoint: Annotated[
        str | None,
        typer.Option(help="ZMQ endpoint of worker 0's KV retention control; worker i: port+i."),
    ] = None,
    num_host_blocks: Annotated[
        int, typer.Option(help="Host-memory KV blocks per worker (0: no host tier).", min=0)
    ] = 0,
    enable_auto_tool_choice: Annotated[
        bool, typer.Option(help="Accept every tool_choice and answer with tool calls.")
    ] = False,
) -> None:
    """Run simulated vLLM workers alone (vLLM's HTTP, metrics, KV-event and KV retention
    protocols)."""
    bootstrap.run_sim(
        workers=workers,
        port=port,
        gpu_profile=gpu_profile,
        model=model,
        served_model_name=served_model_name,
        block_size=block_size,
        max_model_len=max_model_len,
        kv_events_endpoint=kv_events_endpoint,
        hash_algo=hash_algo,
        python_hash_seed=python_hash_seed,
        time_scale=time_scale,
        scheduling_policy=scheduling_policy.value,
        num_gpu_blocks=num_gpu_blocks_override,
        retention_endpoint=retention_endpoint,
        num_host_blocks=num_host_blocks,
        enable_auto_tool_choice=enable_auto_tool_choice,
    )


@app.command()
def profile(
    model: Annotated[str, typer.Option(help="Model directory (a Hugging Face one) to measure.")],
    out: Annotated[
        Path | None,
        typer.Option(help="Where to write the profile JSON (default: ./profile-MODEL.json)."),
    ] = None,
    config: ConfigOpt = None,
) -> None:
    """Measure this box with MODEL through vLLM on its own device (a GPU, or the CPU build):
    prefill at a few lengths, decode at a few batch sizes, host-device copies; write a GPU
    profile for engine.gpu_profile and `appliance replay --gpu-profile`."""
    typer.echo(bootstrap.write_box_profile(model, out=out, config=config))


@app.command()
def doctor(config: ConfigOpt = None, data_dir: DataDirOpt = None) -> None:
    """Check GPUs, the engine install, ports, data dir and config: one line each."""
    checks = bootstrap.run_doctor(config, data_dir=data_dir)
    width = max(len(c.name) for c in checks)
    for c in checks:
        typer.echo(f"{c.status:<4}  {c.name:<{width}}  {c.detail}")
    if any(c.status == "fail" for c in checks):
        raise typer.Exit(1)


@config_app.command("show")
def config_show(config: ConfigOpt = None, data_dir: DataDirOpt = None) -> None:
    """Print the effective configuration (defaults, file, environment)."""
    typer.echo(bootstrap.show_config(config, data_dir=data_dir), nl=False)


@keys_app.command("add")
def keys_add(
    name: Annotated[str, typer.Argument(help="Tenant or operator name.")],
    admin: Annotated[bool, typer.Option("--admin", help="An operator key for /admin/*.")] = False,
    config: ConfigOpt = None,
    data_dir: DataDirOpt = None,
) -> None:
    """Add a key and print only the key on stdout."""
    typer.echo(bootstrap.add_api_key(name, admin=admin, config=config, data_dir=data_dir))


@keys_app.command("revoke")
def keys_revoke(
    name: Annotated[str, typer.Argument(help="The key's name (see `appliance keys list`).")],
    config: ConfigOpt = None,
    data_dir: DataDirOpt = None,
) -> None:
    """Remove a key; a running appliance refuses it within a second, no restart."""
    bootstrap.revoke_api_key(name, config=config, data_dir=data_dir)
    typer.echo(f"revoked {name}")


@keys_app.command("show")
def keys_show(
    name: Annotated[str, typer.Argument(help="The key's name (see `appliance keys list`).")],
    config: ConfigOpt = None,
    data_dir: DataDirOpt = None,
) -> None:
    """Print the key called NAME, only the key (e.g. `export KEY=$(appliance keys show
    default)`); an unknown name exits 2."""
    typer.echo(bootstrap.show_api_key(name, config=config, data_dir=data_dir))


@keys_app.command("list")
def keys_list(config: ConfigOpt = None, data_dir: DataDirOpt = None) -> None:
    """List key names and roles (never the keys)."""
    for k in bootstrap.list_api_keys(config=config, data_dir=data_dir):
        typer.echo(f"{k.name}\t{'admin' if k.admin else 'tenant'}\t{k.created_at}")


RootOpt = Annotated[
    Path,
    typer.Option("--root", help="Lay the files out under this folder as under / (packaging)."),
]


@service_app.command("install")
def service_install(root: RootOpt = Path("/")) -> None:
    """Write the systemd unit, its user, a config file and the data dir; print what to run
    next."""
    for line in bootstrap.install_service(root):
        typer.echo(line)


@service_app.command("uninstall")
def service_uninstall(root: RootOpt = Path("/")) -> None:
    """Remove the unit and its user's entry (the config and the data dir stay)."""
    for line in bootstrap.uninstall_service(root):
        typer.echo(line)


@service_app.command("status")
def service_status(root: RootOpt = Path("/")) -> None:
    """Which of the service's files are installed and what systemctl says; exit 1 without
    the unit."""
    lines, installed = bootstrap.service_report(root)
    for line in lines:
        typer.echo(line)
    if not installed:
        raise typer.Exit(1)


def _table(rows: list[dict[str, object]]) -> str:
    if not rows:
        return "no tasks in the ledger for this selection"
    cols = list(rows[0])
    cells = [[_fmt(r[c]) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(cols, widths, strict=True))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)) for row in cells]
    return "\n".join(lines)


def _fmt(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def main() -> None:
    try:
        app()  # standalone: click prints usage errors itself and exits 2
    except ApplianceError as exc:
        if os.environ.get("APPLIANCE_DEBUG") == "1":
            traceback.print_exc()
        print(f"appliance: {exc.message}", file=sys.stderr)
        sys.exit(exc.exit_code)


if __name__ == "__main__":
    main()
