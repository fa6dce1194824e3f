"""The simulated engine's GPUs: one modelled reading per worker, from the worker's own load,
sized from the GPU profile, and said to be simulated."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from appliance.daemon import gpu_probe, simulated_gpu
from appliance.domain.records import WorkerId
from appliance.domain.worker import LoadSnapshot
from appliance.gpu.nvml import NvmlProbe
from appliance.gpu.simulated import DRIVER, SimulatedGpu, SimulatedGpuProbe
from appliance.perf.profile import bundled_profile
from appliance.settings import EngineKind

GPU = SimulatedGpu(
    "NVIDIA H200 sim", mem_total_bytes=1000, baseline_bytes=200, kv_capacity_bytes=600
)


@dataclass
class Worker:
    id: WorkerId
    healthy: bool = True
    draining: bool = False
    load: LoadSnapshot | None = None
    client: object = None


def load(kv: float, running: int) -> LoadSnapshot:
    return LoadSnapshot(time=0.0, running=running, waiting=0, kv_cache_usage_perc=kv)


def test_one_reading_per_worker_from_its_kv_use_and_running_requests() -> None:
    workers = [
        Worker(WorkerId("w0"), load=load(0.5, 3)),
        Worker(WorkerId("w1"), load=load(0.0, 0)),
    ]
    snap = SimulatedGpuProbe(GPU, lambda: workers).snapshot()
    assert snap.driver == DRIVER and snap.driver.startswith("simulated")
    w0, w1 = snap.gpus
    assert (w0.index, w0.uuid, w0.name) == (0, "SIM-w0", "NVIDIA H200 sim")
    assert (w0.mem_total_bytes, w0.kv_bytes, w0.mem_used_bytes, w0.mem_free_bytes) == (
        1000,
        300,
        500,
        500,
    )
    assert w0.util == 0.75
    assert (w1.kv_bytes, w1.mem_used_bytes, w1.util) == (0, 200, 0.0)


def test_with_the_kv_index_its_kv_is_every_resident_block_cached_ones_too() -> None:
    workers = [Worker(WorkerId("w0"), load=load(0.0, 0)), Worker(WorkerId("w1"), load=load(0.9, 1))]
    resident = {"w0": 25, "w1": 10_000}  # tokens the index holds on each worker's GPU
    probe = SimulatedGpuProbe(
        GPU, lambda: workers, resident_tokens=lambda w: resident[w], kv_bytes_per_token=4
    )
    w0, w1 = probe.snapshot().gpus
    assert (w0.kv_bytes, w0.mem_used_bytes) == (100, 300)  # vLLM's usage says 0: all cached
    assert w1.kv_bytes == 600  # never more than the pool
    resident_ids = gpu_probe(EngineKind.SIM, bundled_profile(), 32, lambda: workers, lambda w: 2)
    assert isinstance(resident_ids, SimulatedGpuProbe)
    per_token = bundled_profile().kv_bytes_per_token
    assert resident_ids.snapshot().gpus[0].kv_bytes == 2 * 32 * per_token


def test_the_readings_follow_the_load() -> None:
    worker = Worker(WorkerId("w0"), load=load(0.1, 1))
    probe = SimulatedGpuProbe(GPU, lambda: [worker])
    before = probe.snapshot().gpus[0]
    worker.load = load(0.9, 9)
    after = probe.snapshot().gpus[0]
    assert before.mem_used_bytes == 260 and after.mem_used_bytes == 740
    assert before.util is not None and after.util is not None and after.util > before.util


@pytest.mark.parametrize(
    ("worker", "used", "kv"),
    [
        (Worker(WorkerId("w0"), healthy=False, load=load(0.5, 2)), 0, 0),
        (Worker(WorkerId("w0"), load=None), 200, 0),
        (Worker(WorkerId("w0"), load=load(1.7, 1)), 800, 600),
    ],
    ids=["down-holds-nothing", "no-reading-yet-holds-the-baseline", "usage-clipped-to-the-pool"],
)
def test_edges(worker: Worker, used: int, kv: int) -> None:
    reading = SimulatedGpuProbe(GPU, lambda: [worker]).snapshot().gpus[0]
    assert (reading.mem_used_bytes, reading.kv_bytes) == (used, kv)
    assert reading.mem_free_bytes == 1000 - used


def test_a_gpu_that_cannot_hold_its_split_is_refused() -> None:
    with pytest.raises(ValueError, match="exceed"):
        SimulatedGpu("g", mem_total_bytes=100, baseline_bytes=60, kv_capacity_bytes=50)


def test_the_gpu_is_the_profiles_split_as_the_simulated_worker_splits_it() -> None:
    profile = bundled_profile()
    assert profile.memory_bytes is not None and profile.model.params is not None
    gpu = simulated_gpu(profile, block_size=32)
    assert gpu.mem_total_bytes == profile.memory_bytes
    assert gpu.name == f"{profile.gpu} sim"
    assert gpu.baseline_bytes >= 2 * profile.model.params  # bf16 weights at least
    assert gpu.kv_capacity_bytes % (32 * profile.kv_bytes_per_token) == 0
    assert gpu.baseline_bytes + gpu.kv_capacity_bytes <= profile.memory_bytes


def test_the_sim_engine_gets_the_simulated_probe_and_others_nvml() -> None:
    profile = bundled_profile()
    assert isinstance(gpu_probe(EngineKind.SIM, profile, 32, lambda: []), SimulatedGpuProbe)
    for kind in (EngineKind.VLLM, EngineKind.EXTERNAL):
        assert isinstance(gpu_probe(kind, profile, 32, lambda: []), NvmlProbe)
