"""The configured engines started, as worker handles, for as long as the appliance runs.
Part of the composition root (with bootstrap.py, daemon.py and wiring.py): it names the
concrete engines.

`vllm` has the supervisor start `vllm serve` workers; `sim` has the same supervisor start
the simulated workers, one `python -m appliance.sim.entrypoints.vllm_entry` process each started
from vLLM's own command line (appliance/engines/supervision/sim_launch.py), so both are kept running
alike (an exit forgets the worker's KV and holds at once, and it is started again after a
backoff) and both can be slept, stopped and woken (`Engines.power`); `external` connects to
servers started elsewhere. Every kind ends up as the same worker handles behind the same
client, KV-event subscribers and index, so the router cannot tell them apart. With
`engine.kv_retention` the vLLM and the simulated workers also speak the retention control
protocol, each to a socket the appliance binds for it (`Engines.retention`), and with
`engine.kv_host_bytes` they have a host tier (vLLM's offloading connector; the simulated
workers model it), where the reaper demotes sessions. The
supervisor's worker events go to `on_event` (the daemon records the power changes in the
operator's event feed).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from appliance.config.settings import EngineKind, Settings
from appliance.domain.records import WorkerId
from appliance.domain.worker import WorkerEvent
from appliance.engines.clients.workers import KvIndexFeed, WorkerHandle, reported_model_len
from appliance.engines.external import connect_external
from appliance.engines.factory import start_sim_workers, start_vllm_workers
from appliance.engines.offload.support import check_host_tier
from appliance.engines.retention.client import RetentionClient
from appliance.engines.supervision.launch import default_served_name
from appliance.engines.supervision.power_control import PowerControl
from appliance.engines.supervision.sim_launch import SIM_MAX_MODEL_LEN, sim_wake_seconds
from appliance.engines.supervision.supervisor import Supervisor
from appliance.gpu.nvml import NvmlProbe
from appliance.gpu.simulated import BusyMeter, SimulatedGpu, SimulatedGpuProbe, board_power
from appliance.perf import kv_capacity
from appliance.perf.profile import GpuProfile
from appliance.policy.worker_power import ALL_STATES, CPU_VLLM_STATES, PowerState
from appliance.ports import GpuProbe, WorkerEndpoint

log = logging.getLogger(__name__)
__all__ = ["SIM_MAX_MODEL_LEN", "Engines", "start_engines"]
WorkerEventSink = Callable[[WorkerEvent], None]


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
    """Sleep, stop and wake of single workers (`await power.sleep(worker_id, level)`,
    `power.stop(worker_id)`, `power.wake(worker_id)`, each a measured `PowerChange`;
    appliance/engines/supervision/power_control.py): the supervisor's, for vLLM and simulated
    workers. None for external workers, which the appliance never sleeps or stops. Which workers can
    sleep (not only stop) says each handle's `can_sleep`."""
    power_states: frozenset[PowerState] = CPU_VLLM_STATES
    """The states they can be put to (all, with sleep mode: vLLM's `engine.sleep_mode`, and
    every simulated worker)."""
    wake_s: tuple[float, float, float] | None = None
    """Seconds they take to wake from asleep-1, asleep-2 and stopped, when not the GPU
    profile's: simulated workers stretch them by their time scale (`sim_wake_seconds`)."""

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
    return (
        f"{kind.value}:{served_name(settings)}:bs{e.block_size}:{e.hash_algo}"
        f":seed{e.python_hash_seed}"
    )


def start_engines(
    settings: Settings,
    kind: EngineKind,
    feed: KvIndexFeed,
    log_dir: Path,
    on_event: WorkerEventSink | None = None,
) -> contextlib.AbstractAsyncContextManager[Engines]:
    """The engines of `kind`, up until the context ends; then stopped (supervised workers
    drained and terminated, connections closed). `on_event` hears every supervised
    worker's events (none from external workers)."""
    if kind == EngineKind.VLLM:
        return _vllm_engines(settings, feed, log_dir, on_event)
    if kind == EngineKind.SIM:
        return _sim_engines(settings, feed, log_dir, on_event)
    return _external_engines(settings, feed)


@contextlib.asynccontextmanager
async def _vllm_engines(
    settings: Settings, feed: KvIndexFeed, log_dir: Path, on_event: WorkerEventSink | None
) -> AsyncIterator[Engines]:
    e = settings.engine
    if e.kv_host_bytes:  # vLLM's offloading connector, with the CPU build's own copies
        await asyncio.to_thread(check_host_tier, e.python or sys.executable)
    supervisor = await start_vllm_workers(
        e,
        python=e.python or sys.executable,
        log_dir=log_dir,
        gpu_snapshot=NvmlProbe().snapshot(),
        on_event=on_event,
        on_kv_batch=feed.on_batch,
        on_kv_reset=feed.on_reset,
        kv_cache_memory_bytes=e.kv_cache_memory_bytes,
    )
    try:
        states = ALL_STATES if e.sleep_mode else CPU_VLLM_STATES
        yield await _supervised(
            EngineKind.VLLM, supervisor, served_name(settings), e.max_model_len, states
        )
    finally:
        await supervisor.stop(drain_deadline_s=30.0)


