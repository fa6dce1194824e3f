"""The GPUs of the simulated engine: one modelled GPU per simulated worker, never measured.

Model of the world: each simulated worker stands for one vLLM server on its own GPU of the
profile's kind (the bundled H200 unless configured otherwise). That GPU's memory is
`mem_total_bytes`; from the worker's start it holds `baseline_bytes` (the weights and the
runtime: what vLLM's memory budget keeps besides the KV pool) whatever the load, plus the KV
blocks its running requests use: the worker's own `kv_cache_usage_perc` times its KV pool,
`kv_capacity_bytes` (blocks vLLM keeps for the prefix cache but no request uses count as
free, as vLLM counts them). With `resident_tokens` (the KV index's count per worker) its KV
is instead every block that holds anything now, running requests', held and only cached
alike, at the profile's bytes per token: what the sessions' resident KV adds up to, the
figure the console shows beside theirs. A worker that is down holds nothing and reads no
temperature or power (its GPU cools meanwhile).

Utilisation is the worker's busy share: of its awake seconds since the previous reading,
the share with a turn in flight, as the router's GPU meter counts them (`meter`, the
figures the state's `gpu_busy_s` / `gpu_idle_s` show). Before the meter is attached, and at
the first reading, it follows the running requests instead: running / (running + 1).

Power is linear in utilisation between the board's idle draw and its TDP (`board_power`):
  - TDP: 700 W for the H200 SXM and the H100 SXM ("up to 700 W, configurable": NVIDIA's
    H200 and H100 Tensor Core GPU datasheets); another GPU is modelled with the H200's.
  - idle: 100 W, an estimate, not a datasheet figure: what nvidia-smi shows of an idle
    H100/H200 SXM board with its memory clocked up is about 70-120 W.
Temperature follows power with a lag: its steady state is linear in power, from 40 C at
idle to 75 C at TDP (estimates: an air-cooled SXM board idles in the 30s-40s C and runs in
the 60s-70s C under sustained load, below NVIDIA's slowdown threshold of about 90 C), and
the reading approaches it as a first-order system with a 30 s time constant (an estimate of
the heat sink's thermal mass), so a burst warms the GPU slowly and it cools slowly after.

`DRIVER` says in every snapshot that these readings are simulated; the state shows it as
the GPUs' driver so that no operator mistakes them for a real GPU's.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from appliance.domain.gpu import GpuReading, GpuSnapshot
from appliance.domain.records import WorkerId
from appliance.gpu.host import read_host
from appliance.ports import WorkerEndpoint

DRIVER = "simulated (the sim engine's GPU model; not measured)"
TDP_W = {"H200": 700.0, "H100": 700.0}
"""Board power limits by GPU (datasheets: see the module docstring)."""
IDLE_POWER_W = 100.0
IDLE_TEMP_C = 40.0
FULL_LOAD_TEMP_C = 75.0
THERMAL_TIME_CONSTANT_S = 30.0


class AwakeBusySeconds(Protocol):
    @property
    def awake_s(self) -> float: ...

    @property
    def busy_s(self) -> float: ...


class BusyMeter(Protocol):
    """The router's GPU meter (services/workers/gpu_meter.py): a worker's awake and busy seconds
    since the appliance started."""

    def reading(self, worker: WorkerId) -> AwakeBusySeconds: ...


def board_power(gpu_name: str) -> tuple[float, float]:
    """(idle W, TDP W) of a GPU by its name ("NVIDIA H200"); an unknown one: the H200's."""
    tdp = next((w for kind, w in TDP_W.items() if kind in gpu_name), TDP_W["H200"])
    return IDLE_POWER_W, tdp


@dataclass(frozen=True, slots=True)
class SimulatedGpu:
    """One simulated worker's GPU: its name, its memory and how that memory is split, and
    its power draw from idle to full load."""

    name: str
    mem_total_bytes: int
    baseline_bytes: int
    """Held from the worker's start whatever the load: weights and runtime."""
    kv_capacity_bytes: int
    """The worker's KV pool: `kv_cache_usage_perc` is a fraction of it."""
    idle_w: float = IDLE_POWER_W
    tdp_w: float = TDP_W["H200"]

    def __post_init__(self) -> None:
        if self.baseline_bytes + self.kv_capacity_bytes > self.mem_total_bytes:
            raise ValueError(
                f"simulated GPU {self.name}: baseline {self.baseline_bytes} B + KV pool "
                f"{self.kv_capacity_bytes} B exceed its {self.mem_total_bytes} B"
            )

    def power_w(self, util: float) -> float:
        """Its draw at a utilisation 0..1: linear from idle to TDP."""
        return self.idle_w + (self.tdp_w - self.idle_w) * min(max(util, 0.0), 1.0)

    def steady_temp_c(self, power_w: float) -> float:
        """The temperature it settles at drawing `power_w` for long."""
        span = self.tdp_w - self.idle_w
        load = (power_w - self.idle_w) / span if span > 0 else 0.0
        return IDLE_TEMP_C + (FULL_LOAD_TEMP_C - IDLE_TEMP_C) * min(max(load, 0.0), 1.0)


