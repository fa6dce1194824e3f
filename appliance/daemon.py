"""`appliance up`: Settings -> engine workers -> index, ledger, router -> HTTP API, until a
signal; then drain and stop in reverse order. Part of the composition root (with
bootstrap.py): the one place that names concrete engines, the ledger and the probes.

Engines: `sim` runs the simulated workers in a child process (`appliance sim`), `vllm` has
the supervisor start `vllm serve` workers, `external` connects to servers started elsewhere.
Every kind ends up as the same worker handles behind the same client, KV-event subscribers
and index, so the router cannot tell them apart.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import secrets
import signal
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from appliance import keystore
from appliance.api.auth import Caller
from appliance.api.server import ApiServer
from appliance.datadir import ensure_data_dir, lock_data_dir
from appliance.domain.errors import ConfigError
from appliance.domain.records import CostMode, Price, TenantId, WorkerId
from appliance.domain.worker import WORKER_KEEPALIVE_S
from appliance.engines.external import connect_external
from appliance.engines.factory import start_vllm_workers
from appliance.engines.launch import WorkerLaunch, default_served_name
from appliance.engines.preflight import check_port_free
from appliance.engines.worker_process import spawn, terminate_group
from appliance.engines.workers import KvIndexFeed, WorkerHandle, reported_model_len
from appliance.eventloop import new_event_loop
from appliance.gpu.nvml import NvmlProbe
from appliance.gpu.simulated import SimulatedGpu, SimulatedGpuProbe
from appliance.ledger import LedgerWriter
from appliance.perf import kv_capacity
from appliance.perf.profile import GpuProfile, bundled_profile, load_profile
from appliance.ports import GpuProbe, WorkerEndpoint
from appliance.services.worker_watch import WorkerWatch
from appliance.settings import EngineKind, Settings
from appliance.wiring import StartedEngines, Wiring, wire

log = logging.getLogger(__name__)
SIM_MAX_MODEL_LEN = 32768
REFRESH_S = 0.5


class WallClock:
    def now(self) -> float:
        return time.time()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


@dataclass
class Engines:
    kind: EngineKind
    workers: Sequence[WorkerHandle]
    served_name: str
    max_model_len: int
    refresh: Callable[[], Awaitable[Any]]
    """One reading of every worker's health (where the appliance does not supervise it)
    and load."""


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


def simulated_gpu(profile: GpuProfile, block_size: int) -> SimulatedGpu:
    """The GPU each simulated worker stands for, split as the worker splits it: vLLM's
    memory budget (utilisation x HBM) less the KV pool the worker sizes is weights and
    runtime."""
    utilization = kv_capacity.SIM_GPU_MEMORY_UTILIZATION
    total_bytes = profile.memory_bytes or kv_capacity.FALLBACK_HBM_BYTES
    blocks = kv_capacity.default_num_gpu_blocks(profile, block_size, utilization)
    kv_bytes = blocks * block_size * profile.kv_bytes_per_token
    baseline_bytes = max(int(total_bytes * utilization) - kv_bytes, 0)
    return SimulatedGpu(f"{profile.gpu} sim", total_bytes, baseline_bytes, kv_bytes)


def gpu_probe(
    kind: EngineKind,
    profile: GpuProfile,
    block_size: int,
    workers: Callable[[], Sequence[WorkerEndpoint]],
) -> GpuProbe:
    """NVML; under the simulated engine, the model of the GPUs its workers stand for."""
    if kind == EngineKind.SIM:
        return SimulatedGpuProbe(simulated_gpu(profile, block_size), workers)
    return NvmlProbe()


def _secret(data_dir: Path) -> bytes:
    path = data_dir / "secret.key"
    if not path.exists():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
    return bytes.fromhex(path.read_text().strip())


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
    ]
    if e.model:
        argv += ["--model", e.model]
    if e.gpu_profile:
        argv += ["--gpu-profile", str(e.gpu_profile)]
    return argv


@contextlib.asynccontextmanager
async def start_engines(
    settings: Settings, kind: EngineKind, feed: KvIndexFeed, log_dir: Path
) -> AsyncIterator[Engines]:
    e = settings.engine
    name = served_name(settings)
    if kind == EngineKind.VLLM:
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
            yield Engines(kind, supervisor.workers, name, limit, loads)
        finally:
            await supervisor.stop(drain_deadline_s=30.0)
        return
    urls = list(e.external_urls)
    endpoints = list(e.external_kv_event_endpoints)
    launches = []
    if kind == EngineKind.SIM:
        max_len = e.max_model_len or SIM_MAX_MODEL_LEN
        urls = [f"http://127.0.0.1:{e.base_port + i}" for i in range(e.workers)]
        endpoints = [f"tcp://127.0.0.1:{e.kv_events_base_port + i}" for i in range(e.workers)]
        launches = [
            WorkerLaunch(
                worker=WorkerId(f"w{i}"),
                index=i,
                argv=tuple(sim_argv(settings, i, max_len)),
                env=dict(os.environ),
                port=e.base_port + i,
                url=urls[i],
                kv_events_endpoint=endpoints[i],
                gpus=(),
                cpus=(),
            )
            for i in range(e.workers)
        ]
    external = await connect_external(
        urls,
        endpoints,
        model=name,
        on_kv_batch=feed.on_batch,
        on_kv_reset=feed.on_reset,
        keepalive_s=WORKER_KEEPALIVE_S if launches else e.external_keepalive_s,
        label=kind.value,
    )
    procs = []
    try:
        for launch in launches:
            proc, _ = await spawn(launch, log_dir / f"sim-{launch.worker}.log")
            procs.append(proc)
        if launches:
            await _await_healthy(external, procs, log_dir)
        limit = await model_limit(external.workers, name, e.max_model_len)
        yield Engines(kind, external.workers, name, limit, external.refresh)
    finally:
        await external.aclose()
        await asyncio.gather(*(terminate_group(p, grace_s=5.0) for p in procs))


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


async def serve(settings: Settings, *, ready: asyncio.Event | None = None) -> None:
    """`appliance up` until cancelled: engines, the wired appliance, the API and the refresh
    loop run under one task group; cancelling it drains the API, stops the workers and
    closes the ledger."""
    check_port_free(settings.server.host, settings.server.port, "the API", "pass --port")
    data_dir = ensure_data_dir(settings.data_dir)
    with lock_data_dir(data_dir):
        await _serve(settings, data_dir, ready)


def _plural(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def key_callers(key_file: keystore.KeyFile) -> Callable[[], dict[str, Caller]]:
    """The callers of the keys in the key file as it is now (read anew when it changes)."""
    seen: list[Any] = [None, {}]  # the file's version, its callers

    def now() -> dict[str, Caller]:
        keys = key_file.current()
        if seen[0] != key_file.version:
            seen[:] = [key_file.version, {k.key: Caller(TenantId(k.name), k.admin) for k in keys}]
        callers: dict[str, Caller] = seen[1]
        return callers

    return now


async def _serve(settings: Settings, data_dir: Path, ready: asyncio.Event | None) -> None:
    log_dir = ensure_data_dir(data_dir / "logs")
    kind = resolve_kind(settings)
    keys_file = keystore.keys_path(data_dir)
    keystore.ensure_default_keys(keys_file)
    keys = key_callers(keystore.KeyFile(keys_file))
    ledger = _open_ledger(settings)
    gpu_profile = settings.engine.gpu_profile
    profile = load_profile(gpu_profile) if gpu_profile else bundled_profile()
    clock = WallClock()
    feed = KvIndexFeed()
    probe: GpuProbe | None = None
    try:
        async with start_engines(settings, kind, feed, log_dir) as engines:
            probe = gpu_probe(kind, profile, settings.engine.block_size, lambda: engines.workers)
            view = StartedEngines(
                lambda: engines.workers,
                engines.served_name,
                engines.max_model_len,
                runtime_identity(settings, kind),
            )
            wired = wire(
                settings,
                engines=view,
                ledger=ledger,
                feed=feed,
                clock=clock,
                probe=probe,
                profile=profile,
                keys=keys,
                secret=_secret(data_dir),
            )
            server = ApiServer(wired.app, settings.server.host, settings.server.port, grace_s=30)
            url = f"http://{settings.server.host}:{settings.server.port}"
            print(
                f"appliance: engine {kind.value} ({_plural(len(engines.workers), 'worker')}, model "
                f"{engines.served_name}); API at {url}; keys in {keys_file}",
                flush=True,
            )
            async with asyncio.TaskGroup() as group:
                serving = group.create_task(server.serve())
                refresher = group.create_task(_refresh(engines, wired, clock, ledger))
                await _started(server, serving, ready)
                await serving
                refresher.cancel()
    finally:
        ledger.close()
        if probe is not None:
            probe.close()


def _open_ledger(settings: Settings) -> LedgerWriter:
    """The ledger, with the configured price in effect from now."""
    ledger = LedgerWriter.open(
        settings.ledger_path,
        synchronous=settings.ledger.synchronous,
        batch_max=settings.ledger.batch_max,
        busy_timeout_s=settings.ledger.busy_timeout_s,
    )
    c = settings.costs
    ledger.set_price(
        Price(
            mode=CostMode(c.mode),
            effective_from=time.time(),
            currency=c.currency,
            fresh_per_mtok=c.fresh_per_mtok,
            cached_per_mtok=c.cached_per_mtok,
            output_per_mtok=c.output_per_mtok,
            reasoning_per_mtok=c.reasoning_per_mtok,
            gpu_second=c.gpu_second,
        )
    ).result()
    return ledger


async def _started(
    server: ApiServer, serving: asyncio.Task[None], ready: asyncio.Event | None
) -> None:
    while not server.started and not serving.done():
        await asyncio.sleep(0.05)
    # Everything built so far (modules, settings, the app) lives as long as the process:
    # moved out of the collector's sight, a full collection no longer walks it (tens of ms
    # on the event loop, a p99 of every request in flight).
    gc.collect()
    gc.freeze()
    if ready is not None:
        ready.set()


async def _refresh(engines: Engines, wired: Wiring, clock: WallClock, ledger: LedgerWriter) -> None:
    """Twice a second: the workers' health and load, their measured speeds, restarts and
    outages into the event feed, one GPU reading, and while the ledger cannot write, a probe
    of whether it can again."""
    watch = WorkerWatch(wired.events, restarts=lambda w: w.restarts)  # type: ignore[attr-defined]
    while True:
        try:
            await engines.refresh()
            if ledger.failing is not None:  # is there room again? (clears `failing`)
                ledger.probe()
            watch.observe(engines.workers, clock.now())
            wired.speeds.observe(engines.workers)
            wired.gpu.reading = await asyncio.to_thread(wired.gpu.probe.snapshot)
        except Exception:
            log.exception("refreshing worker and GPU readings failed")
        await asyncio.sleep(REFRESH_S)


def run_foreground(settings: Settings) -> None:
    """Foreground: until Ctrl-C or SIGTERM, then a clean stop. The appliance's own log lines
    go to stderr at `log_level`."""
    logging.basicConfig(
        level=settings.log_level,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    loop = new_event_loop()
    main = loop.create_task(serve(settings))

    def stop(name: str) -> None:
        log.warning("%s: draining (requests in flight may finish), then stopping", name)
        main.cancel()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop, sig.name)
    with contextlib.suppress(asyncio.CancelledError):
        loop.run_until_complete(main)
    loop.close()
    log.warning("stopped")
