"""The NVML probe: every NVML call of the appliance goes through `_call` in this module.

NVML is initialised lazily on the first snapshot and any NVML error becomes a default value,
so a host without an NVIDIA driver is a normal state (no GPUs, `error` says why), never an
exception. One `snapshot()` per tick reads everything the console and the reaper need.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from appliance.domain.gpu import GpuProcess, GpuReading, GpuSnapshot
from appliance.gpu.host import read_host

T = TypeVar("T")


class NvmlProbe:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._nvml: Any = None
        self._error: str | None = None
        self._initialised = False

    def _init(self) -> None:
        if self._initialised:
            return
        self._initialised = True
        try:
            import pynvml  # nvidia-ml-py

            pynvml.nvmlInit()
            self._nvml = pynvml
        except Exception as exc:  # ImportError, NVMLError_LibraryNotFound, driver errors
            self._error = f"NVML unavailable: {exc or type(exc).__name__}"

    def _call(self, fn: Callable[..., T], *args: Any, default: T) -> T:
        try:
            return fn(*args)
        except Exception:
            return default

    def snapshot(self) -> GpuSnapshot:
        with self._lock:
            self._init()
            nv = self._nvml
            if nv is None:
                return GpuSnapshot(time.time(), None, (), read_host(), self._error)
            driver = self._call(nv.nvmlSystemGetDriverVersion, default=None)
            count = self._call(nv.nvmlDeviceGetCount, default=0)
            gpus = tuple(r for i in range(count) if (r := self._read(i)) is not None)
            return GpuSnapshot(time.time(), _text(driver), gpus, read_host(), None)

    def _read(self, index: int) -> GpuReading | None:
        nv = self._nvml
        handle = self._call(nv.nvmlDeviceGetHandleByIndex, index, default=None)
        if handle is None:
            return None
        mem = self._call(nv.nvmlDeviceGetMemoryInfo, handle, default=None)
        util = self._call(nv.nvmlDeviceGetUtilizationRates, handle, default=None)
        temp = self._call(nv.nvmlDeviceGetTemperature, handle, 0, default=None)
        power_mw = self._call(nv.nvmlDeviceGetPowerUsage, handle, default=None)
        procs = self._call(nv.nvmlDeviceGetComputeRunningProcesses, handle, default=[])
        return GpuReading(
            index=index,
            name=_text(self._call(nv.nvmlDeviceGetName, handle, default="unknown")) or "unknown",
            uuid=_text(self._call(nv.nvmlDeviceGetUUID, handle, default="")) or "",
            mem_total_bytes=int(mem.total) if mem else 0,
            mem_used_bytes=int(mem.used) if mem else 0,
            mem_free_bytes=int(mem.free) if mem else 0,
            util=util.gpu / 100.0 if util is not None else None,
            temp_c=float(temp) if temp is not None else None,
            power_w=power_mw / 1000.0 if power_mw is not None else None,
            processes=tuple(GpuProcess(int(p.pid), int(p.usedGpuMemory or 0)) for p in procs or ()),
        )

    def close(self) -> None:
        with self._lock:
            if self._nvml is not None:
                self._call(self._nvml.nvmlShutdown, default=None)
                self._nvml = None
            self._initialised = False


def _text(value: object) -> str | None:
    if value is None:
        return None
    return value.decode() if isinstance(value, bytes) else str(value)
