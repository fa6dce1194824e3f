"""The GPU's paged KV blocks: a fixed pool, a hash map of cached blocks, an eviction queue.

Model of the world (vLLM 0.32 `v1/core/block_pool.py` and `kv_cache_utils.py`, one KV-cache
group, full attention): block 0 is the null block and is never handed out. Every other block
is either held by running requests (ref_cnt > 0) or sits in the free queue. A full block
that a request computed keeps its hash after the request lets go, so it stays findable in
the hash map until the pool hands it out again; only that reuse evicts it (BlockRemoved).
The free queue is the eviction order: its head goes first. Blocks a request frees go in
reverse order (its tail block first); uncached ones are prepended (reused first, LIFO),
cached ones appended (evicted last, so the queue is LRU). Events are recorded where the
change happens and taken once per step.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from itertools import takewhile

from appliance.domain.block_hash import BlockHash, event_block_hash
from appliance.domain.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent

FULL_ATTENTION = "full_attention"
"""The `kv_cache_spec_kind` vLLM stamps on BlockStored for a full-attention group."""


class Block:
    """One KV block's bookkeeping. Mutated only by the pool and its free queue."""

    __slots__ = ("block_hash", "block_id", "is_null", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        self.is_null = False

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:8] if self.block_hash else None
        return f"Block({self.block_id}, ref={self.ref_cnt}, hash={h})"


class FreeBlockQueue:
    """Free blocks in eviction order: the head is handed out (and evicted) first.

    Starts ordered by block id; the pool decides where freed blocks go (`prepend_n` to be
    reused first, `append_n` to be evicted last). `remove` takes a block out of the middle
    when a cache hit revives it. All operations are O(1) per block.
    """

    __slots__ = ("_queue",)

    def __init__(self, blocks: Iterable[Block]) -> None:
        self._queue: OrderedDict[int, Block] = OrderedDict((b.block_id, b) for b in blocks)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Block]:
        return iter(self._queue.values())

    def __contains__(self, block: Block) -> bool:
        return block.block_id in self._queue

    def popleft(self) -> Block:
        if not self._queue:
            raise ValueError("No free blocks available")
        return self._queue.popitem(last=False)[1]

    def popleft_n(self, n: int) -> list[Block]:
        if n > len(self._queue):
            raise ValueError(f"cannot pop {n} of {len(self._queue)} free blocks")
        return [self._queue.popitem(last=False)[1] for _ in range(n)]

    def remove(self, block: Block) -> None:
        del self._queue[block.block_id]

    def append_n(self, blocks: Iterable[Block]) -> None:
        for block in blocks:
            self._queue[block.block_id] = block

    def prepend_n(self, blocks: Sequence[Block]) -> None:
        """Put `blocks` at the head, keeping their order (blocks[0] becomes the head)."""
        for block in reversed(blocks):
            self._queue[block.block_id] = block
            self._queue.move_to_end(block.block_id, last=False)


