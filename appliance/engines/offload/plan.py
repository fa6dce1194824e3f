"""What a vLLM worker's `--kv-transfer-config` says when it has a host tier
(`engine.kv_host_bytes`): vLLM's OffloadingConnector with that many bytes of host memory,
composed with the retention connector where that is on (`connector.HostTierConnector`, a
MultiConnector), alone where it is off. Stdlib only: the appliance writes it, vLLM reads it.

On CUDA the tier is vLLM's own (`CPUOffloadingSpec`, its default spec); on the CPU build,
whose KV already lives in host memory and where vLLM's own copies refuse to run, it is the
appliance's spec (`cpu_spec.HostTierSpec`), loaded through vLLM's out-of-tree seam
(`spec_name` + `spec_module_path`). One offloaded chunk is one KV block, so the tier's KV
events carry the blocks' own hashes, which the router's index matches. The composition's
role is `kv_both`, as vLLM's own `--kv-offloading-size` gives it: the tier loads KV, so
vLLM must defer block frees under async scheduling, as for any consumer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

CONNECTOR_CLASS = "HostTierConnector"
CONNECTOR_MODULE = "appliance.engines.offload.connector"
CPU_SPEC_CLASS = "HostTierSpec"
CPU_SPEC_MODULE = "appliance.engines.offload.cpu_spec"


@dataclass(frozen=True, slots=True)
class HostTierPlan:
    """A worker's host tier: `host_bytes` of host memory for KV blocks."""

    host_bytes: int
    native_copies: bool
    """vLLM's own CUDA copies (`CPUOffloadingSpec`); False: the CPU build's torch copies."""

    def offloading_config(self) -> dict[str, Any]:
        """vLLM's OffloadingConnector with this tier (a MultiConnector child, or alone)."""
        extra: dict[str, Any] = {"cpu_bytes_to_use": self.host_bytes}
        if not self.native_copies:
            extra |= {"spec_name": CPU_SPEC_CLASS, "spec_module_path": CPU_SPEC_MODULE}
        return {
            "kv_connector": "OffloadingConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": extra,
        }


def transfer_config(
    retention: dict[str, Any] | None, host: HostTierPlan | None
) -> dict[str, Any] | None:
    """The worker's `--kv-transfer-config`: the retention connector's (`retention`), the host
    tier's, both composed, or None for neither."""
    if host is None:
        return retention
    if retention is None:
        return host.offloading_config()
    return {
        "kv_connector": CONNECTOR_CLASS,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"connectors": [retention, host.offloading_config()]},
    }
