"""How many KV blocks a GPU of a profile holds: vLLM's sizing, for the simulated worker, the
live appliance's model of the GPUs those workers stand for, and the replay.

Model of the world: vLLM gives the KV cache what its memory budget (utilisation x HBM)
leaves after the weights (bf16: two bytes a parameter); a profile without a memory reading
is taken for an 80 GiB GPU.
"""

from __future__ import annotations

from appliance.perf.profile import GpuProfile

SIM_GPU_MEMORY_UTILIZATION = 0.92
"""The simulated worker's `--gpu-memory-utilization` unless told otherwise."""
FALLBACK_HBM_BYTES = 80 * 2**30
"""A profile without a memory reading: the GPU size assumed."""


def default_num_gpu_blocks(profile: GpuProfile, block_size: int, utilization: float) -> int:
    """KV blocks a GPU of this profile holds after the weights (bf16), like vLLM's sizing."""
    memory = profile.memory_bytes or FALLBACK_HBM_BYTES
    weights = 2 * (profile.model.params or 0)
    kv_bytes = max(memory * utilization - weights, 0)
    return max(int(kv_bytes // (profile.kv_bytes_per_token * block_size)), 2)
