"""A stand-in for libnvidia-ml under the real `pynvml` (nvidia-ml-py).

Only the C library is replaced: every call the appliance makes goes through pynvml's own
Python code (its ctypes structures, buffers, error checks and conversions), and the fake
answers as the library does, in its units: memory in bytes, utilisation in percent, power
in milliwatts, return codes for errors. So a test of the probe checks the probe against what
a real driver hands pynvml, not against values the fake made up in the probe's own terms.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pynvml
import pytest


@dataclass
class FakeDevice:
    name: bytes = b"NVIDIA H200"
    uuid: bytes = b"GPU-5a1c0e2f-0000-4c3b-9d7e-000000000000"
    total: int = 150 << 30
    used: int = 34 << 30
    gpu_percent: int = 11
    memory_percent: int = 3
    temp_c: int = 39
    power_mw: int = 101_459
    processes: list[tuple[int, int | None]] = field(default_factory=list)
    """(pid, bytes used; None: the driver does not know)."""


class _CFunction:
    """A C function as ctypes hands it out: callable, with a settable `restype`."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self._fn = fn
        self.restype: Any = None

    def __call__(self, *args: Any) -> Any:
        return self._fn(*args)


class FakeNvmlLibrary:
    """libnvidia-ml's functions that pynvml calls for the appliance's readings. A name in
    `failing` answers that NVML return code instead."""

    def __init__(self, devices: list[FakeDevice], driver: bytes = b"580.159.04") -> None:
        self.devices = devices
        self.driver = driver
        self.failing: dict[str, int] = {}
        self.calls: list[str] = []

    def __getattr__(self, name: str) -> _CFunction:
        impl = getattr(type(self), f"_{name}", None)
        if impl is None:
            raise AttributeError(name)  # pynvml: NVML_ERROR_FUNCTION_NOT_FOUND

        def call(*args: Any) -> Any:
            self.calls.append(name)
            if name in self.failing:
                return self.failing[name]
            return impl(self, *args)

        return _CFunction(call)

    def _device(self, handle: Any) -> FakeDevice:
        return self.devices[ctypes.cast(handle, ctypes.c_void_p).value - 1]  # type: ignore[operator]

    def _nvmlInitWithFlags(self, flags: int) -> int:
        return pynvml.NVML_SUCCESS

    def _nvmlShutdown(self) -> int:
        return pynvml.NVML_SUCCESS

    def _nvmlErrorString(self, code: int) -> bytes:
        return {
            pynvml.NVML_ERROR_DRIVER_NOT_LOADED: b"Driver Not Loaded",
            pynvml.NVML_ERROR_NOT_SUPPORTED: b"Not Supported",
        }.get(code, b"Unknown Error")

    def _nvmlSystemGetDriverVersion(self, buf: Any, size: Any) -> int:
        buf.value = self.driver
        return pynvml.NVML_SUCCESS

    def _nvmlDeviceGetCount_v2(self, count: Any) -> int:
        count._obj.value = len(self.devices)
        return pynvml.NVML_SUCCESS

    def _nvmlDeviceGetHandleByIndex_v2(self, index: Any, device: Any) -> int:
        if index.value >= len(self.devices):
            return pynvml.NVML_ERROR_INVALID_ARGUMENT
        # An opaque handle, as the library's: here the device's position, plus one.
        ctypes.memmove(
            ctypes.byref(device._obj),
            ctypes.byref(ctypes.c_void_p(index.value + 1)),
            ctypes.sizeof(ctypes.c_void_p),
        )
        return pynvml.NVML_SUCCESS

    def _nvmlDeviceGetName(self, handle: Any, buf: Any, size: Any) -> int:
        buf.value = self._device(handle).name
        return pynvml.NVML_SUCCESS

    def _nvmlDeviceGetUUID(self, handle: Any, buf: Any, size: Any) -> int:
        buf.value = self._device(handle).uuid
        return pynvml.NVML_SUCCESS

    def _nvmlDeviceGetMemoryInfo(self, handle: Any, memory: Any) -> int:
        d = self._device(handle)
        memory._obj.total, memory._obj.used, memory._obj.free = d.total, d.used, d.total - d.used
        return pynvml.NVML_SUCCESS

    def _nvmlDeviceGetUtilizationRates(self, handle: Any, util: Any) -> int:
        d = self._device(handle)
        util._obj.gpu, util._obj.memory = d.gpu_percent, d.memory_percent
        return pynvml.NVML_SUCCESS

    def _nvmlDeviceGetTemperature(self, handle: Any, sensor: Any, temp: Any) -> int:
        temp._obj.value = self._device(handle).temp_c
        return pynvml.NVML_SUCCESS

    def _nvmlDeviceGetPowerUsage(self, handle: Any, milliwatts: Any) -> int:
        milliwatts._obj.value = self._device(handle).power_mw
        return pynvml.NVML_SUCCESS

    def _nvmlDeviceGetComputeRunningProcesses_v3(self, handle: Any, count: Any, procs: Any) -> int:
        running = self._device(handle).processes
        if procs is None:  # the size query
            if not running:
                return pynvml.NVML_SUCCESS
            count._obj.value = len(running)
            return pynvml.NVML_ERROR_INSUFFICIENT_SIZE
        for i, (pid, used) in enumerate(running):
            procs[i].pid = pid
            procs[i].usedGpuMemory = (
                used if used is not None else pynvml.NVML_VALUE_NOT_AVAILABLE_ulonglong.value
            )
        count._obj.value = len(running)
        return pynvml.NVML_SUCCESS


def install(
    monkeypatch: pytest.MonkeyPatch, library: FakeNvmlLibrary, *, loads: bool = True
) -> FakeNvmlLibrary:
    """pynvml bound to `library` for the test, as if libnvidia-ml.so had loaded;
    `loads=False`: the shared library is missing (a host without the NVIDIA driver)."""

    def load() -> None:
        if not loads:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)
        pynvml.nvmlLib = library

    monkeypatch.setattr(pynvml, "_LoadNvmlLibrary", load)
    monkeypatch.setattr(pynvml, "nvmlLib", None)
    monkeypatch.setattr(pynvml, "_nvmlGetFunctionPointer_cache", {})
    return library
