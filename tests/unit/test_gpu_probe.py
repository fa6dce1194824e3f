"""The NVML probe against a scripted NVML module: every reading, and every failure mode."""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass

import pytest

from appliance.domain.gpu import GpuProcess, GpuReading
from appliance.gpu.fake import FakeProbe
from appliance.gpu.nvml import NvmlProbe


class NVMLError(Exception):
    pass


@dataclass
class Mem:
    total: int
    used: int
    free: int


@dataclass
class Util:
    gpu: int
    memory: int


@dataclass
class Proc:
    pid: int
    usedGpuMemory: int | None


def fake_nvml(devices: int, *, broken: set[str] = frozenset(), init_fails: bool = False):  # type: ignore[no-untyped-def]
    m = types.ModuleType("pynvml")
    calls: list[str] = []

    def fn(name: str, value):  # type: ignore[no-untyped-def]
        def call(*args):  # type: ignore[no-untyped-def]
            calls.append(name)
            if name in broken:
                raise NVMLError(name)
            return value(*args) if callable(value) else value

        return call

    def init() -> None:
        if init_fails:
            raise NVMLError("Driver Not Loaded")

    m.nvmlInit = init  # type: ignore[attr-defined]
    m.nvmlShutdown = fn("shutdown", None)  # type: ignore[attr-defined]
    m.nvmlSystemGetDriverVersion = fn("driver", b"580.159.04")  # type: ignore[attr-defined]
    m.nvmlDeviceGetCount = fn("count", devices)  # type: ignore[attr-defined]
    m.nvmlDeviceGetHandleByIndex = fn("handle", lambda i: f"h{i}")  # type: ignore[attr-defined]
    m.nvmlDeviceGetName = fn("name", "NVIDIA H200")  # type: ignore[attr-defined]
    m.nvmlDeviceGetUUID = fn("uuid", lambda h: f"GPU-{h}")  # type: ignore[attr-defined]
    m.nvmlDeviceGetMemoryInfo = fn("mem", Mem(150 << 30, 34 << 30, 116 << 30))  # type: ignore[attr-defined]
    m.nvmlDeviceGetUtilizationRates = fn("util", Util(11, 3))  # type: ignore[attr-defined]
    m.nvmlDeviceGetTemperature = fn("temp", 39)  # type: ignore[attr-defined]
    m.nvmlDeviceGetPowerUsage = fn("power", 101459)  # type: ignore[attr-defined]
    m.nvmlDeviceGetComputeRunningProcesses = fn(  # type: ignore[attr-defined]
        "procs", [Proc(421, 33812381696), Proc(7, None)]
    )
    m.calls = calls  # type: ignore[attr-defined]
    return m


def test_readings_from_nvml(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml(2))
    snap = NvmlProbe().snapshot()
    assert snap.error is None and snap.driver == "580.159.04" and len(snap.gpus) == 2
    g = snap.gpus[1]
    assert (g.index, g.name, g.uuid) == (1, "NVIDIA H200", "GPU-h1")
    assert (g.mem_total_bytes, g.mem_used_bytes, g.mem_free_bytes) == (
        150 << 30,
        34 << 30,
        116 << 30,
    )
    assert (g.util, g.temp_c, g.power_w) == (0.11, 39.0, 101.459)
    assert g.processes == (GpuProcess(421, 33812381696), GpuProcess(7, 0))
    assert snap.host is not None and snap.host.mem_total_bytes > 0


def test_a_failing_call_becomes_a_default_not_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml(1, broken={"power", "temp", "procs"}))
    (g,) = NvmlProbe().snapshot().gpus
    assert g.power_w is None and g.temp_c is None and g.processes == ()
    assert g.mem_used_bytes == 34 << 30


def test_no_driver_is_a_normal_state(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml(1, init_fails=True))
    snap = NvmlProbe().snapshot()
    assert snap.gpus == () and snap.error is not None and "Driver Not Loaded" in snap.error


def test_nvml_initialises_once_and_shuts_down(monkeypatch: pytest.MonkeyPatch) -> None:
    nvml = fake_nvml(1)
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    probe = NvmlProbe()
    probe.snapshot()
    probe.snapshot()
    assert nvml.calls.count("driver") == 2  # one reading per tick
    probe.close()
    assert nvml.calls[-1] == "shutdown"


def test_fake_probe_plays_its_script_then_holds_the_last_tick() -> None:
    a = GpuReading(0, "g", "u", 10, 1, 9, 0.1, 30.0, 50.0)
    b = GpuReading(0, "g", "u", 10, 8, 2, 0.9, 70.0, 300.0)
    probe = FakeProbe([[a], [b]])
    assert [probe.snapshot().gpus for _ in range(3)] == [(a,), (b,), (b,)]
    with pytest.raises(ValueError, match="at least one"):
        FakeProbe([])
