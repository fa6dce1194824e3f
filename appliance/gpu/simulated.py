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
figure the console shows beside theirs. Utilisation follows the worker's running requests,
running / (running + 1): idle at 0, half busy with one sequence, near 1 with many. The
temperature and power are fixed placeholders. A worker that is down holds nothing.

`DRIVER` says in every snapshot that these readings are simulated; the state shows it as
the GPUs' driver so that no operator mistakes them for a real GPU's.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from appliance.domain.gpu import GpuReading, GpuSnapshot
from appliance.domain.records import WorkerId
from appliance.gpu.host import read_host
from appliance.ports import WorkerEndpoint

DRIVER = "simulated (the sim engine's GPU model; not measured)"
PLACEHOLDER_TEMP_C = 40.0
PLACEHOLDER_POWER_W = 100.0


@dataclass(frozen=True, slots=True)
class SimulatedGpu:
    """One simulated worker's GPU: its name, its memory and how that memory is split."""

    name: str
    mem_total_bytes: int
    baseline_bytes: int
    """Held from the worker's start whatever the load: weights and runtime."""
    kv_capacity_bytes: int
    """The worker's KV pool: `kv_cache_usage_perc` is a fraction of it."""

    def __post_init__(self) -> None:
        if self.baseline_bytes + self.kv_capacity_bytes > self.mem_total_bytes:
            raise ValueError(
                f"simulated GPU {self.name}: baseline {self.baseline_bytes} B + KV pool "
                f"{self.kv_capacity_bytes} B exceed its {self.mem_total_bytes} B"
            )


class SimulatedGpuProbe:
    """One reading per simulated worker, in the workers' order: GPU i is worker i, or the
    first GPU id the worker was given (`engine.gpus`)."""

    def __init__(
        self,
        gpu: SimulatedGpu,
        workers: Callable[[], Sequence[WorkerEndpoint]],
        *,
        resident_tokens: Callable[[WorkerId], int] | None = None,
        kv_bytes_per_token: int = 0,
    ) -> None:
        self.gpu = gpu
        self._workers = workers
        self._resident = resident_tokens if kv_bytes_per_token > 0 else None
        self._per_token = kv_bytes_per_token

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
        return GpuReading(
            index=index,
            name=gpu.name,
            uuid=f"SIM-{worker.id}",
            mem_total_bytes=gpu.mem_total_bytes,
            mem_used_bytes=used_bytes,
            mem_free_bytes=gpu.mem_total_bytes - used_bytes,
            util=running / (running + 1),
            temp_c=PLACEHOLDER_TEMP_C if up else None,
            power_w=PLACEHOLDER_POWER_W if up else None,
            kv_bytes=kv_bytes,
        )

    def close(self) -> None:
        pass


def _first(gpus: Sequence[int], default: int) -> int:
    return gpus[0] if gpus else default
