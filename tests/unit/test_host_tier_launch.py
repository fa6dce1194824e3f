"""What a vLLM worker's command line carries for its host tier (`engine.kv_host_bytes`):
vLLM's OffloadingConnector composed with the retention connector, the CPU build's own
offloading spec where vLLM's copies refuse the device, and the check that the installed
vLLM has the modules the tier is built on."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from appliance.config.settings import EngineSettings
from appliance.domain.errors import ConfigError
from appliance.engines.offload.plan import HostTierPlan, transfer_config
from appliance.engines.offload.support import NEEDED, check_host_tier, missing_host_tier_support
from appliance.engines.supervision.launch import Device, plan_workers, spec_from_settings

HOST = 64 * 2**20


def kv_transfer_config(device: Device, **engine: object) -> dict[str, object] | None:
    settings = EngineSettings(model="/m/tiny", kv_retention_base_port=6000, **engine)
    argv = plan_workers(spec_from_settings(settings, python="/p", device=device), {})[0].argv
    if "--kv-transfer-config" not in argv:
        return None
    config: dict[str, object] = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    return config


def test_the_cpu_build_composes_retention_with_its_own_offloading_spec() -> None:
    config = kv_transfer_config(Device.CPU, kv_host_bytes=HOST)
    assert config is not None
    assert config["kv_connector"] == "HostTierConnector"
    assert config["kv_connector_module_path"] == "appliance.engines.offload.connector"
    retention, offloading = config["kv_connector_extra_config"]["connectors"]  # type: ignore[index]
    assert retention["kv_connector"] == "RetentionConnector"  # first: room before lookups
    assert retention["kv_connector_extra_config"]["control_endpoint"] == "tcp://127.0.0.1:6000"
    assert offloading == {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "cpu_bytes_to_use": HOST,
            "spec_name": "HostTierSpec",
            "spec_module_path": "appliance.engines.offload.cpu_spec",
        },
    }


def test_cuda_takes_vllms_own_cpu_offloading_and_no_host_bytes_no_tier() -> None:
    config = kv_transfer_config(Device.CUDA, kv_host_bytes=HOST)
    assert config is not None
    offloading = config["kv_connector_extra_config"]["connectors"][1]  # type: ignore[index]
    assert offloading["kv_connector_extra_config"] == {"cpu_bytes_to_use": HOST}
    plain = kv_transfer_config(Device.CUDA)
    assert plain is not None and plain["kv_connector"] == "RetentionConnector"
    alone = kv_transfer_config(Device.CPU, kv_host_bytes=HOST, kv_retention=False)
    assert alone == HostTierPlan(HOST, native_copies=False).offloading_config()
    assert transfer_config(None, None) is None


def test_simulated_workers_model_their_host_tier_themselves() -> None:
    settings = EngineSettings(model="/m/tiny", kv_host_bytes=HOST)
    assert spec_from_settings(settings, python="/p", device=Device.SIM).host_tier is None


def test_a_vllm_without_the_offloading_modules_is_refused_in_one_line(tmp_path: Path) -> None:
    assert missing_host_tier_support(tmp_path) == [f"vllm/{p}" for p in NEEDED]
    for path in NEEDED[1:]:
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text("")
    assert missing_host_tier_support(tmp_path) == [f"vllm/{NEEDED[0]}"]
    (tmp_path / NEEDED[0]).write_text("")
    assert missing_host_tier_support(tmp_path) == []
    with pytest.raises(ConfigError, match="cannot ask /nonexistent/python"):
        check_host_tier("/nonexistent/python")