@contextlib.asynccontextmanager
async def _sim_engines(
    settings: Settings, feed: KvIndexFeed, log_dir: Path, on_event: WorkerEventSink | None
) -> AsyncIterator[Engines]:
    e = settings.engine
    supervisor = await start_sim_workers(
        e, log_dir=log_dir, on_event=on_event, on_kv_batch=feed.on_batch, on_kv_reset=feed.on_reset
    )
    try:
        engines = await _supervised(
            EngineKind.SIM, supervisor, served_name(settings), e.max_model_len, ALL_STATES
        )
        yield replace(engines, wake_s=sim_wake_seconds(e))
    finally:
        await supervisor.stop(drain_deadline_s=30.0)


async def _supervised(
    kind: EngineKind,
    supervisor: Supervisor,
    name: str,
    configured_len: int | None,
    states: frozenset[PowerState],
) -> Engines:
    """The engines a supervisor runs: its workers, their loads, retention and power (to
    `states`)."""

    async def loads() -> None:
        await asyncio.gather(*(w.refresh_load() for w in supervisor.workers if w.healthy))

    limit = await model_limit(supervisor.workers, name, configured_len)
    return Engines(
        kind, supervisor.workers, name, limit, loads, supervisor.retention, supervisor.power, states
    )


@contextlib.asynccontextmanager
async def _external_engines(settings: Settings, feed: KvIndexFeed) -> AsyncIterator[Engines]:
    """Servers started elsewhere: connected to, never started, slept or stopped."""
    e = settings.engine
    name = served_name(settings)
    external = await connect_external(
        list(e.external_urls),
        list(e.external_kv_event_endpoints),
        model=name,
        on_kv_batch=feed.on_batch,
        on_kv_reset=feed.on_reset,
        keepalive_s=e.external_keepalive_s,
        request_timeout_s=e.request_timeout_s,
    )
    try:
        limit = await model_limit(external.workers, name, e.max_model_len)
        yield Engines(EngineKind.EXTERNAL, external.workers, name, limit, external.refresh)
    finally:
        await external.aclose()


async def model_limit(workers: Sequence[WorkerHandle], name: str, configured: int | None) -> int:
    """The longest prompt + output the API lets through: what the workers report (a vLLM
    started without --max-model-len takes the model's own limit), or the configured limit
    where no worker says (an external server not up yet), else the simulated engine's."""
    reported = await reported_model_len(workers, name)
    if reported is None:
        log.warning(
            "no worker reported its max_model_len; the API assumes %s",
            configured or SIM_MAX_MODEL_LEN,
        )
        return configured or SIM_MAX_MODEL_LEN
    return min(reported, configured or reported)


def simulated_gpu(profile: GpuProfile, block_size: int) -> SimulatedGpu:
    """The GPU each simulated worker stands for, split as the worker splits it: vLLM's
    memory budget (utilisation x HBM) less the KV pool the worker sizes is weights and
    runtime."""
    utilization = kv_capacity.SIM_GPU_MEMORY_UTILIZATION
    total_bytes = profile.memory_bytes or kv_capacity.FALLBACK_HBM_BYTES
    blocks = kv_capacity.default_num_gpu_blocks(profile, block_size, utilization)
    kv_bytes = blocks * block_size * profile.kv_bytes_per_token
    baseline_bytes = max(int(total_bytes * utilization) - kv_bytes, 0)
    idle_w, tdp_w = board_power(profile.gpu)
    return SimulatedGpu(f"{profile.gpu} sim", total_bytes, baseline_bytes, kv_bytes, idle_w, tdp_w)


def gpu_probe(
    kind: EngineKind,
    profile: GpuProfile,
    block_size: int,
    workers: Callable[[], Sequence[WorkerEndpoint]],
    gpu_blocks: Callable[[WorkerId], int] | None = None,
    meter: BusyMeter | None = None,
) -> GpuProbe:
    """NVML; under the simulated engine, the model of the GPUs its workers stand for, their
    KV what the KV index holds there (`gpu_blocks`, per worker id), their utilisation the
    busy share `meter` measures."""
    if kind == EngineKind.SIM:
        resident = (lambda w: gpu_blocks(w) * block_size) if gpu_blocks is not None else None
        return SimulatedGpuProbe(
            simulated_gpu(profile, block_size),
            workers,
            resident_tokens=resident,
            kv_bytes_per_token=profile.kv_bytes_per_token,
            meter=meter,
        )
    return NvmlProbe()
