"""vLLM's CPU build: how the workers share out the cores, and the KV cache each gets when
none is configured (`launch.py` says why)."""

from __future__ import annotations

from collections.abc import Sequence

CPU_KV_CACHE_MAX_BYTES = 4 * 2**30
"""The CPU build's KV cache per worker at most, unless configured (vLLM's former
VLLM_CPU_KVCACHE_SPACE default)."""
CPU_KV_CACHE_SHARE = 0.4
"""Of the memory free at start, the part the CPU build's workers' KV caches take together:
the rest is for their weights and activations, the appliance and the host."""


def cpu_kv_cache_bytes(free_bytes: int, workers: int) -> int:
    """A CPU-build worker's KV cache when none is configured, in whole MiB."""
    share = min(CPU_KV_CACHE_MAX_BYTES, int(free_bytes * CPU_KV_CACHE_SHARE) // workers)
    return max(share // 2**20, 1) * 2**20


def split_cpus(cpu_ids: Sequence[int], workers: int) -> tuple[tuple[int, ...], ...]:
    """Contiguous, near-equal slices, one per worker; with fewer cores than workers, workers
    share cores round-robin (slow, but it starts)."""
    cpus = tuple(sorted(set(cpu_ids)))
    if not cpus:
        return tuple(() for _ in range(workers))
    if len(cpus) < workers:
        return tuple((cpus[i % len(cpus)],) for i in range(workers))
    size, extra = divmod(len(cpus), workers)
    out, start = [], 0
    for i in range(workers):
        end = start + size + (1 if i < extra else 0)
        out.append(cpus[start:end])
        start = end
    return tuple(out)
