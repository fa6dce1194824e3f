"""The retention connector's bookkeeping, apart from vLLM: which finished request each key
last had, which keys are held on which blocks, and in which order holds give way.

Model of the world: vLLM frees a finished request's blocks into its free queue, where the
full ones stay findable by hash (a prefix-cache hit) until an allocation evicts them, least
recently used first. A hold takes one reference on each of those blocks (`KvPool.hold`),
which keeps them out of the free queue while hits still find them; giving it back drops
the reference, so they are ordinary cached blocks again. Nothing is held unless the
appliance asks: `finished` only remembers a key's newest request (its blocks and their
hashes then), and a hold takes the leading blocks that still carry those hashes, since
a hit is a prefix and a block that was evicted and reused carries another hash.

A hold never makes an allocation fail: before vLLM would leave a waiting request waiting
(`make_room`) or preempt a running one (`relieve`), holds are given back lowest priority
first (ties: the hold asked for longest ago), never the waiting request's own session. The
sum of held blocks stays under a cap; a hold over it displaces holds of no higher priority,
then is cut to a prefix. A demotion (`RetentionDemote`) ends a key's hold as an eviction
does, after the pool has copied the key's blocks to its host tier (a pool without one
copies nothing). An eviction or demotion without `drop_host`, or a finished request
forgotten for room, keeps the key's hashes (at most as many in all as the host tier
holds): a later `drop_host` (its session ended) drops those copies by hash, whatever
became of the GPU blocks meanwhile.

Single-threaded: the connector calls it on vLLM's scheduler thread only.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from appliance.engines.retention.held_blocks import (
    HeldBlockCount,
    prefix_within,
    unheld_blocks,
)
from appliance.engines.retention.protocol import (
    GiveBackReason,
    GivenBack,
    HeldKv,
    RetentionDemote,
    RetentionDirective,
    RetentionEvictFirst,
    RetentionHold,
    RetentionOrder,
    RetentionRelease,
)

Entry = tuple[object, object]
"""(a block, the hash it carried when its request finished)."""


class KvPool(Protocol):
    """What the book needs of vLLM's block pool (`vllm_pool.VllmKvPool` adapts it)."""

    def usable_blocks(self) -> int: ...

    def free_blocks(self) -> int:
        """Free or evictable blocks."""
        ...

    def is_cached(self, block: object, block_hash: object) -> bool:
        """The block still carries this hash (it was not evicted since)."""
        ...

    def hold(self, blocks: Sequence[object]) -> None:
        """One more reference on each block (out of the free queue while referenced)."""
        ...

    def give_back(self, blocks: Sequence[object], *, first: bool) -> None:
        """Drop that reference; blocks nobody else references go to the free queue, last
        block first, at its tail (`first`: at its head, evicted before any other)."""
        ...

    def evict_first(self, blocks: Sequence[object]) -> None:
        """Move those of the blocks nobody references to the head of the free queue."""
        ...

    def copy_to_host(self, blocks: Sequence[object], key: str) -> int:
        """Copy the blocks (a prefix) to the host tier, as its most recently used, for
        `key`; returns how many the tier holds now (0: it has no host tier)."""
        ...

    def host_blocks(self) -> tuple[int, int]:
        """The host tier's (capacity, blocks in use); (0, 0) without one."""
        ...

    def drop_from_host(self, block_hashes: Sequence[object]) -> int:
        """Drop the copies of the blocks with these hashes from the host tier at once (as
        `Entry` has them); how many it held."""
        ...


@dataclass(slots=True)
class _Finished:
    groups: tuple[tuple[Entry, ...], ...]
    """Per KV cache group, the request's full cached blocks in prefix order."""
    version: int


@dataclass(slots=True)
class _Held:
    key: str
    blocks: tuple[object, ...]
    tokens: int
    until_s: float
    priority: float
    seq: int
    """When it was last asked for; the older goes first among equal priorities."""
    version: int
    """The finished request whose blocks it holds."""


