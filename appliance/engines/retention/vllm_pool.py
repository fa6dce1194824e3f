"""vLLM 0.32's BlockPool as the hold book's `KvPool`: the only code that touches vLLM's
blocks. It uses what `bind_gpu_block_pool` exposes to connectors for this ("inc/dec ref
counts, or iterate over the prefix cache blocks"): `BlockPool.touch`, `free_blocks`,
`blocks`, `get_num_free_blocks`, the free queue's `remove` / `prepend_n`, and each
block's `ref_cnt`, `block_hash` and `is_null`. `check_block_pool` fails the worker's start
with one line when a vLLM release has moved any of them, rather than holding wrongly.

The host tier, where the worker has one, is vLLM's own offloading connector's, which stores
every computed prompt block there by itself: `HostTierReader` is what the pool asks of it
(`appliance.engines.offload.host_view.OffloadedHostTier` answers, composed in by
`appliance.engines.offload.connector`). A demotion's `copy_to_host` copies nothing, then:
it keeps the leading blocks that have a copy there, as the tier's most recently used; a
session's end drops its blocks' copies there (`drop_from_host`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

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


class HostTierReader(Protocol):
    """vLLM's host tier, as the retention connector uses it (scheduler thread)."""

    def size(self) -> tuple[int, int]:
        """(blocks it holds at most, blocks in it now)."""
        ...

    def keep(self, key: str, block_hashes: Sequence[object]) -> int:
        """Of the blocks (their hashes, a prefix), the leading ones with a copy in the tier:
        made its most recently used and remembered under `key`; how many."""
        ...

    def refresh(self, key: str) -> int:
        """`key`'s kept blocks still in the tier made its most recently used again."""
        ...

    def drop(self, block_hashes: Sequence[object]) -> int:
        """The blocks' copies (their hashes) leave the tier now; how many left."""
        ...


class VllmKvPool:
    def __init__(self, pool: Any, host: HostTierReader | None = None) -> None:
        check_block_pool(pool)
        self._pool = pool
        self.host = host

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
        """Nothing to copy: vLLM's offloading connector stored the blocks as they were
        computed; those the tier has are kept there as its most recently used."""
        if self.host is None:
            return 0
        return self.host.keep(key, [b.block_hash for b in blocks])

    def host_blocks(self) -> tuple[int, int]:
        return self.host.size() if self.host is not None else (0, 0)

    def drop_from_host(self, block_hashes: Sequence[object]) -> int:
        return self.host.drop(block_hashes) if self.host is not None else 0

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
