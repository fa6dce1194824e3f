"""Pinned host memory for KV blocks: vLLM 0.32's native CPU offloading, as the sim sees it.

Model of the world (vLLM 0.32's `v1/kv_offload/cpu/manager.py` CPUOffloadingManager with
its default `policies/lru.py` LRUCachePolicy, and the OffloadingConnector's scheduler side,
`--kv-offloading-size GiB`, one GPU block per offloaded chunk; when the prefix cache stores
and touches: `cache_offload.py`): the host tier is a set of block hashes with room for
`num_blocks` (`cpu_bytes_to_use // bytes per block`). A store offers hashes; those already
held are skipped, and room for the rest is made by evicting from the least recently used
end, never one of the hashes offered, all or nothing (when the rest of the tier cannot make
room, nothing is stored, as `prepare_store` returns None). `touch` makes hashes the most
recently used, the first of them last (so a prefix outlives its tail). `lookup` counts the
leading hashes held.

Events are vLLM's connector events: each stored hash one BlockStored with medium "CPU",
no parent, no tokens and block size 0 (`offloading/events.py` `_placeholder_stored`);
each eviction batch one BlockRemoved with medium "CPU". They go to the `sink` of the
engine that stored the hash, so a tier shared by several engines (a pooled host tier)
still reports each block where the router learnt of it.

What the sim leaves out: stores and loads complete at once (vLLM copies asynchronously and
announces a store when its copy is done; a block being loaded cannot be evicted), and the
copies take no GPU time here (the engine charges a load's copy to the loading request).

`priority` (None: LRU, as vLLM) is the hook for a residency policy to order evictions:
`priority(HostSession, now)` ranks the sessions whose blocks the tier holds, the lowest
evicted first, each session's blocks least recently used first. A block belongs to the
session that last stored or touched it.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from itertools import count, filterfalse, islice, repeat, takewhile

from appliance.domain.block_hash import BlockHash, event_block_hash
from appliance.domain.kv_events import BlockRemoved, BlockStored, KvEvent, Medium

EventSink = list[KvEvent]


@dataclass(frozen=True, slots=True)
class HostSession:
    """A session's blocks in the host tier, as an eviction order sees them."""

    owner: str | None
    num_blocks: int
    last_used_s: float


HostPriority = Callable[[HostSession, float], float]
"""(session, now) -> rank: the lowest-ranked session's blocks are evicted first."""


@dataclass(frozen=True, slots=True)
class HostTierStats:
    stored: int = 0
    """Blocks copied in."""
    evicted: int = 0
    """Blocks evicted to make room."""


