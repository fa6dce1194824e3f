"""The host tier's offloading spec for vLLM's CPU build, loaded by vLLM's
`OffloadingSpecFactory` from the OffloadingConnector's `kv_connector_extra_config`
(`spec_name: HostTierSpec`, `spec_module_path: appliance.engines.offload.cpu_spec`, vLLM
0.32's out-of-tree seam). Loaded inside vLLM only.

It is vLLM's own `CPUOffloadingSpec` in everything but the worker: the same scheduler-side
`CPUOffloadingManager` (chunks, LRU, events "CPU", metrics), the same size
(`cpu_bytes_to_use`), but the copies are `host_copy.TorchCopyWorker`'s, since vLLM's own
worker refuses any device that is not CUDA-alike or XPU. On CUDA the appliance names
vLLM's `CPUOffloadingSpec` itself.
"""

from __future__ import annotations

from vllm.v1.kv_offload.base import CanonicalKVCaches, OffloadingWorker
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

from appliance.engines.offload.host_copy import TorchCopyWorker


class HostTierSpec(CPUOffloadingSpec):
    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        worker = getattr(self, "_host_copies", None)
        if worker is None:
            if self.config.canonical_layout:
                raise ValueError(
                    "the host tier's torch copies keep the KV's own layout: unset canonical_layout"
                )
            worker = self._host_copies = TorchCopyWorker(
                kv_caches, self.blocks_per_chunk, self.num_chunks
            )
        return worker
