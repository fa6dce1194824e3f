"""What one probe tick saw of the GPUs and the host: plain values, no NVML types."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class GpuProcess:
    pid: int
    used_bytes: int


@dataclass(frozen=True, slots=True)
class GpuReading:
    index: int
    name: str
    uuid: str
    mem_total_bytes: int
    mem_used_bytes: int
    mem_free_bytes: int
    util: float | None
    """Fraction of time a kernel ran over the last sample period, 0..1; None when unknown."""
    temp_c: float | None
    power_w: float | None
    processes: tuple[GpuProcess, ...] = ()
    kv_bytes: int | None = None
    """Bytes of `mem_used_bytes` that hold KV cache in use; None where the probe cannot tell
    (NVML sees one allocation per process)."""


@dataclass(frozen=True, slots=True)
class HostReading:
    mem_total_bytes: int
    mem_available_bytes: int
    cpu_count: int
    load_1m: float


@dataclass(frozen=True, slots=True)
class GpuSnapshot:
    """One tick: every GPU the probe can see (none is a normal state) and the host."""

    time: float
    driver: str | None
    gpus: tuple[GpuReading, ...]
    host: HostReading | None
    error: str | None = None
    """Why NVML gave nothing, e.g. "NVML not found"; None when it answered."""