class BlockPool:
    """A fixed set of blocks with prefix caching and KV events for one full-attention group.

    `num_blocks` includes the null block, as vLLM's `num_gpu_blocks` does.
    """

    def __init__(
        self,
        num_blocks: int,
        *,
        enable_caching: bool = True,
        enable_events: bool = True,
        medium: str = "GPU",
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1 (the null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.enable_events = enable_events
        self.medium = medium
        self.blocks = tuple(Block(i) for i in range(num_blocks))
        self.free_queue = FreeBlockQueue(self.blocks)
        # hash -> {block_id: block}, in insertion order. vLLM does not de-duplicate: two
        # requests that compute the same block at once both cache it under one hash.
        self._cached: dict[BlockHash, dict[int, Block]] = {}
        self._first: dict[BlockHash, int] = {}  # hash -> its first-cached block's id
        self.null_block = self.free_queue.popleft()
        self.null_block.is_null = True
        self._events: list[KvEvent] = []

    # --- queries ---

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def has_events(self) -> bool:
        return bool(self._events)

    @property
    def usage(self) -> float:
        """Fraction of usable blocks held by requests (vLLM `get_usage`: the null block is
        left out; cached blocks in the free queue count as free)."""
        usable = self.num_blocks - 1
        return 0.0 if usable == 0 else 1.0 - self.num_free_blocks / usable

    @property
    def cached_hashes(self) -> int:
        """How many hashes the pool has cached blocks of (about its cached blocks)."""
        return len(self._first)

    def get_cached_block(self, block_hash: BlockHash) -> Block | None:
        """The first-cached block with this hash, if any."""
        block_id = self._first.get(block_hash)
        return self.blocks[block_id] if block_id is not None else None

    def cached_prefix(self, block_hashes: Iterable[BlockHash]) -> list[int]:
        """The first-cached block of each of the leading `block_hashes` that are cached
        (`get_cached_block` of each in turn, up to the first miss), by id."""
        first = self._first
        return list(map(first.__getitem__, takewhile(first.__contains__, block_hashes)))

    def cached_entries(self) -> Iterator[tuple[BlockHash, int]]:
        """(hash, block id) of every entry in the hash map."""
        for block_hash, blocks in self._cached.items():
            for block_id in blocks:
                yield block_hash, block_id

    # --- changes ---

    def get_new_blocks(self, n: int) -> list[Block]:
        """Hand out `n` blocks from the head of the free queue, evicting any cached ones."""
        if n > self.num_free_blocks:
            raise ValueError(f"Cannot get {n} free blocks from the pool")
        blocks = self.free_queue.popleft_n(n)
        caching = self.enable_caching
        for block in blocks:
            if caching and block.block_hash is not None:
                self._evict(block)
            assert block.ref_cnt == 0, block
            block.ref_cnt = 1
        return blocks

    def touch(self, blocks: Iterable[Block]) -> None:
        """Take a reference on cache-hit blocks, reviving those in the free queue."""
        for block in blocks:
            if block.ref_cnt == 0 and not block.is_null:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered: Iterable[Block], *, first: bool = False) -> None:
        """Drop one reference on each block; `ordered` lists them in eviction priority.
        With `first`, every block nobody holds any more goes to the head of the free queue,
        cached or not (evicted before any other; not something vLLM itself does)."""
        evict_first: list[Block] = []
        evict_last: list[Block] = []
        for block in ordered:
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0 or block.is_null, block
            if block.ref_cnt == 0 and not block.is_null:
                if first or block.block_hash is None or not self.enable_caching:
                    evict_first.append(block)
                else:
                    evict_last.append(block)
        self.free_queue.prepend_n(evict_first)
        self.free_queue.append_n(evict_last)

    def evict_cached(self, blocks: Iterable[Block]) -> int:
        """Forget the hash of each block nobody holds (BlockRemoved); returns how many."""
        n = 0
        for block in blocks:
            if block.ref_cnt == 0 and block.block_hash is not None and not block.is_null:
                self._evict(block)
                n += 1
        return n

    def cache_full_blocks(
        self,
        blocks: Sequence[Block],
        block_hashes: Sequence[BlockHash],
        num_cached_blocks: int,
        num_full_blocks: int,
        *,
        block_size: int,
        token_ids: Sequence[int],
        extra_keys: Sequence[tuple[str, ...] | None],
        session_id: str | None = None,
        lora_id: int | None = None,
        lora_name: str | None = None,
    ) -> None:
        """Enter blocks [num_cached_blocks, num_full_blocks) of a request into the hash map.

        `token_ids` is the request's whole token list and `extra_keys` the event form of
        each new block's extra keys. Emits one BlockStored for the run.
        """
        if num_cached_blocks >= num_full_blocks:
            return
        cached, first = self._cached, self._first
        new = block_hashes[num_cached_blocks:num_full_blocks]
        for block, block_hash in zip(blocks[num_cached_blocks:num_full_blocks], new, strict=True):
            if block.is_null or block.block_hash == block_hash:
                continue
            assert block.block_hash is None, f"{block} already cached under another hash"
            block.block_hash = block_hash
            entry = cached.get(block_hash)
            if entry is None:  # (a hash is in `_first` exactly while it is in `_cached`)
                cached[block_hash] = {block.block_id: block}
                first[block_hash] = block.block_id
            else:
                entry[block.block_id] = block
        if not self.enable_events:
            return
        parent = block_hashes[num_cached_blocks - 1] if num_cached_blocks else None
        start, end = num_cached_blocks * block_size, num_full_blocks * block_size
        self._events.append(
            BlockStored(
                block_hashes=tuple(map(event_block_hash, new)),
                parent_block_hash=event_block_hash(parent) if parent is not None else None,
                token_ids=tuple(token_ids[start:end]),
                block_size=block_size,
                medium=self.medium,
                lora_id=lora_id,
                lora_name=lora_name,
                extra_keys=tuple(extra_keys),
                group_idx=0,
                kv_cache_spec_kind=FULL_ATTENTION,
                session_id=session_id,
            )
        )

    def emit_cached_block_events(
        self,
        block_hashes: Sequence[BlockHash],
        *,
        block_size: int,
        token_ids: Sequence[int],
        extra_keys: Sequence[tuple[str, ...] | None],
        session_id: str | None = None,
        lora_id: int | None = None,
        lora_name: str | None = None,
    ) -> None:
        """Report a reused prefix (kv_cache_report_mode "full"): a BlockStored from token 0
        with no parent, changing nothing."""
        if not self.enable_events or not block_hashes:
            return
        self._events.append(
            BlockStored(
                block_hashes=tuple(event_block_hash(h) for h in block_hashes),
                parent_block_hash=None,
                token_ids=tuple(token_ids[: len(block_hashes) * block_size]),
                block_size=block_size,
                medium=self.medium,
                lora_id=lora_id,
                lora_name=lora_name,
                extra_keys=tuple(extra_keys),
                group_idx=0,
                kv_cache_spec_kind=FULL_ATTENTION,
                session_id=session_id,
            )
        )

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; refused (False) while any request holds a block."""
        if self.num_blocks - self.num_free_blocks != 1:  # the null block is always "used"
            return False
        self._cached = {}
        self._first = {}
        for block in self.blocks:
            block.block_hash = None
        if self.enable_events:
            self._events.append(AllBlocksCleared())
        return True

    def take_events(self) -> list[KvEvent]:
        """The events since the last call, oldest first."""
        events, self._events = self._events, []
        return events

    def _evict(self, block: Block) -> None:
        block_hash = block.block_hash
        if block_hash is None:
            return
        block.block_hash = None
        entry = self._cached.get(block_hash)
        if entry is None or entry.pop(block.block_id, None) is None:
            return
        if not entry:
            del self._cached[block_hash]
            del self._first[block_hash]
        elif self._first[block_hash] == block.block_id:
            self._first[block_hash] = next(iter(entry))
        if self.enable_events:
            self._events.append(
                BlockRemoved(
                    block_hashes=(event_block_hash(block_hash),),
                    medium=self.medium,
                    group_idx=0,
                )
            )
