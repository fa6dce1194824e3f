"""Pins on the prefix cache: a residency policy's hold on a finished request's cached
blocks, mixed into `PrefixCache` (`prefix_cache.py`), whose block pool, allocation checks and
host-tier copy it uses.

Pins (for residency policies; none unless a caller pins, and then nothing of the cache
changes): `pin(owner, request, ...)` takes one reference on each cached block of a request
that is about to be freed, so those blocks leave the free queue and no allocation evicts
them; a cache hit on a pinned block shares it as on any held block. `unpin` and
`expire_pins` drop the references: blocks nobody else holds go to the free queue's tail, as
a request's free would put them then, and are ordinary LRU blocks from there on. A pin never
makes an allocation fail: when `allocate` is short it first gives pins back, lowest
`pin_priority` first (never the requesting session's own pin), but only if giving all of
them back would make room; otherwise nothing is released and it refuses as before.
`evict_pin` and `demote_pin` end a pin the other two ways a residency policy may choose:
its blocks go to the head of the free queue (evicted before any other), or they are
copied to the host tier and forgotten on the GPU; `free_first` and `free_to_host` do the
same to a request's blocks as it is freed.
"""

from __future__ import annotations

import heapq
from collections.abc import Collection
from dataclasses import replace

from appliance.domain.block_hash import BlockHash
from appliance.sim.kv.block_pool import Block, BlockPool
from appliance.sim.kv.cache_request import CacheHit, CacheRequest
from appliance.sim.kv.pins import Pin, PinnedBlocks, PinPriority, PinStats


class CachePins:
    """The pin half of `PrefixCache`: its standing pins, their expiry heap and counters."""

    pool: BlockPool
    _req_blocks: dict[str, list[Block]]

    def _init_pins(self, pin_priority: PinPriority) -> None:
        self.pin_priority = pin_priority
        self._pins: dict[str, tuple[Pin, list[Block]]] = {}
        self._expiry: list[tuple[float, int, str]] = []  # (until_s, seq, owner), lazily pruned
        self._pin_seq = 0
        self._pin_stats = PinStats()
        self._pin_now = 0.0  # the latest `now` a caller gave (for `pin_priority`)
        self._pinned = PinnedBlocks()

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
