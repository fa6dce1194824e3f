"""The simulated engine's GPUs: one modelled reading per worker, from the worker's own load,
sized from the GPU profile, and said to be simulated."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from appliance.config.settings import EngineKind
from appliance.domain.records import WorkerId
from appliance.domain.worker import LoadSnapshot
from appliance.gpu.nvml import NvmlProbe
from appliance.gpu.simulated import (
    DRIVER,
    FULL_LOAD_TEMP_C,
    IDLE_TEMP_C,
    SimulatedGpu,
    SimulatedGpuProbe,
)
from appliance.perf.profile import bundled_profile
from appliance.services.workers.gpu_meter import GpuTime
from appliance.start.engine_start import gpu_probe, simulated_gpu

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


@dataclass
class Meter:
    """The router's GPU meter as the probe reads it: awake and busy seconds per worker."""

    seconds: dict[str, tuple[float, float]]

    def reading(self, worker: WorkerId) -> GpuTime:
        awake, busy = self.seconds[worker]
        return GpuTime(awake_s=awake, busy_s=busy)


def test_power_and_temperature_follow_the_busy_share_with_a_lag() -> None:
    workers = [Worker(WorkerId("w0"), load=load(0.1, 1)), Worker(WorkerId("w1"), load=load(0, 0))]
    now = [0.0]
    meter = Meter({"w0": (0.0, 0.0), "w1": (0.0, 0.0)})
    probe = SimulatedGpuProbe(GPU, lambda: workers, meter=meter, clock=lambda: now[0])
    first = probe.snapshot().gpus  # no busy share yet: w0 runs one request, half busy
    assert [(g.temp_c, g.power_w) for g in first] == [(IDLE_TEMP_C, 400.0), (IDLE_TEMP_C, 100.0)]
    temps = []
    for step in range(1, 241):  # two minutes, a reading each half second
        now[0] = step * 0.5
        meter.seconds = {"w0": (now[0], now[0]), "w1": (now[0], 0.0)}  # w0 busy, w1 idle
        busy, idle = probe.snapshot().gpus
        temps.append(busy.temp_c)
        assert (busy.util, busy.power_w) == (1.0, GPU.tdp_w) and idle.util == 0.0
        assert (idle.power_w, idle.temp_c) == (GPU.idle_w, IDLE_TEMP_C)
    assert temps == sorted(temps) and temps[0] < IDLE_TEMP_C + 1  # no jump: a lag
    after_30s = temps[59]
    assert after_30s == pytest.approx(IDLE_TEMP_C + (FULL_LOAD_TEMP_C - IDLE_TEMP_C) * 0.632, 0.01)
    assert temps[-1] == pytest.approx(FULL_LOAD_TEMP_C, abs=1.0)
    half = {"w0": (now[0] + 10.0, now[0] + 5.0), "w1": (now[0] + 10.0, 0.0)}
    meter.seconds, now[0] = half, now[0] + 10.0  # half busy for ten seconds: it cools some
    cooling = probe.snapshot().gpus[0]
    assert cooling.util == 0.5 and cooling.power_w == 400.0
    assert GPU.steady_temp_c(400.0) < cooling.temp_c < temps[-1]  # type: ignore[operator]


def test_a_down_worker_reads_no_power_or_temperature_and_its_gpu_cools() -> None:
    worker = Worker(WorkerId("w0"), load=load(0.1, 3))
    now = [0.0]
    probe = SimulatedGpuProbe(GPU, lambda: [worker], clock=lambda: now[0])
    for step in range(1, 200):
        now[0] = step * 1.0
        hot = probe.snapshot().gpus[0].temp_c
    assert hot is not None and hot > 60
    worker.healthy = False
    now[0] += 300.0
    down = probe.snapshot().gpus[0]
    assert (down.temp_c, down.power_w, down.util) == (None, None, 0.0)
    worker.healthy = True
    now[0] += 0.5
    assert probe.snapshot().gpus[0].temp_c == pytest.approx(IDLE_TEMP_C, abs=0.5)


def test_the_profiles_gpu_draws_from_idle_to_its_tdp() -> None:
    gpu = simulated_gpu(bundled_profile(), block_size=32)
    assert "H200" in gpu.name and (gpu.idle_w, gpu.tdp_w) == (100.0, 700.0)
    assert (gpu.power_w(0.0), gpu.power_w(1.0), gpu.power_w(2.0)) == (100.0, 700.0, 700.0)
    assert (gpu.steady_temp_c(100.0), gpu.steady_temp_c(700.0)) == (40.0, 75.0)
