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

Pins (for residency policies; none unless a caller pins, and then nothing above changes):
`pin(owner, request, ...)` takes one reference on each cached block of a request that is
about to be freed, so those blocks leave the free queue and no allocation evicts them; a
cache hit on a pinned block shares it as on any held block. `unpin` and `expire_pins` drop
the references: blocks nobody else holds go to the free queue's tail, as a request's free
would put them then, and are ordinary LRU blocks from there on. A pin never makes an
allocation fail: when `allocate` is short it first gives pins back, lowest
`pin_priority` first (never the requesting session's own pin), but only if giving all of
them back would make room; otherwise nothing is released and it refuses as before.
`evict_pin` and `demote_pin` end a pin the other two ways a residency policy may choose:
its blocks go to the head of the free queue (evicted before any other), or they are
copied to the host tier and forgotten on the GPU; `free_first` and `free_to_host` do the
same to a request's blocks as it is freed.

Host tier (`host=`, a `HostTier`; none unless given, and then nothing above changes), as
vLLM's OffloadingConnector uses it: a request's full prompt blocks are offered to the host
tier as they become cached (`offload_prompt_only`, its default), those already there
skipped, and when something was stored all of its full prompt blocks are touched. A lookup
refreshes all of the request's hashes in the host tier, then continues past the GPU hit:
the leading blocks after it that the host holds (still short of the last token) are the
hit's `num_host_tokens`. Admitting such a hit (`allocate(..., delay_cache_blocks=True)`
for those tokens) allocates GPU blocks for them, which are cached (BlockStored "GPU") only
when the load completes (`complete_load`), as vLLM's scheduler does for a request that
waited for remote KV. Local prefix-cache counters count the GPU hit only. Host events
follow the GPU events of the same step.
"""

from __future__ import annotations

import heapq
from collections.abc import Collection, Sequence
from dataclasses import dataclass, replace
from operator import attrgetter

from appliance.domain.block_hash import BlockHash, cacheable_blocks
from appliance.domain.kv_events import KvEvent
from appliance.sim.block_pool import Block, BlockPool
from appliance.sim.cache_request import NO_HIT, CacheHit, CacheRequest
from appliance.sim.host_tier import HostTier
from appliance.sim.pins import Pin, PinnedBlocks, PinPriority, PinStats, latest_expiry_first


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


class PrefixCache:
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
        self.pin_priority = pin_priority
        self._pins: dict[str, tuple[Pin, list[Block]]] = {}
        self._expiry: list[tuple[float, int, str]] = []  # (until_s, seq, owner), lazily pruned
        self._pin_seq = 0
        self._pin_stats = PinStats()
        self._pin_now = 0.0  # the latest `now` a caller gave (for `pin_priority`)
        self._pinned = PinnedBlocks()
        self.host = host
        self._host_events: list[KvEvent] = []
        self._host_offered: dict[str, int] = {}  # request -> prompt blocks offered so far

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

    @property
    def pin_stats(self) -> PinStats:
        return self._pin_stats

    @property
    def pins(self) -> tuple[Pin, ...]:
        """The standing pins, oldest first."""
        return tuple(pin for pin, _ in self._pins.values())

    @property
    def num_pinned_blocks(self) -> int:
        """Distinct blocks some pin holds (a block two pins share counts once)."""
        return len(self._pinned)

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
            hashes = request.block_hashes
            self.host.touch(
                hashes[: request.num_tokens // self.block_size], owner=request.session_id
            )
            on_host = self.host.lookup(hashes[len(hit) : max_blocks])
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
        elif self.enable_caching:
            self._cache_blocks(request, min(total_computed + num_new_tokens, request.num_tokens))
        return tuple(b.block_id for b in new_blocks)

    def complete_load(self, request: CacheRequest) -> None:
        """The host tier's blocks of an admitted request are on the GPU now: cache them."""
        if self.enable_caching:
            self._cache_blocks(request, request.num_computed_tokens)

    def free(self, request: CacheRequest) -> None:
        """Release a finished (or aborted) request's blocks, tail block first."""
        self.pool.free_blocks(reversed(self._drop_request(request)))

    def free_first(self, request: CacheRequest) -> int:
        """Release a finished request's blocks to the head of the free queue (tail block
        first), so they are evicted before any other; returns how many went there."""
        blocks = self._drop_request(request)
        before = self.num_free_blocks
        self.pool.free_blocks(reversed(blocks), first=True)
        return self.num_free_blocks - before

    def free_to_host(self, request: CacheRequest) -> int:
        """Copy a finished request's cached blocks to the host tier, then release them and
        forget those nobody else holds on the GPU; returns the blocks copied."""
        self._require_host()
        return self._demote(self._drop_request(request), request.session_id)

    def evict_pin(self, owner: str) -> int:
        """End `owner`'s pin with its blocks first in the eviction order; returns how many
        went there (0: no pin, or every block is held by someone else too)."""
        entry = self._pop_pin(owner)
        if entry is None:
            return 0
        before = self.num_free_blocks
        self.pool.free_blocks(reversed(entry[1]), first=True)
        self._bump(evicted=1)
        return self.num_free_blocks - before

    def demote_pin(self, owner: str) -> int:
        """End `owner`'s pin by copying its blocks to the host tier and forgetting on the
        GPU those nobody else holds; returns the blocks copied (0: no pin)."""
        self._require_host()
        entry = self._pop_pin(owner)
        if entry is None:
            return 0
        self._bump(demoted=1)
        return self._demote(entry[1], owner)

    def end_pin(self, owner: str, *, forget: Collection[BlockHash] = ()) -> int:
        """End `owner`'s pin as `unpin` does (not counted as a return), then forget on the
        GPU the blocks of `forget` nobody holds; returns how many were forgotten."""
        entry = self._pop_pin(owner)
        self.pool.free_blocks(reversed(entry[1] if entry is not None else []))
        gone = [b for h in forget if (b := self.pool.get_cached_block(h)) is not None]
        return self.pool.evict_cached(gone)

    def preempt(self, request: CacheRequest) -> None:
        """Free a running request's blocks and send it back to waiting, to recompute from
        whatever of its prefix is still cached when it is next scheduled."""
        self.free(request)
        request.num_computed_tokens = 0
        request.num_preemptions += 1

    def pin(self, owner: str, request: CacheRequest, *, now_s: float, until_s: float) -> int:
        """Hold the cached blocks of a request about to be freed, under `owner`, until
        `until_s` (call before `free`); an earlier pin of the owner is released after the new
        one holds its blocks. Returns the number of blocks pinned (0: nothing is pinned)."""
        self._pin_now = now_s
        held = self._req_blocks.get(request.request_id, [])
        blocks = [b for b in held if b.block_hash is not None and not b.is_null]
        old = self._pop_pin(owner)
        if blocks:
            self.pool.touch(blocks)
            self._pin_seq += 1
            self._pins[owner] = (Pin(owner, len(blocks), now_s, until_s, self._pin_seq), blocks)
            self._pinned.add(blocks)
            heapq.heappush(self._expiry, (until_s, self._pin_seq, owner))
            self._bump(pinned=1)
        if old is not None:
            self.pool.free_blocks(reversed(old[1]))
            self._bump(replaced=1)
        return len(blocks)

    def unpin(self, owner: str) -> bool:
        """Release `owner`'s pin because the owner is back (its request now holds what it
        reuses); False if it had none."""
        if not self._release(owner):
            return False
        self._bump(resumed=1)
        return True

    def expire_pins(self, now_s: float, *, keep: Collection[str] = ()) -> list[str]:
        """Release pins due by `now_s`, the earliest first, except those of `keep` (owners
        whose next request is already waiting: Continuum keeps those). Returns the owners."""
        self._pin_now = now_s
        heap, due, kept = self._expiry, [], []
        while heap and heap[0][0] <= now_s:
            entry = heapq.heappop(heap)
            _, seq, owner = entry
            pin = self._pins.get(owner)
            if pin is None or pin[0].seq != seq:
                continue  # released or replaced since
            if owner in keep:
                kept.append(entry)
            else:
                self._release(owner)
                due.append(owner)
        for entry in kept:
            heapq.heappush(heap, entry)
        if due:
            self._bump(expired=len(due))
        return due

    def due_pins(self, now_s: float, *, keep: Collection[str] = ()) -> list[Pin]:
        """The pins `expire_pins(now_s, keep=keep)` would release, the earliest first
        (nothing changes)."""
        due = [pin for pin, _ in self._pins.values() if pin.until_s <= now_s]
        return sorted((p for p in due if p.owner not in keep), key=lambda p: (p.until_s, p.seq))

    def extend_pin(self, owner: str, until_s: float) -> bool:
        """Keep `owner`'s pin, blocks and pinning time as they are, until `until_s` instead;
        False if it has none."""
        entry = self._pins.get(owner)
        if entry is None:
            return False
        pin, blocks = entry
        self._pin_seq += 1
        self._pins[owner] = (replace(pin, until_s=until_s, seq=self._pin_seq), blocks)
        heapq.heappush(self._expiry, (until_s, self._pin_seq, owner))
        return True

    def next_pin_expiry_s(self) -> float | None:
        """When the earliest standing pin is due (None: no pins)."""
        heap = self._expiry
        while heap and ((pin := self._pins.get(heap[0][2])) is None or pin[0].seq != heap[0][1]):
            heapq.heappop(heap)
        return heap[0][0] if heap else None

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

    def _require_host(self) -> None:
        if self.host is None:
            raise ValueError("demoting needs a host tier; this cache has none")

    def _drop_request(self, request: CacheRequest) -> list[Block]:
        self._num_cached_blocks.pop(request.request_id, None)
        self._host_offered.pop(request.request_id, None)
        return self._req_blocks.pop(request.request_id, [])

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
        to last time; when any was new, all its full prompt blocks are touched."""
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
        if stored:
            self.host.touch(hashes[:end], owner=request.session_id)

    def _pop_pin(self, owner: str) -> tuple[Pin, list[Block]] | None:
        entry = self._pins.pop(owner, None)
        if entry is not None:
            self._pinned.drop(entry[1])
        return entry

    def _release(self, owner: str) -> bool:
        entry = self._pop_pin(owner)
        if entry is None:
            return False
        self.pool.free_blocks(reversed(entry[1]))  # tail block first, as a request's free
        return True

    def _bump(self, **counts: int) -> None:
        s = self._pin_stats
        self._pin_stats = replace(s, **{k: getattr(s, k) + v for k, v in counts.items()})

    def _reclaim_pins(
        self, request: CacheRequest, num_new_tokens: int, hit: CacheHit, full: bool
    ) -> bool:
        """Give pins back, lowest `pin_priority` first, until the allocation fits; only
        when giving all of them back would make it fit. The requester's own session's pin
        is spared while the request adopts a hit (it may hold those very blocks), never
        otherwise: a running request of a session is not preempted for its own pin."""
        owner = request.session_id if hit.block_ids else None
        victims = [(o, pin, blocks) for o, (pin, blocks) in self._pins.items() if o != owner]
        if not victims:
            return False
        holders: dict[int, int] = {}
        for _, _, blocks in victims:
            for b in blocks:
                holders[b.block_id] = holders.get(b.block_id, 0) + 1
        reused = set(hit.block_ids)  # released, these would only be revived by the request
        freeable = sum(
            1 for i, n in holders.items() if self.pool.blocks[i].ref_cnt == n and i not in reused
        )
        need = self.blocks_needed(request, num_new_tokens, hit, full_sequence_must_fit=full)
        if need > self.num_free_blocks + freeable:
            return False
        now = self._pin_now
        victims.sort(key=lambda v: self.pin_priority(v[1], now))
        for o, _, _ in victims:
            self._release(o)
            self._bump(reclaimed=1)
            if self.can_allocate(request, num_new_tokens, hit, full_sequence_must_fit=full):
                return True
        return self.can_allocate(request, num_new_tokens, hit, full_sequence_must_fit=full)

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
