"""A request-level prefix cache that behaves like vLLM 0.32's KVCacheManager.

Model of the world (vLLM `v1/core/kv_cache_manager.py`, `single_type_kv_cache_manager.py`
FullAttentionManager and the scheduler's calls into them; one full-attention group, no
speculative decoding, connectors or watermark): a waiting request first looks up the longest
run of cached full blocks matching its block hashes, never covering its last token (a full
hit would leave nothing to compute logits from), so a prompt of k full blocks hits at most
k-1. Scheduling `n` tokens then takes references on the hit blocks and allocates enough new
blocks for every computed token, or refuses (the caller preempts someone and retries, as
vLLM's scheduler does). Blocks become cached, with a BlockStored, as soon as they are full
of scheduled tokens: prompt blocks at prefill, decode blocks as generated tokens fill them.
Freeing a request (finished or preempted) returns its blocks tail-first to the free queue,
where cached ones stay findable until evicted. Prefix-cache counters count tokens, as
vLLM's `vllm:prefix_cache_queries` / `_hits` do, recorded once per admission.

Pins (`cache_pins.py`: a residency policy's hold on a finished request's blocks, given
back under pressure) and the host tier (`cache_offload.py`: prompt blocks offered to it as
they are cached, a hit continued into it) are mixed in; with neither in use nothing above
changes.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from operator import attrgetter

from appliance.domain.block_hash import BlockHash, cacheable_blocks
from appliance.domain.kv_events import KvEvent
from appliance.sim.kv.block_pool import Block, BlockPool
from appliance.sim.kv.cache_offload import CacheOffload
from appliance.sim.kv.cache_pins import CachePins
from appliance.sim.kv.cache_request import NO_HIT, CacheHit, CacheRequest
from appliance.sim.kv.host_tier import HostTier
from appliance.sim.kv.pins import PinPriority, latest_expiry_first


@dataclass(frozen=True, slots=True)
class PrefixCacheStats:
    """Cumulative prefix-cache counters in tokens (vLLM `PrefixCacheStats`). Requests that
    were preempted before are counted apart, and only the first kind reaches
    `vllm:prefix_cache_queries` / `vllm:prefix_cache_hits`."""

    requests: int = 0
    queries: int = 0
    hits: int = 0
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0
    resets: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class PrefixCache(CachePins, CacheOffload):
    """vLLM's KVCacheManager for one full-attention group, over a `BlockPool`
    (`num_blocks` counts the null block, like vLLM's `num_gpu_blocks`)."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        max_model_len: int | None = None,
        enable_caching: bool = True,
        enable_events: bool = True,
        pin_priority: PinPriority = latest_expiry_first,
        host: HostTier | None = None,
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.pool = BlockPool(
            num_blocks, enable_caching=enable_caching, enable_events=enable_events
        )
        self._req_blocks: dict[str, list[Block]] = {}
        self._num_cached_blocks: dict[str, int] = {}
        self._stats = PrefixCacheStats()
        self._init_pins(pin_priority)
        self.host = host
        self._host_events: list[KvEvent] = []
        self._host_offered: dict[str, int] = {}  # request -> prompt blocks offered so far
        self._host_loaded_from: dict[str, int] = {}

    # --- queries ---

    @property
    def usage(self) -> float:
        """`vllm:kv_cache_usage_perc` as a fraction: blocks held by requests over usable
        blocks (the null block excluded; cached blocks nobody holds count as free)."""
        return self.pool.usage

    @property
    def num_blocks(self) -> int:
        """All blocks, the null block included."""
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds (cached or not): what an allocation can take."""
        return self.pool.num_free_blocks

    @property
    def stats(self) -> PrefixCacheStats:
        return self._stats

    def block_ids(self, request: CacheRequest) -> tuple[int, ...]:
        """The blocks a request holds, in token order."""
        return tuple(map(attrgetter("block_id"), self._req_blocks.get(request.request_id, ())))

    def num_cached_held(self, request: CacheRequest) -> int:
        """How many of the blocks a request holds carry a hash (stay findable when freed)."""
        held = self._req_blocks.get(request.request_id, ())
        return len(held) - list(map(attrgetter("block_hash"), held)).count(None)

    def free_block_ids(self) -> tuple[int, ...]:
        """The free queue, first to be evicted first."""
        return tuple(b.block_id for b in self.pool.free_queue)

    def ref_counts(self) -> dict[int, int]:
        """Reference count of every block but the null block."""
        return {b.block_id: b.ref_cnt for b in self.pool.blocks if not b.is_null}

    def cached_blocks(self) -> dict[int, BlockHash]:
        """Block id -> hash of every block that still carries a hash."""
        return {b.block_id: b.block_hash for b in self.pool.blocks if b.block_hash is not None}

    def cached_entries(self) -> list[tuple[BlockHash, int]]:
        """(hash, block id) of every entry of the hash map."""
        return list(self.pool.cached_entries())

    def lookup(self, request: CacheRequest) -> CacheHit:
        """The longest cached prefix of a waiting request, in whole blocks, short of its
        last token (`get_computed_blocks`). Emits the reuse report if the request asked."""
        self._check_block_size(request)
        if not self._lookup_enabled(request):
            return NO_HIT
        max_blocks = cacheable_blocks(request.num_tokens, self.block_size)
        hit = self.pool.cached_prefix(request.block_hashes[:max_blocks])
        if hit and request.report_cached_blocks:
            self.pool.emit_cached_block_events(
                request.block_hashes[: len(hit)], **request.stored_fields(0, len(hit))
            )
        on_host = 0
        if self.host is not None:
            on_host = self.host.lookup(request.block_hashes[len(hit) : max_blocks])
        return CacheHit(tuple(hit), len(hit) * self.block_size, on_host * self.block_size)

    def blocks_needed(
        self,
        request: CacheRequest,
        num_new_tokens: int,
        hit: CacheHit = NO_HIT,
        *,
        full_sequence_must_fit: bool = False,
    ) -> int:
        """Free blocks `allocate` would need (hit blocks revived from the free queue
        included). With `full_sequence_must_fit`, for the whole current sequence."""
        total_computed = self._total_computed(request, hit)
        if full_sequence_must_fit:
            num_tokens = self._cap(request.num_tokens)
        else:
            num_tokens = self._cap(total_computed + num_new_tokens)
        return self._blocks_to_allocate(request, num_tokens, hit)

    def can_allocate(
        self,
        request: CacheRequest,
        num_new_tokens: int,
        hit: CacheHit = NO_HIT,
        *,
        full_sequence_must_fit: bool = False,
    ) -> bool:
        """Whether `allocate` with these arguments would succeed now; if not, the
        scheduler preempts a running request and asks again."""
        # The whole sequence needs at least what its next `num_new_tokens` need.
        full = full_sequence_must_fit
        needed = self.blocks_needed(request, num_new_tokens, hit, full_sequence_must_fit=full)
        return needed <= self.num_free_blocks

    # --- changes ---

    def allocate(
        self,
        request: CacheRequest,
        num_new_tokens: int,
        hit: CacheHit | None = None,
        *,
        full_sequence_must_fit: bool = False,
        delay_cache_blocks: bool = False,
    ) -> tuple[int, ...] | None:
        """Schedule `num_new_tokens` more tokens of `request` (`allocate_slots`).

        For a waiting request pass the `hit` from `lookup` (even an empty one): its blocks
        are adopted and the admission is counted in `stats`; a running request passes
        none. `full_sequence_must_fit` is vLLM's admission gate (`scheduler_reserve_full_isl`,
        on by default for waiting requests). Returns the ids of newly allocated blocks, or
        None (nothing changed) when the pool is short. On success the tokens count as
        computed and every block they fill is cached, unless `delay_cache_blocks` (tokens
        loaded from the host tier: the blocks are cached by `complete_load`).
        """
        self._check_block_size(request)
        hit_ = hit if hit is not None else NO_HIT
        total_computed = self._total_computed(request, hit_)
        if num_new_tokens < 0 or total_computed + num_new_tokens > request.num_tokens:
            raise ValueError(
                f"{request.request_id}: cannot schedule {num_new_tokens} tokens past "
                f"{total_computed} computed of {request.num_tokens}"
            )
        if num_new_tokens == 0 and hit_.num_tokens == 0:
            raise ValueError("num_new_tokens must be > 0 when there is no hit to adopt")
        admitting = request.request_id not in self._req_blocks
        if hit_.block_ids and not admitting:
            raise ValueError(f"{request.request_id} is running and cannot adopt a cache hit")
        hit_blocks = self._resolve_hit(request, hit_)
        if not self.can_allocate(
            request, num_new_tokens, hit_, full_sequence_must_fit=full_sequence_must_fit
        ) and not self._reclaim_pins(request, num_new_tokens, hit_, full_sequence_must_fit):
            return None

        req_blocks = self._req_blocks.setdefault(request.request_id, [])
        if hit_blocks:
            self.pool.touch(hit_blocks)
            req_blocks.extend(hit_blocks)
            self._num_cached_blocks[request.request_id] = len(req_blocks)
        num_slots = self._cap(total_computed + num_new_tokens)
        new_blocks = self.pool.get_new_blocks(
            max(-(-num_slots // self.block_size) - len(req_blocks), 0)
        )
        req_blocks.extend(new_blocks)

        if admitting and hit is not None and self._lookup_enabled(request):
            self._record(request, hit_.num_tokens)
        request.num_computed_tokens = total_computed + num_new_tokens
        if delay_cache_blocks:
            # vLLM's connector stores nothing of a loading request up to what it loads.
            self._host_offered[request.request_id] = len(req_blocks)
            self._host_loaded_from[request.request_id] = len(hit_blocks)
        elif self.enable_caching:
            self._cache_blocks(request, min(total_computed + num_new_tokens, request.num_tokens))
        return tuple(b.block_id for b in new_blocks)

    def complete_load(self, request: CacheRequest) -> None:
        """The host tier's blocks of an admitted request are on the GPU now: cache them."""
        if self.enable_caching:
            self._cache_blocks(request, request.num_computed_tokens)

    def free(self, request: CacheRequest) -> None:
        """Release a finished (or aborted) request's blocks, tail block first."""
        self.pool.free_blocks(reversed(self._end_request(request)))

    def free_first(self, request: CacheRequest) -> int:
        """Release a finished request's blocks to the head of the free queue (tail block
        first), so they are evicted before any other; returns how many went there."""
        blocks = self._end_request(request)
        before = self.num_free_blocks
        self.pool.free_blocks(reversed(blocks), first=True)
        return self.num_free_blocks - before

    def preempt(self, request: CacheRequest) -> None:
        """Free a running request's blocks and send it back to waiting, to recompute from
        whatever of its prefix is still cached when it is next scheduled."""
        self.pool.free_blocks(reversed(self._drop_request(request)))
        request.num_computed_tokens = 0
        request.num_preemptions += 1

    def reset(self) -> bool:
        """Clear the prefix cache (AllBlocksCleared); refused while any request holds
        blocks, as in vLLM."""
        if not self.pool.reset_prefix_cache():
            return False
        self._stats = replace(self._stats, resets=self._stats.resets + 1)
        return True

    @property
    def has_events(self) -> bool:
        return self.pool.has_events or bool(self._host_events)

    def take_events(self) -> list[KvEvent]:
        """KV events since the last call, in the order vLLM would publish them (the
        engine's, then the host tier's)."""
        events = self.pool.take_events() + self._host_events
        self._host_events.clear()  # the host tier keeps it as its eviction events' sink
        return events

    # --- internals ---

    def _end_request(self, request: CacheRequest) -> list[Block]:
        """A request ends (finished or aborted; a preempted one only drops): the host tier
        takes its recency from it, then its blocks are forgotten as its own."""
        self._host_request_ended(request)
        return self._drop_request(request)

    def _drop_request(self, request: CacheRequest) -> list[Block]:
        self._num_cached_blocks.pop(request.request_id, None)
        self._host_offered.pop(request.request_id, None)
        self._host_loaded_from.pop(request.request_id, None)
        return self._req_blocks.pop(request.request_id, [])

    def _check_block_size(self, request: CacheRequest) -> None:
        if request.block_size != self.block_size:
            raise ValueError(
                f"{request.request_id} is hashed in blocks of {request.block_size}, "
                f"the cache uses {self.block_size}"
            )

    def _lookup_enabled(self, request: CacheRequest) -> bool:
        return self.enable_caching and not request.skip_reading_prefix_cache

    def _cap(self, num_tokens: int) -> int:
        return num_tokens if self.max_model_len is None else min(num_tokens, self.max_model_len)

    def _total_computed(self, request: CacheRequest, hit: CacheHit) -> int:
        return self._cap(request.num_computed_tokens + hit.num_tokens)

    def _resolve_hit(self, request: CacheRequest, hit: CacheHit) -> list[Block]:
        blocks = list(map(self.pool.blocks.__getitem__, hit.block_ids))
        hashes = list(map(attrgetter("block_hash"), blocks))
        if hashes != request.block_hashes[: len(hashes)]:  # a block was evicted and reused
            raise ValueError(f"stale cache hit for {request.request_id}: a block changed")
        return blocks

    def _blocks_to_allocate(self, request: CacheRequest, num_tokens: int, hit: CacheHit) -> int:
        held = len(self._req_blocks.get(request.request_id, ()))
        num_new = max(-(-num_tokens // self.block_size) - held - len(hit.block_ids), 0)
        blocks = map(self.pool.blocks.__getitem__, hit.block_ids)
        revived = list(map(attrgetter("ref_cnt"), blocks)).count(0)  # in the free queue
        return num_new + revived

    def _cache_blocks(self, request: CacheRequest, num_tokens: int) -> None:
        num_cached = self._num_cached_blocks.get(request.request_id, 0)
        num_full = num_tokens // self.block_size
        if self.host is not None:
            self._offer_to_host(request, num_full)
        if num_cached >= num_full:
            return
        self.pool.cache_full_blocks(
            self._req_blocks[request.request_id],
            request.block_hashes,
            num_cached,
            num_full,
            **request.stored_fields(num_cached, num_full),
        )
        self._num_cached_blocks[request.request_id] = num_full

    def _record(self, request: CacheRequest, num_hits: int) -> None:
        s = self._stats
        if request.num_preemptions > 0:
            self._stats = replace(
                s,
                preempted_requests=s.preempted_requests + 1,
                preempted_queries=s.preempted_queries + request.num_tokens,
                preempted_hits=s.preempted_hits + num_hits,
            )
        else:
            self._stats = replace(
                s,
                requests=s.requests + 1,
                queries=s.queries + request.num_tokens,
                hits=s.hits + num_hits,
            )