class HoldBook:
    def __init__(
        self,
        pool: KvPool,
        block_sizes: Sequence[int],
        *,
        max_held_fraction: float = 0.8,
        remember_blocks: int | None = None,
    ) -> None:
        self._pool = pool
        self._block_sizes = tuple(block_sizes)
        self._cap = int(pool.usable_blocks() * max_held_fraction)
        self._remember = remember_blocks or 2 * pool.usable_blocks()
        self._finished: OrderedDict[str, _Finished] = OrderedDict()
        self._remembered = 0
        self._holds: dict[str, _Held] = {}
        self._host_copies: OrderedDict[str, tuple[object, ...]] = OrderedDict()
        """Per key evicted or demoted without `drop_host`, or its finished request forgotten
        for room, its blocks' hashes: what a later `drop_host` drops from the host tier,
        whatever became of the GPU blocks."""
        self._host_copy_count = 0
        self._count = HeldBlockCount()
        self._given_back: list[GivenBack] = []
        self._counter = 0
        self.dirty = False
        """Something changed since the last `take_given_back`."""

    # --- reading ---

    @property
    def held_blocks(self) -> int:
        """Blocks held, each once: holds that share blocks (a fan-out's common prefix) take
        their room in the pool once."""
        return len(self._count)

    def held_of(self, key: str | None) -> int:
        held = self._holds.get(key) if key is not None else None
        return len(held.blocks) if held is not None else 0

    def __bool__(self) -> bool:
        """True while anything is held."""
        return bool(self._holds)

    def held(self) -> tuple[HeldKv, ...]:
        return tuple(
            HeldKv(h.key, len(h.blocks), h.tokens, h.until_s, h.priority) for h in self._order()
        )

    def take_given_back(self) -> tuple[GivenBack, ...]:
        """What was given back since the previous call; clears `dirty`."""
        out, self._given_back = tuple(self._given_back), []
        self.dirty = False
        return out

    # --- what vLLM tells ---

    def finished(self, key: str, groups: Sequence[Sequence[Entry]]) -> None:
        """`key`'s newest request finished with these full cached blocks (not held)."""
        size = sum(len(g) for g in groups)
        if not size:
            return
        old = self._finished.pop(key, None)
        if old is not None:
            self._remembered -= sum(len(g) for g in old.groups)
        self._finished[key] = _Finished(tuple(tuple(g) for g in groups), self._next())
        self._remembered += size
        while self._remembered > self._remember and len(self._finished) > 1:
            gone, dropped = self._finished.popitem(last=False)
            self._remembered -= sum(len(g) for g in dropped.groups)
            self._keep_host_copies(gone, tuple(h for g in dropped.groups for _, h in g))

    # --- what the appliance asks ---

    def apply(self, directive: RetentionDirective, now_s: float) -> None:
        match directive:
            case RetentionHold():
                self._hold(directive, now_s)
            case RetentionRelease(key=key):
                self._give_back(key, GiveBackReason.RELEASED)
            case RetentionEvictFirst(key=key, keep_blocks=keep, drop_host=drop):
                self._evict_first(key, keep=keep, drop_host=drop)
            case RetentionDemote(key=key):
                self._evict_first(key, demote=True)
            case RetentionOrder(priorities=priorities):
                for key, priority in priorities.items():
                    if key in self._holds:
                        self._holds[key].priority = priority
                        self.dirty = True

    def expire(self, now_s: float) -> None:
        for held in [h for h in self._holds.values() if h.until_s <= now_s]:
            self._give_back(held.key, GiveBackReason.EXPIRED)

    def catch_up(self, directives: Iterable[RetentionDirective], now_s: float) -> bool:
        """A scheduler step's start: the directives that came since, in order, then the
        holds due; whether a report is owed."""
        for directive in directives:
            self.apply(directive, now_s)
        self.expire(now_s)
        return self.dirty

    def release_all(self, reason: GiveBackReason) -> None:
        for key in list(self._holds):
            self._give_back(key, reason)

    # --- pressure ---

    def make_room(
        self, need_free: int, *, protect: str | None = None, below: float | None = None
    ) -> int:
        """Gives holds back, in order, until `need_free` blocks are free (a waiting
        request's need; never its own session's hold; with `below`, a restore's need:
        only holds of a lower priority). Returns how many it gave back."""
        given = 0
        if self._pool.free_blocks() >= need_free:
            return given  # the common case, before sorting anything
        for held in self._order():
            if self._pool.free_blocks() >= need_free or (
                below is not None and held.priority >= below
            ):
                break
            if held.key != protect:
                self._give_back(held.key, GiveBackReason.PRESSURE)
                given += 1
        return given

    def relieve(self, reserve_free: int) -> bool:
        """A running request is short of blocks: gives back at least one hold, then more
        until `reserve_free` blocks are free. False when nothing was held."""
        given = False
        for held in self._order():
            if given and self._pool.free_blocks() >= reserve_free:
                break
            self._give_back(held.key, GiveBackReason.PRESSURE)
            given = True
        return given

    # --- the mechanism ---

    def _next(self) -> int:
        self._counter += 1
        return self._counter

    def _order(self) -> list[_Held]:
        return sorted(self._holds.values(), key=lambda h: (h.priority, h.seq))

    def _hold(self, d: RetentionHold, now_s: float) -> None:
        if d.until_s <= now_s:
            self._give_back(d.key, GiveBackReason.EXPIRED)
            return
        held, done = self._holds.get(d.key), self._finished.get(d.key)
        runs = self._cached_runs(done) if done is not None else ()
        if held is not None and (done is None or done.version == held.version or not any(runs)):
            held.until_s, held.priority, held.seq = d.until_s, d.priority, self._next()
            self.dirty = True  # an extension: no newer request whose blocks are still cached
            return
        if done is None or not any(runs):
            self._note(d.key, 0, GiveBackReason.NOT_FOUND)
            return
        runs = self._fit(d, runs)
        blocks = tuple(b for run in runs for b in run)
        if not blocks:  # the cap is full of holds that come before this one
            if held is not None:
                self._give_back(d.key, GiveBackReason.CAPPED)
            else:
                self._note(d.key, 0, GiveBackReason.CAPPED)
            return
        # The new reference first, then the old one dropped: blocks both requests share
        # never pass through the free queue.
        self._pool.hold(blocks)
        self._count.add(blocks)
        if held is not None:
            self._pool.give_back(held.blocks, first=False)
            self._count.remove(held.blocks)
        tokens = len(runs[0]) * self._block_sizes[0]
        self._holds[d.key] = _Held(
            d.key, blocks, tokens, d.until_s, d.priority, self._next(), done.version
        )
        self.dirty = True

    def _cached_runs(self, done: _Finished) -> tuple[tuple[object, ...], ...]:
        """Per group, the leading blocks that still carry the hashes they finished with."""
        runs = []
        for group in done.groups:
            run = []
            for block, block_hash in group:
                if not self._pool.is_cached(block, block_hash):
                    break
                run.append(block)
            runs.append(tuple(run))
        return tuple(runs)

    def _fit(
        self, d: RetentionHold, runs: tuple[tuple[object, ...], ...]
    ) -> tuple[tuple[object, ...], ...]:
        """The runs within the cap, counting only the blocks no other hold has (a branch's
        inherited prefix is its parent's room already): holds of no higher priority give
        way first (in order), then the runs are cut to prefixes."""
        others, want, theirs = self._load(d.key, runs)
        for held in self._order():
            if others + want <= self._cap or held.priority > d.priority:
                break
            if held.key != d.key:
                self._give_back(held.key, GiveBackReason.CAPPED)
                others, want, theirs = self._load(d.key, runs)
        room = self._cap - others
        if room >= want:
            return runs
        return tuple(
            prefix_within(run, theirs, max(room, 0) * unheld_blocks(run, theirs) // want)
            for run in runs
        )

    def _load(
        self, key: str, runs: tuple[tuple[object, ...], ...]
    ) -> tuple[int, int, Callable[[object], bool]]:
        """Blocks held by holds other than `key`'s, each once; of the runs' blocks, those
        none of them holds; and whether a block is one they hold."""
        own = self._holds.get(key)
        mine = own.blocks if own is not None else ()
        theirs = self._count.held_besides(mine)
        others = len(self._count) - sum(1 for b in mine if not theirs(b))
        return others, sum(unheld_blocks(run, theirs) for run in runs), theirs

    def _give_back(self, key: str, reason: GiveBackReason, *, first: bool = False) -> None:
        held = self._holds.pop(key, None)
        if held is not None:
            self._count.remove(held.blocks)
            self._pool.give_back(held.blocks, first=first)
            self._note(key, len(held.blocks), reason)

    def _evict_first(
        self, key: str, *, demote: bool = False, keep: int = 0, drop_host: bool = False
    ) -> None:
        """The key's blocks go first in the eviction order (`demote`: once the host tier
        has a copy of them), past the first `keep` (a branch's inherited prefix, released
        as LRU); `drop_host`: their copies leave the host tier too."""
        reason = GiveBackReason.DEMOTED if demote else GiveBackReason.EVICTED
        done = self._finished.pop(key, None)
        hashes = self._host_copies.pop(key, ())  # an earlier eviction's: GPU blocks gone
        self._host_copy_count -= len(hashes)
        if done is not None:
            self._remembered -= sum(len(g) for g in done.groups)
            hashes = tuple(h for g in done.groups for _, h in g) or hashes
        if drop_host:
            self._pool.drop_from_host(hashes[keep:])
        else:  # its host copies stay: a later end of the session drops them
            self._keep_host_copies(key, hashes)
        held = self._holds.pop(key, None)
        if held is not None:
            self._count.remove(held.blocks)
            blocks = tuple(held.blocks)
            if demote:
                self._pool.copy_to_host(blocks, key)
            self._pool.give_back(blocks[:keep], first=False)
            self._pool.give_back(blocks[keep:], first=True)
        elif done is not None:
            blocks = tuple(b for run in self._cached_runs(done) for b in run)
            if demote:
                self._pool.copy_to_host(blocks, key)
            self._pool.evict_first(blocks[keep:])
        else:
            return
        self._note(key, len(blocks), reason)

    def _keep_host_copies(self, key: str, hashes: tuple[object, ...]) -> None:
        """Remembers the key's hashes, at most as many in all as the host tier holds
        (oldest keys first out; none without a host tier)."""
        room = self._pool.host_blocks()[0]
        if not hashes or len(hashes) > room:
            return
        self._host_copies[key] = hashes
        self._host_copy_count += len(hashes)
        while self._host_copy_count > room:
            _, old = self._host_copies.popitem(last=False)
            self._host_copy_count -= len(old)

    def _note(self, key: str, blocks: int, reason: GiveBackReason) -> None:
        self._given_back.append(GivenBack(key, blocks, reason))
        self.dirty = True
