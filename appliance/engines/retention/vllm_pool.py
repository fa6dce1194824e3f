"""vLLM 0.32's BlockPool as the hold book's `KvPool`: the only code that touches vLLM's
blocks. It uses what `bind_gpu_block_pool` exposes to connectors for this ("inc/dec ref
counts, or iterate over the prefix cache blocks"): `BlockPool.touch`, `free_blocks`,
`blocks`, `get_num_free_blocks`, the free queue's `remove` / `prepend_n`, and each
block's `ref_cnt`, `block_hash` and `is_null`. `check_block_pool` fails the worker's start
with one line when a vLLM release has moved any of them, rather than holding wrongly.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

_POOL_NEEDS = ("touch", "free_blocks", "blocks", "get_num_free_blocks", "free_block_queue")
_QUEUE_NEEDS = ("remove", "prepend_n")
_BLOCK_NEEDS = ("ref_cnt", "block_hash", "is_null")


def check_block_pool(pool: Any) -> None:
    missing = [f"BlockPool.{n}" for n in _POOL_NEEDS if not hasattr(pool, n)]
    if not missing:
        queue, block = pool.free_block_queue, pool.blocks[0]
        missing += [f"FreeKVCacheBlockQueue.{n}" for n in _QUEUE_NEEDS if not hasattr(queue, n)]
        missing += [f"KVCacheBlock.{n}" for n in _BLOCK_NEEDS if not hasattr(block, n)]
    if missing:
        raise RuntimeError(
            f"the retention connector does not fit this vLLM: it has no {', '.join(missing)}; "
            "turn it off (engine.kv_retention: false) or use vLLM 0.32"
        )


class VllmKvPool:
    def __init__(self, pool: Any) -> None:
        check_block_pool(pool)
        self._pool = pool

    def usable_blocks(self) -> int:
        return int(self._pool.num_gpu_blocks) - 1  # block 0 is vLLM's null block

    def free_blocks(self) -> int:
        return int(self._pool.get_num_free_blocks())

    def is_cached(self, block: Any, block_hash: object) -> bool:
        return bool(block.block_hash == block_hash)

    def hold(self, blocks: Sequence[Any]) -> None:
        self._pool.touch(blocks)

    def give_back(self, blocks: Sequence[Any], *, first: bool) -> None:
        if not first:
            self._pool.free_blocks(reversed(blocks))  # vLLM's own order: tail evicted first
            return
        idle = []
        for block in reversed(blocks):
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                idle.append(block)
        self._pool.free_block_queue.prepend_n(idle)

    def evict_first(self, blocks: Sequence[Any]) -> None:
        idle = [b for b in reversed(blocks) if b.ref_cnt == 0 and not b.is_null]
        queue = self._pool.free_block_queue
        for block in idle:
            queue.remove(block)
        queue.prepend_n(idle)

    def copy_to_host(self, blocks: Sequence[Any], key: str) -> int:
        """Nothing to copy: vLLM's own offloading (where it runs) stores every cached prompt
        block in its host tier as it is computed; the CPU build has none."""
        return 0

    def host_blocks(self) -> tuple[int, int]:
        return 0, 0

    def drop_from_host(self, blocks: Sequence[Any]) -> int:
        return 0  # no host tier composed with the connector yet

    def cached_entries(
        self, block_ids: Sequence[Sequence[int]], num_tokens: int, block_sizes: Sequence[int]
    ) -> tuple[tuple[tuple[object, object], ...], ...]:
        """Per KV cache group, a finished request's full blocks that prefix caching can hit
        (not null, hashed), with their hashes, in prefix order."""
        groups = []
        for ids, size in zip(block_ids, block_sizes, strict=False):
            blocks = (self._pool.blocks[i] for i in ids[: num_tokens // size])
            cached = (b for b in blocks if not b.is_null and b.block_hash is not None)
            groups.append(tuple((b, b.block_hash) for b in cached))
        return tuple(groups)
