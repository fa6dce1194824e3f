"""What the retention connector sees of vLLM's host tier: the OffloadingConnector's
scheduler-side `OffloadingManager` (vLLM 0.32's `CPUOffloadingManager`, whichever spec
copies the blocks), read on the scheduler thread, where both connectors run. Loaded inside
vLLM only.

Model of the world: vLLM's offloading connector stores every computed prompt block of every
request in the host tier as it goes (one block a chunk: a chunk's key is its block's hash
with the group id, `make_offload_key`, the very bytes of `KVCacheBlock.block_hash`), the
host tier evicts least recently used chunks for room, and a request's prefix that the GPU no
longer has is loaded back from there when the request is scheduled (vLLM's
`external_prefix_cache_*` and `prompt_tokens_cached_by_source{source="host"}` count it).
A demotion asks which of a session's leading blocks have a copy there (stored, or being
stored: vLLM fences a freed block's reuse until its store has landed, so the GPU block may go
at once), makes those the host tier's most recently used, and remembers them under the
session's key; a restore makes them the most recently used again, so they are there when
the session's turn loads them. A drop (a session's end: `RetentionEvictFirst(drop_host=True)`)
takes chunks out of the tier at once, as the manager's own eviction in `prepare_store`
does: out of its cache policy (LRU, or any other: `CachePolicy.remove`), the chunk's slot
back on its free list, and a removal event (BlockRemoved, medium "CPU") for the router's
index. A chunk being stored (`ref_cnt` -1) or loaded (above 0) stays, as its eviction
would skip it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from vllm.v1.kv_offload.base import (
    LookupResult,
    OffloadingEvent,
    OffloadingManager,
    OffloadKey,
    ReqContext,
)

_MANAGER_NEEDS = (
    "lookup",
    "touch",
    "_num_chunks",
    "_get_num_free_chunks",
    "_policy",
    "_free_chunk",
    "_num_evictable_cache_chunks",
    "events",
    "medium",
)
_REMEMBERED_KEYS = 4096


class OffloadedHostTier:
    """The retention pool's `HostTierReader` over an offloading manager."""

    def __init__(self, manager: OffloadingManager) -> None:
        missing = [n for n in _MANAGER_NEEDS if not hasattr(manager, n)]
        if missing:
            raise RuntimeError(
                f"the host tier does not fit this vLLM: its offloading manager "
                f"{type(manager).__name__} has no {', '.join(missing)}; set "
                "engine.kv_host_bytes: 0 or use vLLM 0.32"
            )
        self._manager: Any = manager
        self._context = ReqContext(req_id="appliance-retention")
        self._demoted: OrderedDict[str, tuple[OffloadKey, ...]] = OrderedDict()

    def size(self) -> tuple[int, int]:
        """(chunks it holds at most, chunks in use)."""
        total = int(self._manager._num_chunks)
        return total, total - int(self._manager._get_num_free_chunks())

    def keep(self, key: str, block_hashes: Sequence[object]) -> int:
        """Of the blocks (hashes, a prefix), the leading ones with a host copy: made the
        most recently used, remembered under `key`; how many."""
        kept: list[OffloadKey] = []
        for block_hash in block_hashes:
            if not isinstance(block_hash, bytes):
                break
            chunk = OffloadKey(block_hash)
            if self._manager.lookup(chunk, self._context) == LookupResult.MISS:
                break
            kept.append(chunk)
        if kept:
            self._manager.touch(kept, self._context)
            self._demoted[key] = tuple(kept)
            self._demoted.move_to_end(key)
            while len(self._demoted) > _REMEMBERED_KEYS:
                self._demoted.popitem(last=False)
        return len(kept)

    def refresh(self, key: str) -> int:
        """A restore: the key's demoted chunks still there (the leading run) made the most
        recently used again; how many."""
        there: list[OffloadKey] = []
        for chunk in self._demoted.get(key, ()):
            if self._manager.lookup(chunk, self._context) == LookupResult.MISS:
                break  # a prefix: nothing past a missing chunk can be loaded
            there.append(chunk)
        if there:
            self._manager.touch(there, self._context)
        return len(there)

    def drop(self, block_hashes: Sequence[object]) -> int:
        """The blocks' copies (their hashes) leave the tier now, but any being stored or
        loaded (see the module); how many left."""
        manager = self._manager
        gone: list[OffloadKey] = []
        for block_hash in block_hashes:
            if not isinstance(block_hash, bytes):
                continue
            chunk_key = OffloadKey(block_hash)
            chunk = manager._policy.get(chunk_key)
            if chunk is None or chunk.ref_cnt != 0:
                continue
            manager._policy.remove(chunk_key)
            manager._num_evictable_cache_chunks -= 1
            manager._free_chunk(chunk)
            gone.append(chunk_key)
        if gone and manager.events is not None:
            manager.events.append(OffloadingEvent(keys=gone, medium=manager.medium, removed=True))
        return len(gone)

    def forget(self, key: str) -> None:
        self._demoted.pop(key, None)
