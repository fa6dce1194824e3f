"""The configured engines started, as worker handles, for as long as the appliance runs.
Part of the composition root (with bootstrap.py, daemon.py and wiring.py): it names the
concrete engines.

`sim` runs the simulated workers, one `appliance sim` child process each, kept running as
the supervisor keeps vLLM's (an exit forgets the worker's KV and holds at once, and it is
started again); `vllm` has the supervisor start `vllm serve` workers; `external` connects
to servers started elsewhere.
Every kind ends up as the same worker handles behind the same client, KV-event subscribers
and index, so the router cannot tell them apart. With `engine.kv_retention` the vLLM and
the simulated workers also speak the retention control protocol, each to a socket the
appliance binds for it (`Engines.retention`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
import time
from asyncio.subprocess import Process
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq

from appliance.domain.errors import ConfigError
from appliance.domain.records import WorkerId
from appliance.domain.worker import WORKER_KEEPALIVE_S, restart_backoff_s
from appliance.engines.errors import PortInUse
from appliance.engines.external import connect_external
from appliance.engines.factory import start_vllm_workers
from appliance.engines.launch import WorkerLaunch, default_served_name
from appliance.engines.power_control import PowerControl
from appliance.engines.retention.client import RetentionClient
from appliance.engines.retention.plugin import RetentionLaunch
from appliance.engines.supervisor import SupervisorTimings
from appliance.engines.worker_process import reap_group, spawn, terminate_group
from appliance.engines.workers import KvIndexFeed, WorkerHandle, reported_model_len
from appliance.gpu.nvml import NvmlProbe
from appliance.perf.profile import bundled_profile, load_profile
from appliance.policy.worker_power import ALL_STATES, CPU_VLLM_STATES, PowerState
from appliance.settings import EngineKind, Settings

log = logging.getLogger(__name__)
SIM_MAX_MODEL_LEN = 32768


@dataclass
class Engines:
    kind: EngineKind
    workers: Sequence[WorkerHandle]
    served_name: str
    max_model_len: int
    refresh: Callable[[], Awaitable[Any]]
    """One reading of every worker's health (where the appliance does not supervise it)
    and load."""
    retention: RetentionClient | None = None
    """The workers' retention control channels (None: `engine.kv_retention` is off, or
    the workers are external)."""
    power: PowerControl | None = None
    """Sleep, stop and wake of the workers (None: the appliance did not start them)."""
    power_states: frozenset[PowerState] = CPU_VLLM_STATES
    """The states they can be put to (all, with sleep mode)."""

    @property
    def no_retention(self) -> str:
        """Why the workers have no retention channel (when they have none)."""
        if self.kind in (EngineKind.VLLM, EngineKind.SIM):
            return "engine.kv_retention is false"
        return "external vLLM workers have no retention channel"


def resolve_kind(settings: Settings) -> EngineKind:
    kind = settings.engine.kind
    if kind != EngineKind.AUTO:
        return kind
    gpus = NvmlProbe().snapshot().gpus
    try:
        import vllm  # noqa: F401

        has_vllm = True
    except ImportError:
        has_vllm = False
    return EngineKind.VLLM if gpus and has_vllm else EngineKind.SIM


def served_name(settings: Settings) -> str:
    e = settings.engine
    return e.served_model_name or (default_served_name(e.model) if e.model else "sim")


def runtime_identity(settings: Settings, kind: EngineKind) -> str:
    """What a cached prefix is valid against: engine, model, block size, hash and seed."""
    e = settings.engine
    return (f"{kind.value}:{served_name(settings)}:bs{e.block_size}:{e.hash_algo}"
            f":seed{e.python_hash_seed}")  # fmt: skip


def start_engines(
    settings: Settings, kind: EngineKind, feed: KvIndexFeed, log_dir: Path
) -> contextlib.AbstractAsyncContextManager[Engines]:
    """The engines of `kind`, up until the context ends; then stopped (vLLM workers drained,
    simulated workers terminated, connections closed)."""
    if kind == EngineKind.VLLM:
        return _vllm_engines(settings, feed, log_dir)
    return _connected_engines(settings, kind, feed, log_dir)


@contextlib.asynccontextmanager
async def _vllm_engines(
    settings: Settings, feed: KvIndexFeed, log_dir: Path
) -> AsyncIterator[Engines]:
    e = settings.engine
    if e.kv_host_bytes:
        raise ConfigError(
            "engine.kv_host_bytes: only the simulated workers have a host tier yet (vLLM's CPU "
            "build refuses host offloading); set it to 0 for vLLM workers"
        )
    name = served_name(settings)
    supervisor = await start_vllm_workers(
        e,
        python=e.python or sys.executable,
        log_dir=log_dir,
        gpu_snapshot=NvmlProbe().snapshot(),
        on_kv_batch=feed.on_batch,
        on_kv_reset=feed.on_reset,
        kv_cache_memory_bytes=e.kv_cache_memory_bytes,
    )

    async def loads() -> None:
        await asyncio.gather(*(w.refresh_load() for w in supervisor.workers if w.healthy))

    try:
        limit = await model_limit(supervisor.workers, name, e.max_model_len)
        states = ALL_STATES if e.sleep_mode else CPU_VLLM_STATES
        yield Engines(EngineKind.VLLM, supervisor.workers, name, limit, loads,
                      supervisor.retention, supervisor.power, states)  # fmt: skip
    finally:
        await supervisor.stop(drain_deadline_s=30.0)


@contextlib.asynccontextmanager
async def _connected_engines(
    settings: Settings, kind: EngineKind, feed: KvIndexFeed, log_dir: Path
) -> AsyncIterator[Engines]:
    """External servers, or the simulated workers this starts first and then connects to."""
    e = settings.engine
    name = served_name(settings)
    if kind == EngineKind.SIM:
        launches = sim_launches(settings)
        urls = [w.url for w in launches]
        endpoints = [w.kv_events_endpoint for w in launches]
    else:
        launches, urls = [], list(e.external_urls)
        endpoints = list(e.external_kv_event_endpoints)
    external = await connect_external(
        urls,
        endpoints,
        model=name,
        on_kv_batch=feed.on_batch,
        on_kv_reset=feed.on_reset,
        keepalive_s=WORKER_KEEPALIVE_S if launches else e.external_keepalive_s,
        label=kind.value,
        request_timeout_s=e.request_timeout_s,
    )
    procs: dict[WorkerId, Process] = {}
    keepers: list[asyncio.Task[None]] = []
    retention = None
    try:
        retention = await _bind_retention(settings, launches)
        for launch in launches:
            procs[launch.worker], _ = await spawn(launch, _sim_log(log_dir, launch))
        if launches:
            await _await_healthy(external, list(procs.values()), log_dir)
        for launch, handle in zip(launches, external.workers, strict=False):
            handle.gpus = launch.gpus
            keep = _keep_running(launch, handle, procs, log_dir, feed, retention)
            keepers.append(asyncio.create_task(keep, name=f"keep {launch.worker}"))
        limit = await model_limit(external.workers, name, e.max_model_len)
        yield Engines(kind, external.workers, name, limit, external.refresh, retention)
    finally:
        for task in keepers:
            task.cancel()
        await asyncio.gather(*keepers, return_exceptions=True)
        if retention is not None:
            await retention.aclose()
        await external.aclose()
        await asyncio.gather(*(terminate_group(p, grace_s=5.0) for p in procs.values()))


def _sim_log(log_dir: Path, launch: WorkerLaunch) -> Path:
    return log_dir / f"sim-{launch.worker}.log"


async def _keep_running(
    launch: WorkerLaunch,
    handle: WorkerHandle,
    procs: dict[WorkerId, Process],
    log_dir: Path,
    feed: KvIndexFeed,
    retention: RetentionClient | None,
) -> None:
    """Keeps a simulated worker running as the supervisor keeps a vLLM worker: when its
    process exits, the KV index forgets its blocks and the retention view its holds at once
    (a restarted worker holds nothing), and it is started again after the same backoff,
    until it has exited more than `max_restarts_in_a_row` times in a row."""
    t = SupervisorTimings()
    failures = 0
    while True:
        proc, started = procs[launch.worker], time.monotonic()
        code = await proc.wait()
        feed.on_reset(launch.worker, f"worker exited with code {code}")
        if retention is not None:
            retention.forget(launch.worker)
        await reap_group(proc.pid, 1.0, proc)
        stable = time.monotonic() - started >= t.stable_after_s
        failures = 1 if stable else failures + 1
        if failures > t.max_restarts_in_a_row:
            log.error("simulated worker %s exited %d times in a row; not started again",
                      launch.worker, failures)  # fmt: skip
            return
        backoff = restart_backoff_s(failures, base_s=t.restart_base_s, cap_s=t.restart_cap_s)
        log.warning("simulated worker %s exited with code %s; starting it again in %.0f s",
                    launch.worker, code, backoff)  # fmt: skip
        await asyncio.sleep(backoff)
        procs[launch.worker], _ = await spawn(launch, _sim_log(log_dir, launch))
        handle.restarts += 1


def sim_launches(settings: Settings) -> list[WorkerLaunch]:
    """One `appliance sim` process per simulated worker, on consecutive ports."""
    e = settings.engine
    max_len = e.max_model_len or SIM_MAX_MODEL_LEN
    return [
        WorkerLaunch(
            worker=WorkerId(f"w{i}"),
            index=i,
            argv=tuple(sim_argv(settings, i, max_len)),
            env=dict(os.environ),
            port=e.base_port + i,
            url=f"http://127.0.0.1:{e.base_port + i}",
            kv_events_endpoint=f"tcp://127.0.0.1:{e.kv_events_base_port + i}",
            gpus=sim_gpus(settings, i),
            cpus=(),
        )
        for i in range(e.workers)
    ]


def sim_gpus(settings: Settings, index: int) -> tuple[int, ...]:
    """The GPU ids simulated worker `index` carries (`engine.gpus`, shared out as vLLM's
    workers share them); none without it."""
    e = settings.engine
    if e.gpus is None:
        return ()
    return tuple(e.gpus[index * e.gpus_per_worker : (index + 1) * e.gpus_per_worker])


def _retention_launch(settings: Settings) -> RetentionLaunch | None:
    e = settings.engine
    return RetentionLaunch(e.kv_retention_base_port) if e.kv_retention else None


async def _bind_retention(
    settings: Settings, launches: Sequence[WorkerLaunch]
) -> RetentionClient | None:
    """The simulated workers' retention control sockets, bound before they start."""
    plan = _retention_launch(settings)
    if plan is None or not launches:
        return None
    client = RetentionClient({w.worker: plan.endpoint(w.index) for w in launches})
    try:
        return client.bind()
    except zmq.ZMQError as exc:
        await client.aclose()
        raise PortInUse(
            f"cannot bind the retention control channel ({exc}); choose another "
            "engine.kv_retention_base_port"
        ) from None