@dataclass(slots=True)
class _Heat:
    """One GPU's state between readings: when it was read, its temperature then, and its
    worker's (awake, busy) seconds then."""

    at: float
    temp_c: float
    busy: tuple[float, float] | None = None


class SimulatedGpuProbe:
    """One reading per simulated worker, in the workers' order: GPU i is worker i, or the
    first GPU id the worker was given (`engine.gpus`). `clock` (seconds) paces the lag of
    the temperature; `meter`, the router's GPU meter, gives the utilisation as its busy share
    (None: the share of requests running)."""

    def __init__(
        self,
        gpu: SimulatedGpu,
        workers: Callable[[], Sequence[WorkerEndpoint]],
        *,
        resident_tokens: Callable[[WorkerId], int] | None = None,
        kv_bytes_per_token: int = 0,
        meter: BusyMeter | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.gpu = gpu
        self._workers = workers
        self._resident = resident_tokens if kv_bytes_per_token > 0 else None
        self._per_token = kv_bytes_per_token
        self.meter = meter
        self._clock = clock
        self._heat: dict[WorkerId, _Heat] = {}

    def snapshot(self) -> GpuSnapshot:
        readings = tuple(
            self.reading(_first(getattr(w, "gpus", ()), i), w)
            for i, w in enumerate(self._workers())
        )
        return GpuSnapshot(time.time(), DRIVER, readings, read_host(), None)

    def reading(self, index: int, worker: WorkerEndpoint) -> GpuReading:
        gpu = self.gpu
        up = worker.healthy
        load = worker.load if up else None
        kv_bytes = running = 0
        if load is not None:
            fraction = min(max(load.kv_cache_usage_perc, 0.0), 1.0)
            kv_bytes = round(fraction * gpu.kv_capacity_bytes)
            running = max(load.running, 0)
        if up and self._resident is not None:
            resident = self._resident(worker.id) * self._per_token
            kv_bytes = min(resident, gpu.kv_capacity_bytes)
        used_bytes = gpu.baseline_bytes + kv_bytes if up else 0
        util = self._util(worker.id, running) if up else 0.0
        power_w = gpu.power_w(util)
        temp_c = self._warm(worker.id, power_w)
        return GpuReading(
            index=index,
            name=gpu.name,
            uuid=f"SIM-{worker.id}",
            mem_total_bytes=gpu.mem_total_bytes,
            mem_used_bytes=used_bytes,
            mem_free_bytes=gpu.mem_total_bytes - used_bytes,
            util=util,
            temp_c=round(temp_c, 1) if up else None,
            power_w=round(power_w, 1) if up else None,
            kv_bytes=kv_bytes,
        )

    def _util(self, worker: WorkerId, running: int) -> float:
        """The busy share since the previous reading (the module docstring)."""
        by_requests = running / (running + 1)
        heat = self._heat.get(worker)
        if self.meter is None:
            return by_requests
        seconds = self.meter.reading(worker)
        awake, busy = now = seconds.awake_s, seconds.busy_s
        before = heat.busy if heat is not None else None
        if heat is not None:
            heat.busy = now
        else:
            self._heat[worker] = _Heat(self._clock(), IDLE_TEMP_C, now)
        if before is None or awake - before[0] <= 0:
            return by_requests
        return min(max((busy - before[1]) / (awake - before[0]), 0.0), 1.0)

    def _warm(self, worker: WorkerId, power_w: float) -> float:
        """Its temperature now: a step of the first-order lag toward the steady state."""
        now = self._clock()
        heat = self._heat.setdefault(worker, _Heat(now, IDLE_TEMP_C))
        target = self.gpu.steady_temp_c(power_w)
        decay = math.exp(-max(now - heat.at, 0.0) / THERMAL_TIME_CONSTANT_S)
        heat.temp_c = target + (heat.temp_c - target) * decay
        heat.at = now
        return heat.temp_c

    def close(self) -> None:
        pass


def _first(gpus: Sequence[int], default: int) -> int:
    return gpus[0] if gpus else default