class HostTier:
    """The host tier's block hashes in LRU order (the head is evicted first)."""

    def __init__(
        self, num_blocks: int, *, priority: HostPriority | None = None, medium: str = Medium.CPU
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"a host tier needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.priority = priority
        """Fixed at construction: only a ranked tier keeps each block's owner."""
        self._ranked = _Owners() if priority is not None else None
        self.medium = medium
        self.now_s = 0.0
        """The time stores and touches are stamped with (set by the engine each step)."""
        self._blocks: OrderedDict[BlockHash, EventSink | None] = OrderedDict()
        """Each held hash's sink (the storing engine's events), in LRU order."""
        self._last_used: dict[str | None, float] = {}
        self._stored = 0
        self._evicted = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self._blocks

    @property
    def stats(self) -> HostTierStats:
        return HostTierStats(self._stored, self._evicted)

    def hashes(self) -> tuple[BlockHash, ...]:
        """The held hashes, first to be evicted (under LRU) first."""
        return tuple(self._blocks)

    def lookup(self, block_hashes: Sequence[BlockHash]) -> int:
        """How many leading hashes of `block_hashes` the tier holds."""
        return len(list(takewhile(self._blocks.__contains__, block_hashes)))

    def touch(self, block_hashes: Sequence[BlockHash], *, owner: str | None = None) -> None:
        """Make the held ones among `block_hashes` the most recently used, the first last."""
        blocks = self._blocks
        held = list(filter(blocks.__contains__, reversed(block_hashes)))
        deque(map(blocks.move_to_end, held), maxlen=0)  # each in turn, the first last
        if self._ranked is not None:
            self._ranked.to_end(held, owner)
        self._last_used[owner] = self.now_s

    def store(
        self,
        block_hashes: Sequence[BlockHash],
        *,
        owner: str | None = None,
        sink: EventSink | None = None,
    ) -> list[BlockHash] | None:
        """Copy in the hashes not yet held, evicting to make room (never one of those
        offered: vLLM protects them); returns those stored, or None (nothing changed) when
        the rest of the tier has no room for them."""
        blocks = self._blocks
        offered = dict.fromkeys(block_hashes)
        new = [h for h in offered if h not in blocks]
        over = len(blocks) + len(new) - self.num_blocks
        if over > 0:
            victims = self._victims(over, offered if len(new) < len(offered) else {})
            if len(victims) < over:
                return None
            self._remove(victims)
            self._evicted += len(victims)
        blocks.update(dict.fromkeys(new, sink))
        if self._ranked is not None:
            self._ranked.to_end(new, owner)
        if new:
            self._last_used[owner] = self.now_s
            self._stored += len(new)
            if sink is not None:
                sink.extend(self._stored_event(h) for h in new)
        return new

    def discard(self, block_hashes: Sequence[BlockHash]) -> int:
        """Drop the held ones among `block_hashes` at once (their owner has ended); returns
        how many were held."""
        held = [h for h in dict.fromkeys(block_hashes) if h in self._blocks]
        self._remove(held)
        return len(held)

    def _stored_event(self, block_hash: BlockHash) -> BlockStored:
        return BlockStored(
            block_hashes=(event_block_hash(block_hash),),
            parent_block_hash=None,
            token_ids=(),
            block_size=0,
            medium=self.medium,
            group_idx=0,
        )

    def _victims(self, n: int, protected: Mapping[BlockHash, None]) -> list[BlockHash]:
        """Up to `n` blocks to evict, none of `protected`: the least recently used, or the
        lowest-ranked sessions' (`_ranked_victims`)."""
        if self._ranked is not None:
            return self._ranked_victims(n, protected)
        if not protected:
            return list(islice(self._blocks, n))
        return list(islice(filterfalse(protected.__contains__, self._blocks), n))

    def _remove(self, victims: Sequence[BlockHash]) -> None:
        by_sink: dict[int, tuple[EventSink, list[int]]] = {}
        for h in victims:
            sink = self._blocks.pop(h)
            if self._ranked is not None:
                self._ranked.remove(h)
            if sink is not None:
                by_sink.setdefault(id(sink), (sink, []))[1].append(event_block_hash(h))
        for out, hashes in by_sink.values():
            out.append(BlockRemoved(block_hashes=tuple(hashes), medium=self.medium, group_idx=0))

    def _ranked_victims(self, n: int, protected: Mapping[BlockHash, None]) -> list[BlockHash]:
        """The lowest-ranked sessions' blocks, each session's in LRU order."""
        rank, now, last_used = self.priority, self.now_s, self._last_used
        assert rank is not None and self._ranked is not None
        groups = self._ranked.groups

        def key(owner: str | None) -> float:
            return rank(HostSession(owner, len(groups[owner]), last_used.get(owner, 0.0)), now)

        victims: list[BlockHash] = []
        for owner in sorted(self._ranked.owners(), key=key):  # stable: ties in tier order
            victims += islice(filterfalse(protected.__contains__, groups[owner]), n - len(victims))
            if len(victims) == n:
                break
        return victims


_NEW = object()  # (not held yet)


class _Owners:
    """A ranked tier's blocks by owner (a block is the last storer's or toucher's), each
    owner's in the tier's LRU order, and each block's place in that order (a stamp that
    only grows), so that an eviction ranks the owners without a pass over the tier."""

    def __init__(self) -> None:
        self.of: dict[BlockHash, str | None] = {}
        self.groups: dict[str | None, OrderedDict[BlockHash, None]] = {}
        self.stamp: dict[BlockHash, int] = {}
        self._stamps = count()

    def owners(self) -> list[str | None]:
        """The owners in the order their least recently used blocks come in the tier."""
        groups, stamp = self.groups, self.stamp
        return sorted(groups, key=lambda owner: stamp[next(iter(groups[owner]))])

    def to_end(self, hashes: list[BlockHash], owner: str | None) -> None:
        """`hashes` (held or new) moved to the tier's most recent end in turn, `owner`'s."""
        of, groups = self.of, self.groups
        group = groups.get(owner)
        if group is not None and set(map(of.get, hashes, repeat(_NEW))) <= {owner}:
            deque(map(group.move_to_end, hashes), maxlen=0)  # all its own already
        else:
            for h in hashes:
                if h in of:
                    self._drop(h, of[h])
                groups.setdefault(owner, OrderedDict())[h] = None
                of[h] = owner
        self.stamp.update(zip(hashes, self._stamps, strict=False))  # (stamps never run out)

    def remove(self, block_hash: BlockHash) -> None:
        self._drop(block_hash, self.of.pop(block_hash))
        del self.stamp[block_hash]

    def _drop(self, block_hash: BlockHash, owner: str | None) -> None:
        group = self.groups[owner]
        del group[block_hash]
        if not group:
            del self.groups[owner]
