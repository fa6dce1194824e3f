"""What the composition root calls: engine settings in, started workers out.

`start_vllm_workers` finds the vLLM build of the given interpreter (CPU or CUDA), turns the
settings into a launch spec (cores of this process shared out on the CPU build, the
appliance's CUDA_VISIBLE_DEVICES on GPU hosts) and starts a Supervisor;
`start_sim_workers` starts a Supervisor of simulated workers (sim_launch.py); `start_external`
connects to servers listed in the settings. Both return objects whose `.workers` are
WorkerHandles, and both raise ApplianceError subclasses with one-line messages.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import psutil

from appliance.config.settings import EngineSettings
from appliance.domain.gpu import GpuSnapshot
from appliance.domain.worker import WorkerEvent
from appliance.engines.clients.workers import KvBatchSink, KvResetSink
from appliance.engines.external import ExternalEngine, connect_external
from appliance.engines.supervision.launch import default_served_name, spec_from_settings
from appliance.engines.supervision.preflight import (
    check_vllm_version,
    kv_cache_dtype_args,
    probe_vllm,
)
from appliance.engines.supervision.sim_launch import sim_spec
from appliance.engines.supervision.supervisor import Supervisor, SupervisorTimings


def free_memory_bytes() -> int:
    """Host memory free for the workers, read as vLLM's CPU build reads it: the least of
    each memory node's free, file-cache and reclaimable memory (a worker's memory is bound
    to its node), and of what the whole host has available."""
    free = [psutil.virtual_memory().available]
    for meminfo in Path("/sys/devices/system/node").glob("node*/meminfo"):
        fields = {}
        for line in meminfo.read_text().splitlines():
            parts = line.split()  # "Node 0 MemFree:  6265376 kB"
            if len(parts) >= 4 and parts[3].isdigit():
                fields[parts[2].rstrip(":")] = int(parts[3]) * 1024
        if fields.get("MemTotal"):
            free.append(sum(fields.get(k, 0) for k in _NODE_FREE_FIELDS))
    return min(free)


_NODE_FREE_FIELDS = ("MemFree", "Active(file)", "Inactive(file)", "SReclaimable")


async def start_vllm_workers(
    engine: EngineSettings,
    *,
    python: str,
    log_dir: Path,
    gpu_snapshot: GpuSnapshot | None,
    on_event: Callable[[WorkerEvent], None] | None = None,
    on_kv_batch: KvBatchSink | None = None,
    on_kv_reset: KvResetSink | None = None,
    kv_cache_memory_bytes: int | None = None,
    timings: SupervisorTimings | None = None,
) -> Supervisor:
    """Started vLLM workers; stop them with `await supervisor.stop()`."""
    install = await asyncio.to_thread(probe_vllm, python)
    check_vllm_version(install)
    timings = replace(timings or SupervisorTimings(), request_timeout_s=engine.request_timeout_s)
    spec = spec_from_settings(
        engine,
        python=python,
        device=install.device,
        cpu_ids=sorted(os.sched_getaffinity(0)),
        base_env=os.environ,
        kv_cache_memory_bytes=kv_cache_memory_bytes,
        free_memory_bytes=free_memory_bytes(),
    )
    dtype_args = kv_cache_dtype_args(engine.kv_cache_dtype, install.device)
    spec = replace(spec, extra_args=(*dtype_args, *spec.extra_args))
    supervisor = Supervisor(
        spec,
        log_dir=log_dir,
        on_event=on_event,
        on_kv_batch=on_kv_batch,
        on_kv_reset=on_kv_reset,
        timings=timings,
        gpu_snapshot=gpu_snapshot,
    )
    await supervisor.start()
    return supervisor


async def start_sim_workers(
    engine: EngineSettings,
    *,
    log_dir: Path,
    on_event: Callable[[WorkerEvent], None] | None = None,
    on_kv_batch: KvBatchSink | None = None,
    on_kv_reset: KvResetSink | None = None,
    timings: SupervisorTimings | None = None,
) -> Supervisor:
    """Started simulated workers, supervised as vLLM's; stop them with `supervisor.stop()`."""
    timings = replace(timings or SupervisorTimings(), request_timeout_s=engine.request_timeout_s)
    supervisor = Supervisor(
        sim_spec(engine),
        log_dir=log_dir,
        on_event=on_event,
        on_kv_batch=on_kv_batch,
        on_kv_reset=on_kv_reset,
        timings=timings,
    )
    await supervisor.start()
    return supervisor


async def start_external(
    engine: EngineSettings,
    *,
    on_kv_batch: KvBatchSink | None = None,
    on_kv_reset: KvResetSink | None = None,
) -> ExternalEngine:
    """Handles on `engine.external_urls`; close them with `await engine.aclose()`."""
    model = engine.served_model_name
    if model is None and engine.model:
        model = default_served_name(engine.model)
    return await connect_external(
        engine.external_urls,
        engine.external_kv_event_endpoints,
        model=model,
        on_kv_batch=on_kv_batch,
        on_kv_reset=on_kv_reset,
        keepalive_s=engine.external_keepalive_s,
        request_timeout_s=engine.request_timeout_s,
    )
