"""The composition root: Settings -> adapters -> services. The only module that names the
concrete ledger, engines and probes; the CLI calls the functions here and nothing deeper."""

from __future__ import annotations

import math
import os
import shutil
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from appliance.config import keystore
from appliance.config import settings_load as _settings
from appliance.config.datadir import ensure_data_dir
from appliance.config.settings import Settings
from appliance.config.settings_yaml import dump_yaml
from appliance.domain.errors import ConfigError
from appliance.start import doctor as _doctor
from appliance.start import instance


def load_settings(config: Path | None = None, **flags: Any) -> Settings:
    return _settings.load(config, **flags)


def show_config(config: Path | None, *, data_dir: Path | None = None) -> str:
    return dump_yaml(load_settings(config, data_dir=data_dir))


def run_doctor(config: Path | None, *, data_dir: Path | None = None) -> list[_doctor.Check]:
    return _doctor.run_checks(load_settings(config, data_dir=data_dir))


def read_cost_report(
    db: Path, *, by: Sequence[str], since: float | None, until: float | None
) -> list[dict[str, Any]]:
    from appliance.ledger import reports  # loaded only for this command

    return reports.cost_report(db, by=tuple(by), since=since, until=until)


def add_api_key(name: str, *, admin: bool, config: Path | None, data_dir: Path | None) -> str:
    home = ensure_data_dir(load_settings(config, data_dir=data_dir).data_dir)
    return keystore.add_key(keystore.keys_path(home), name, admin=admin).key


def revoke_api_key(name: str, *, config: Path | None, data_dir: Path | None) -> None:
    home = load_settings(config, data_dir=data_dir).data_dir
    keystore.revoke_key(keystore.keys_path(home), name)


def show_api_key(name: str, *, config: Path | None, data_dir: Path | None) -> str:
    home = load_settings(config, data_dir=data_dir).data_dir
    return keystore.find_key(keystore.keys_path(home), name).key


def list_api_keys(*, config: Path | None, data_dir: Path | None) -> list[keystore.ApiKey]:
    home = load_settings(config, data_dir=data_dir).data_dir
    return keystore.load_keys(keystore.keys_path(home))


def run_appliance(settings: Settings, reload: Callable[[], Settings] | None = None) -> None:
    """`appliance up`; `reload` reads the settings again as they were read (SIGHUP)."""
    from appliance.start import daemon  # the daemon's imports are only paid by `up`

    daemon.run_foreground(settings, reload)


def stop_appliance(config: Path | None, *, data_dir: Path | None, timeout_s: float) -> str:
    """`appliance stop`: the running appliance of the data dir drained and stopped."""
    home = load_settings(config, data_dir=data_dir).data_dir.expanduser()
    pid = instance.stop_instance(home, timeout_s=timeout_s)
    return f"stopped the appliance (pid {pid}) on {home}"


def reload_appliance(config: Path | None, *, data_dir: Path | None, timeout_s: float) -> str:
    """`appliance reload`: the running appliance's keys and live settings read again; what
    it answered. Raises ReloadFailed when it could not load its config."""
    from appliance.start.live_reload import describe

    home = load_settings(config, data_dir=data_dir).data_dir.expanduser()
    answer = instance.reload_instance(home, timeout_s=timeout_s)
    if not answer.get("ok", False):
        raise instance.InstanceError(describe(answer))
    return describe(answer)


def install_service(root: Path) -> list[str]:
    """`appliance service install`: the unit, the user, the config and the data dir under
    `root`, the unit running this very `appliance`."""
    from appliance.start import service_files

    return service_files.write_service(root, _own_executable())


def uninstall_service(root: Path) -> list[str]:
    from appliance.start import service_files

    return service_files.remove_service(root)


def service_report(root: Path) -> tuple[list[str], bool]:
    from appliance.start import service_files

    return service_files.describe_service(root)


def _own_executable() -> str:
    """The `appliance` of this installation (beside its Python), else the one on PATH."""
    beside = Path(sys.executable).parent / "appliance"
    found = str(beside) if beside.is_file() else shutil.which("appliance")
    if found is None:
        raise ConfigError(
            "cannot find the `appliance` command of this installation; run "
            "it from the virtual environment install.sh made"
        )
    return os.path.abspath(found)


