"""The NVML probe over the real pynvml against a stand-in for libnvidia-ml (tests/fake_nvml.py):
every reading in NVML's own units, and every failure mode."""

from __future__ import annotations

import pynvml
import pytest

from appliance.domain.gpu import GpuProcess, GpuReading
from appliance.gpu.fake import FakeProbe
from appliance.gpu.nvml import NvmlProbe
from tests.fake_nvml import FakeDevice, FakeNvmlLibrary, install


def probe_on(monkeypatch: pytest.MonkeyPatch, *devices: FakeDevice) -> FakeNvmlLibrary:
    return install(monkeypatch, FakeNvmlLibrary(list(devices)))


def test_readings_are_converted_from_nvmls_units(monkeypatch: pytest.MonkeyPatch) -> None:
    """NVML answers in percent, milliwatts and bytes, through pynvml's own structures."""
    second = FakeDevice(
        uuid=b"GPU-second",
        used=100 << 30,
        gpu_percent=87,
        power_mw=612_500,
        temp_c=71,
        processes=[(421, 33_812_381_696), (7, None)],
    )
    probe_on(monkeypatch, FakeDevice(), second)
    snap = NvmlProbe().snapshot()
    assert snap.error is None and snap.driver == "580.159.04" and len(snap.gpus) == 2
    g = snap.gpus[1]
    assert (g.index, g.name, g.uuid) == (1, "NVIDIA H200", "GPU-second")
    assert (g.mem_total_bytes, g.mem_used_bytes, g.mem_free_bytes) == (
        150 << 30,
        100 << 30,
        50 << 30,
    )
    assert (g.util, g.temp_c, g.power_w) == (0.87, 71.0, 612.5)
    # A process whose memory the driver cannot tell (NVML_VALUE_NOT_AVAILABLE) counts 0.
    assert g.processes == (GpuProcess(421, 33_812_381_696), GpuProcess(7, 0))
    assert snap.gpus[0].processes == ()  # NVML's "no processes" answer
    assert snap.host is not None and snap.host.mem_total_bytes > 0


def test_a_failing_call_becomes_a_default_not_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    library = probe_on(monkeypatch, FakeDevice(processes=[(1, 1)]))
    for call in (
        "nvmlDeviceGetPowerUsage",
        "nvmlDeviceGetTemperature",
        "nvmlDeviceGetComputeRunningProcesses_v3",
    ):
        library.failing[call] = pynvml.NVML_ERROR_NOT_SUPPORTED
    (g,) = NvmlProbe().snapshot().gpus
    assert g.power_w is None and g.temp_c is None and g.processes == ()
    assert g.mem_used_bytes == 34 << 30 and g.util == 0.11


def test_a_device_whose_handle_fails_is_left_out(monkeypatch: pytest.MonkeyPatch) -> None:
    library = probe_on(monkeypatch, FakeDevice())
    library.failing["nvmlDeviceGetHandleByIndex_v2"] = pynvml.NVML_ERROR_GPU_IS_LOST
    snap = NvmlProbe().snapshot()
    assert snap.gpus == () and snap.error is None and snap.driver == "580.159.04"


def test_no_driver_is_a_normal_state(monkeypatch: pytest.MonkeyPatch) -> None:
    library = FakeNvmlLibrary([FakeDevice()])
    library.failing["nvmlInitWithFlags"] = pynvml.NVML_ERROR_DRIVER_NOT_LOADED
    install(monkeypatch, library)
    snap = NvmlProbe().snapshot()
    assert snap.gpus == () and snap.error == "NVML unavailable: Driver Not Loaded"


def test_no_nvml_library_is_a_normal_state(monkeypatch: pytest.MonkeyPatch) -> None:
    install(monkeypatch, FakeNvmlLibrary([]), loads=False)
    snap = NvmlProbe().snapshot()
    assert snap.gpus == () and snap.error == "NVML unavailable: NVML Shared Library Not Found"


def test_nvml_initialises_once_and_shuts_down(monkeypatch: pytest.MonkeyPatch) -> None:
    library = probe_on(monkeypatch, FakeDevice())
    probe = NvmlProbe()
    probe.snapshot()
    probe.snapshot()
    assert library.calls.count("nvmlInitWithFlags") == 1
    assert library.calls.count("nvmlSystemGetDriverVersion") == 2  # one reading per tick
    probe.close()
    assert library.calls[-1] == "nvmlShutdown"


def test_fake_probe_plays_its_script_then_holds_the_last_tick() -> None:
    a = GpuReading(0, "g", "u", 10, 1, 9, 0.1, 30.0, 50.0)
    b = GpuReading(0, "g", "u", 10, 8, 2, 0.9, 70.0, 300.0)
    probe = FakeProbe([[a], [b]])
    assert [probe.snapshot().gpus for _ in range(3)] == [(a,), (b,), (b,)]
    with pytest.raises(ValueError, match="at least one"):
        FakeProbe([])
