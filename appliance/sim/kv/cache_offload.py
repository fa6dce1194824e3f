"""The prefix cache's side of the host tier, mixed into `PrefixCache` (`prefix_cache.py`):
prompt blocks offered to the host as they become cached, and blocks copied there when a
request or a pin is demoted.

Host tier (`host=`, a `HostTier`; none unless given, and then nothing of the cache changes),
as vLLM 0.32's OffloadingConnector uses it: a request's full prompt blocks are offered to
the host tier as they become cached (`offload_prompt_only`, its default), from its first
block (or from the end of what it loaded), those already there skipped. The tier's recency
changes once a request, when it ends (`CPUOffloadingManager.on_request_finished`): the
blocks it offered or loaded that the tier still holds become the most recently used, its
first last; a preempted request's do not. A lookup changes nothing there; it continues past
the GPU hit: the leading blocks after it that the host holds (still short of the last
token) are the hit's `num_host_tokens`. Admitting such a hit
(`allocate(..., delay_cache_blocks=True)` for those tokens) allocates GPU blocks for them,
which are cached (BlockStored "GPU") only when the load completes (`complete_load`), as
vLLM's scheduler does for a request that waited for remote KV. Local prefix-cache counters
count the GPU hit only. Host events follow the GPU events of the same step.
"""

from __future__ import annotations

from collections.abc import Sequence

from appliance.domain.kv_events import KvEvent
from appliance.sim.kv.block_pool import Block, BlockPool
from appliance.sim.kv.cache_request import CacheRequest
from appliance.sim.kv.host_tier import HostTier


class CacheOffload:
    """The host-tier half of `PrefixCache`: what it stores there and what it demotes."""

    block_size: int
    pool: BlockPool
    host: HostTier | None
    _host_events: list[KvEvent]
    _host_offered: dict[str, int]  # request -> prompt blocks offered so far
    _host_loaded_from: dict[str, int]  # loading request -> its first block loaded

    def free_to_host(self, request: CacheRequest) -> int:
        """Copy a finished request's cached blocks to the host tier, then release them and
        forget those nobody else holds on the GPU; returns the blocks copied."""
        self._require_host()
        return self._demote(self._end_request(request), request.session_id)

    def _require_host(self) -> None:
        if self.host is None:
            raise ValueError("demoting needs a host tier; this cache has none")

    def _demote(self, blocks: list[Block], owner: str | None) -> int:
        """`copy_to_host` (a prefix, in token order), then free them first, forgotten."""
        n = self.copy_to_host(blocks, owner)
        self.pool.free_blocks(reversed(blocks), first=True)
        self.pool.evict_cached(blocks)
        return n

    def copy_to_host(self, blocks: Sequence[Block], owner: str | None) -> int:
        """Copy the cached ones of `blocks` (a prefix) to the host tier, as much as fits, as
        its most recently used (the live retention's demotion); returns how many."""
        assert self.host is not None
        hashes = [b.block_hash for b in blocks if b.block_hash is not None and not b.is_null]
        hashes = hashes[: self.host.num_blocks]
        self.host.store(hashes, owner=owner, sink=self._host_events)
        self.host.touch(hashes, owner=owner)
        return len(hashes)

    def _offer_to_host(self, request: CacheRequest, num_full: int) -> None:
        """vLLM's connector store: the request's new full prompt blocks, from where it got
        to last time."""
        assert self.host is not None
        rid = request.request_id
        end = min(num_full, request.num_prompt_tokens // self.block_size)
        start = self._host_offered.get(rid, 0)
        if end <= start:
            return
        hashes = request.block_hashes
        stored = self.host.store(
            hashes[start:end], owner=request.session_id, sink=self._host_events
        )
        if stored is None:
            return  # no room even when empty: offered again at the next block
        self._host_offered[rid] = end

    def _host_request_ended(self, request: CacheRequest) -> None:
        """vLLM's `on_request_finished`: what the request offered or loaded, those the tier
        still holds, becomes its most recently used (`PrefixCache._end_request`)."""
        end = self._host_offered.get(request.request_id, 0)
        if self.host is not None and end:
            start = self._host_loaded_from.get(request.request_id, 0)
            self.host.touch(request.block_hashes[start:end], owner=request.session_id)