def run_sim(*, workers: int, port: int, **config: Any) -> None:
    from appliance.sim.entrypoints.serving import run_workers

    if config.get("gpu_profile") is not None:
        config["gpu_profile"] = str(config["gpu_profile"])
    run_workers(workers, port, **config)


def is_session_trace(path: Path) -> bool:
    """Recorded agent sessions: a folder, or a `.json` / `.json.gz` file."""
    return path.is_dir() or path.name.endswith((".json", ".json.gz"))


def session_table(path: Path, *, duration_s: float | None, warmup_s: float, **options: Any) -> str:
    """`appliance replay DIR`: recorded agent sessions through each stack, closed loop."""
    from appliance.replay.sessions.run_window import RunWindow
    from appliance.replay.sessions.session_report import render_session_report, run_sessions

    if not path.exists():
        raise ConfigError(f"replay: {path} does not exist")
    try:
        window = RunWindow(duration_s=duration_s or math.inf, warmup_s=warmup_s)
        return render_session_report(run_sessions(path, window=window, **options))
    except ValueError as exc:
        raise ConfigError(f"replay: {exc}") from None


def replay_table(
    trace: Path | None,
    *,
    workload: Path | None = None,
    tasks: int = 100,
    seed: int | None = None,
    **options: Any,
) -> str:
    """`appliance replay`: the comparison table of a trace, or of a closed-loop workload of
    `tasks` root tasks generated from the `workload` spec (`seed`: its draw's, else the
    spec's; priced at the configured GPU-second); the JSON report goes where `report`
    says."""
    from appliance.replay import render_table, run_replay, run_workload

    if (trace is None) == (workload is None):
        raise ConfigError("replay: give a TRACE or --workload FILE, one of the two")
    try:
        if workload is not None:
            from appliance.replay.kv_residency.residency import wait_priors
            from appliance.workload import generate, load_spec

            if options.pop("limit", None) is not None:
                raise ConfigError("replay: --limit cuts a trace; a workload takes --tasks N")
            spec = load_spec(workload)
            generated = generate(spec, root_tasks=tasks, seed=seed)
            result = run_workload(
                generated.tasks,
                wait_priors=wait_priors(spec.tool_classes),
                gpu_second=load_settings().costs.gpu_second,
                source=str(workload) if seed is None else f"{workload} (seed {seed})",
                progress=sys.stderr.isatty(),
                **options,
            )
        else:
            assert trace is not None
            if seed is not None:
                raise ConfigError("replay: --seed draws a workload; a trace is replayed as is")
            if not trace.is_file():
                raise ConfigError(
                    f"trace {trace} does not exist; pass a Mooncake .jsonl or Azure .csv"
                )
            result = run_replay(trace, progress=sys.stderr.isatty(), **options)
    except ValueError as exc:
        raise ConfigError(f"replay: {exc}") from None
    return render_table(result)


def write_box_profile(model: str, *, out: Path | None, config: Path | None) -> str:
    """`appliance profile`: measures this box with `model` through engine.python's vLLM at
    engine.kv_cache_dtype and engine.block_size, writes the profile (default:
    ./profile-MODEL.json) and returns what to tell the user."""
    from appliance.engines.profiling.box_profile import profile_box

    e = load_settings(config).engine
    out = out or Path(f"profile-{Path(model).expanduser().resolve().name}.json")
    profile = profile_box(
        model,
        out=out,
        python=e.python or sys.executable,
        kv_cache_dtype=e.kv_cache_dtype,
        block_size=e.block_size,
        say=lambda line: print(line, file=sys.stderr, flush=True),
    )
    full = next(p for p in profile.prefill if p.reused_tokens == 0)
    step = profile.decode[0]
    copy = profile.copies[-1]
    copy_gbps = copy.nbytes / copy.h2d_s / 1e9
    return (
        f"wrote {out}: {profile.gpu}; KV {profile.kv_bytes_per_token:,} B per token; prefill of "
        f"{full.fresh_tokens} tokens {full.seconds * 1e3:.1f} ms; decode step (batch "
        f"{step.batch_size}) {step.seconds * 1e3:.2f} ms; copy {copy_gbps:.1f} GB/s\n"
        f"use it: engine.gpu_profile: {out} (appliance up), or appliance replay TRACE "
        f"--gpu-profile {out}"
    )
