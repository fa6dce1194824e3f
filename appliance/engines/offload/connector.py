"""The host tier and the retention connector together in one vLLM worker: vLLM 0.32's
`MultiConnector` over the appliance's `RetentionConnector` and vLLM's own
`OffloadingConnector`, which this subclass only introduces to each other. Loaded by vLLM
(`kv_connector: HostTierConnector`, `kv_connector_module_path:
appliance.engines.offload.connector`; `plan.host_tier_transfer_config` writes it).

MultiConnector calls each child in order for every scheduler hook and every worker hook:
the retention connector first, so a waiting request's room is made (holds given back)
before the offloading connector looks its prefix up in the host tier, and a "not this
step" from the retention connector (after holds were given back for a running request)
stops the lookup for that step; the offloading connector then loads what the host tier has
past the GPU's hit, and stores each new prompt block there. A request's finish reaches
both (neither delays the free). Metrics and KV events are vLLM's own: the offloading
connector's (`kv_offload_*`, `prompt_tokens_cached_by_source`, events with medium "CPU").

The introduction: on the scheduler side the retention connector gets the offloading
connector's manager (`host_view.OffloadedHostTier`), through which its demotions keep a
session's prefix in the host tier (its GPU blocks then go first), its restores make the
copies the most recent there, and its reports carry the tier's size and use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
    OffloadingConnector,
)

from appliance.engines.offload.host_view import OffloadedHostTier
from appliance.engines.retention.connector import RetentionConnector

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig


class HostTierConnector(MultiConnector):
    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        retention = [c for c in self._connectors if isinstance(c, RetentionConnector)]
        offloading = [c for c in self._connectors if isinstance(c, OffloadingConnector)]
        if len(retention) != 1 or len(offloading) != 1:
            raise ValueError(
                "HostTierConnector composes one RetentionConnector and one OffloadingConnector"
            )
        if role == KVConnectorRole.SCHEDULER:
            retention[0].attach_host(OffloadedHostTier(offloading[0].scheduler.manager))