def sim_argv(settings: Settings, index: int, max_model_len: int) -> list[str]:
    """`appliance sim` for worker `index`: one process per worker, as with vLLM."""
    e = settings.engine
    argv = [
        sys.executable,
        "-m",
        "cli.main",
        "sim",
        "--workers",
        "1",
        "--port",
        str(e.base_port + index),
        "--block-size",
        str(e.block_size),
        "--max-model-len",
        str(max_model_len),
        "--kv-events-endpoint",
        f"tcp://127.0.0.1:{e.kv_events_base_port + index}",
        "--served-model-name",
        served_name(settings),
        "--python-hash-seed",
        e.python_hash_seed,
        "--hash-algo",
        e.hash_algo,
        "--time-scale",
        str(e.sim_time_scale),
        "--scheduling-policy",
        "priority",  # as the vLLM workers: turns carry their tenant-clipped priority
    ]
    if e.model:
        argv += ["--model", e.model]
    if e.gpu_profile:
        argv += ["--gpu-profile", str(e.gpu_profile)]
    if e.enable_auto_tool_choice:  # the sim's calls are hermes-style whatever the parser
        argv.append("--enable-auto-tool-choice")
    if (retention := _retention_launch(settings)) is not None:
        argv += ["--retention-endpoint", retention.endpoint(index)]  # as vLLM's connector
    profile = load_profile(e.gpu_profile) if e.gpu_profile else bundled_profile()
    per_block = e.block_size * profile.kv_bytes_per_token
    if e.kv_cache_memory_bytes is not None:  # the pool as vLLM would size it from the bytes
        argv += ["--num-gpu-blocks-override", str(max(1, e.kv_cache_memory_bytes // per_block))]
    if e.kv_host_bytes:  # the host tier, in blocks of the same size
        argv += ["--num-host-blocks", str(max(1, e.kv_host_bytes // per_block))]
    return argv


async def model_limit(workers: Sequence[WorkerHandle], name: str, configured: int | None) -> int:
    """The longest prompt + output the API lets through: what the workers report (a vLLM
    started without --max-model-len takes the model's own limit), or the configured limit
    where no worker says (an external server not up yet), else the simulated engine's."""
    reported = await reported_model_len(workers, name)
    if reported is None:
        log.warning("no worker reported its max_model_len; the API assumes %s",
                    configured or SIM_MAX_MODEL_LEN)  # fmt: skip
        return configured or SIM_MAX_MODEL_LEN
    return min(reported, configured or reported)


async def _await_healthy(
    external: Any, procs: list[Any], log_dir: Path, timeout_s: float = 60
) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        await external.refresh()
        if all(w.healthy for w in external.workers):
            return
        if any(p.returncode is not None for p in procs):
            raise ConfigError(
                f"a simulated worker exited during its start; see {log_dir}/sim-w*.log"
            )
        await asyncio.sleep(0.2)
    raise ConfigError(f"the simulated workers did not answer /health in {timeout_s:.0f} s")
