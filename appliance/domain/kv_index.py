"""Which KV blocks are resident on which worker, learned from the workers' KV events.

Model of the world: every worker publishes BlockStored when a full block enters its prefix
cache and BlockRemoved when it is evicted; the index replays those events per worker. A
block is a 64-bit hash (the event form) that names its whole prefix, so a prompt's chain of
block hashes matches a worker for as many *leading* blocks as it holds in a row: the match
stops at the first miss, even if later blocks are resident (vLLM reuses a prefix only).

A hash may be announced more than once on one worker and tier (two physical copies from
concurrent requests, a connector re-announcing offloaded chunks); each announcement is a
reference and the block stays resident until as many removals arrived. A removal of an
unknown block is counted and ignored. Tiers are the event's `medium` ("GPU" when absent);
`lookup` counts a block on any tier unless asked for one. AllBlocksCleared, a restart or a
lost event forgets everything of that worker (`forget_worker`): a stale index may cost a
cache hit, but must not claim blocks that are gone. Each forget starts a new *generation* of
the worker's cache (`generation`, 0 until the first): a cache receipt names the generation
it was made in, and one of an older generation than the worker's now is stale, whatever it
says. A new index (a restarted appliance, whose subscribers start a fresh event stream)
continues from the generations its caller last recorded (`start_generations`).

Where a block is, is all it keeps: an event's parent and session (vLLM 0.32 sends both) are
not, as nothing routes by them and each was a map more per block announced and dropped: a
third of the index's time in a replay. Pure and single-threaded: callers that feed it from
several threads hold one lock around it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import takewhile

from appliance.domain.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvEvent,
    KvEventBatch,
    Medium,
)
from appliance.domain.records import WorkerId

DEFAULT_MEDIUM = Medium.GPU.value
MAX_SLOTS = 256
"""(worker, tier) pairs one index tells apart: far more than a box has."""


@dataclass(frozen=True, slots=True)
class IndexStats:
    blocks: int
    """Distinct hashes resident somewhere."""
    stored: int
    removed: int
    unknown_removals: int
    forgotten_workers: int


class KvIndex:
    """Residency of block hashes per worker and tier.

    Held in dicts of ints only (and one set of hashes per worker, for the lookup's one C
    call per chain): a dict of ints is never tracked by Python's cyclic collector, so the
    index adds nothing to the collections that would otherwise walk every block of every
    worker, tens of milliseconds on the event loop at a few hundred thousand blocks. A
    (worker, tier) pair is a small `slot` number; `_where` holds per hash the bit mask of
    the slots holding it, `_refs` the announcements per (hash, slot)."""

    def __init__(self) -> None:
        self._slot_of: dict[tuple[WorkerId, str], int] = {}
        self._slots: list[tuple[WorkerId, str]] = []
        self._where: dict[int, int] = {}
        self._refs: dict[int, int] = {}
        """`_ref_key(h, slot)` -> announcements not yet removed."""
        self._by_worker: dict[WorkerId, set[int]] = {}
        self._stored = 0
        self._removed = 0
        self._unknown_removals = 0
        self._forgotten = 0
        self._losses: dict[WorkerId, int] = {}
        self._generations: dict[WorkerId, int] = {}
        self._masks: dict[WorkerId, int] = {}
        """Each worker's slots as a bit mask, kept while no slot is added."""

    def _slot(self, worker: WorkerId, medium: str) -> int:
        slot = self._slot_of.get((worker, medium))
        if slot is None:
            if len(self._slots) == MAX_SLOTS:
                raise ValueError(f"more than {MAX_SLOTS} (worker, tier) pairs in one index")
            slot = self._slot_of[(worker, medium)] = len(self._slots)
            self._slots.append((worker, medium))
            self._masks.clear()
        return slot

    def _worker_mask(self, worker: WorkerId) -> int:
        mask = self._masks.get(worker)
        if mask is None:
            mask = sum(1 << i for i, (w, _) in enumerate(self._slots) if w == worker)
            # Equivalent mutants on the next line: without the cache the mask is recomputed.
            self._masks[worker] = mask  # pragma: no mutate (equivalent)
        return mask

    def _medium_mask(self, medium: str | None) -> int:
        if medium is None:
            return -1  # every slot
        return sum(1 << i for i, (_, m) in enumerate(self._slots) if m == medium)

    # --- feeding ---

    def apply_batch(self, worker: WorkerId, batch: KvEventBatch) -> None:
        for event in batch.events:
            self.apply(worker, event)

    def apply(self, worker: WorkerId, event: KvEvent) -> None:
        if isinstance(event, BlockStored):
            self._store(worker, event)
        elif isinstance(event, BlockRemoved):
            slot = self._slot(worker, event.medium or DEFAULT_MEDIUM)
            for h in event.block_hashes:
                self._remove(worker, slot, h)
        elif isinstance(event, AllBlocksCleared):
            self.forget_worker(worker)

    def _store(self, worker: WorkerId, event: BlockStored) -> None:
        slot = self._slot(worker, event.medium or DEFAULT_MEDIUM)
        bit = 1 << slot
        where, refs = self._where, self._refs
        for h in event.block_hashes:
            where[h] = where.get(h, 0) | bit
            key = _ref_key(h, slot)
            refs[key] = refs.get(key, 0) + 1
        self._by_worker.setdefault(worker, set()).update(event.block_hashes)
        self._stored += len(event.block_hashes)

    def _remove(self, worker: WorkerId, slot: int, h: int) -> None:
        key = _ref_key(h, slot)
        count = self._refs.get(key, 0)
        if count == 0:
            self._unknown_removals += 1
            return
        self._removed += 1
        if count > 1:
            self._refs[key] = count - 1
            return
        del self._refs[key]
        self._clear(worker, h, 1 << slot)

    def _clear(self, worker: WorkerId, h: int, bits: int) -> None:
        """`h` leaves the slots in `bits` (all of them `worker`'s)."""
        where = self._where[h] & ~bits
        self._losses[worker] = self._losses.get(worker, 0) + 1
        if where & self._worker_mask(worker) == 0:
            self._by_worker[worker].discard(h)
        if where:
            self._where[h] = where
        else:
            del self._where[h]

    def forget_worker(self, worker: WorkerId) -> int:
        """Drops every block the worker held, on every tier; returns how many hashes."""
        held = self._by_worker.pop(worker, set())
        self._losses[worker] = self._losses.get(worker, 0) + 1
        mask = self._worker_mask(worker)
        slots = [i for i, (w, _) in enumerate(self._slots) if w == worker]
        for h in held:
            for slot in slots:
                self._refs.pop(_ref_key(h, slot), None)
            where = self._where[h] & ~mask
            if where:
                self._where[h] = where
            else:
                del self._where[h]
        self._forgotten += 1
        self._generations[worker] = self._generations.get(worker, 0) + 1
        return len(held)

    def generation(self, worker: WorkerId) -> int:
        """How many times the worker's cache is known to have been reset (AllBlocksCleared, a
        restart, lost events, the worker lost): everything of an older generation is gone."""
        return self._generations.get(worker, 0)

    def start_generations(self, last: Mapping[WorkerId, int]) -> None:
        """A fresh index over workers whose generation was `last` when the previous one
        stopped: each continues from a generation after it (what the previous index knew
        is gone), never below one this index has reached already."""
        for worker, gen in last.items():
            self._generations[worker] = max(self.generation(worker), gen + 1)

    # --- reading ---

    def lookup(self, chain: Sequence[int], *, medium: str | None = None) -> dict[WorkerId, int]:
        """Per worker, how many leading blocks of `chain` it holds (on `medium`, or any tier).

        Workers holding not even the first block are left out.
        """
        first = self._where.get(chain[0], 0) if chain else 0
        return {w: self._leading(w, chain, medium) for w in self._holders(first, medium)}

    def _leading(self, worker: WorkerId, chain: Sequence[int], medium: str | None) -> int:
        """How many leading blocks of `chain` the worker holds (the router's hot path: one
        set probe per block)."""
        # Equivalent mutants on the next two lines and in `_only_slot`: without the shortcut
        # the probe below gives the same answer, per block.
        if medium is not None and self._only_slot(worker, medium):  # pragma: no mutate
            medium = None  # pragma: no mutate (the worker has no other tier: its set answers)
        if medium is None:
            # Equivalent mutants on the next line: lookup asks only holders, always keys of
            # `_by_worker`, so the default is never used.
            held = self._by_worker.get(worker, set())  # pragma: no mutate (equivalent)
            return len(list(takewhile(held.__contains__, chain)))  # one set probe each, in C
        bit = 1 << self._slot(worker, medium)
        where = self._where
        for i, h in enumerate(chain):
            if not where.get(h, 0) & bit:
                return i
        return len(chain)

    def _only_slot(self, worker: WorkerId, medium: str) -> bool:
        """Whether (worker, medium) is the worker's one tier."""
        slot = self._slot_of.get((worker, medium))  # pragma: no mutate
        return slot is not None and self._worker_mask(worker) == 1 << slot  # pragma: no mutate

    def losses(self, worker: WorkerId) -> int:
        """How often the worker lost blocks (a removal on any tier, a forget): while it
        stays the same, no lookup on that worker answers less than before."""
        return self._losses.get(worker, 0)

    def _holders(self, where: int, medium: str | None) -> set[WorkerId]:
        """The workers among the slots in the mask `where` (on `medium`, or any tier)."""
        where &= self._medium_mask(medium)
        return {w for i, (w, _) in enumerate(self._slots) if where >> i & 1}

    def resident(self, worker: WorkerId, h: int, *, medium: str | None = None) -> bool:
        return worker in self._holders(self._where.get(h, 0), medium)

    def media(self, h: int) -> Mapping[WorkerId, frozenset[str]]:
        """Where one block is: worker -> tiers."""
        where = self._where.get(h, 0)
        out: dict[WorkerId, set[str]] = {}
        for i, (w, m) in enumerate(self._slots):
            if where >> i & 1:
                out.setdefault(w, set()).add(m)
        return {w: frozenset(ms) for w, ms in out.items()}

    def refs(self, worker: WorkerId, h: int, medium: str = DEFAULT_MEDIUM) -> int:
        slot = self._slot_of.get((worker, medium))
        return self._refs.get(_ref_key(h, slot), 0) if slot is not None else 0

    def worker_blocks(self, worker: WorkerId, *, medium: str | None = None) -> int:
        held = self._by_worker.get(worker, set())
        if medium is None:
            return len(held)
        bit = 1 << self._slot(worker, medium)
        return sum(1 for h in held if self._where[h] & bit)

    def workers(self) -> frozenset[WorkerId]:
        return frozenset(w for w, held in self._by_worker.items() if held)

    def hashes(self, worker: WorkerId | None = None) -> frozenset[int]:
        if worker is None:
            return frozenset(self._where)
        return frozenset(self._by_worker.get(worker, ()))

    def stats(self) -> IndexStats:
        return IndexStats(
            blocks=len(self._where),
            stored=self._stored,
            removed=self._removed,
            unknown_removals=self._unknown_removals,
            forgotten_workers=self._forgotten,
        )

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, h: object) -> bool:
        return h in self._where


def _ref_key(h: int, slot: int) -> int:
    """One int for (hash, slot), for any int hash (`slot < MAX_SLOTS`)."""
    return h << 8 | slot  # pragma: no mutate (equivalent: any shift >= 8 keeps the keys distinct)


def leading_blocks(chain: Iterable[int], resident: set[int]) -> int:
    """How many leading hashes of `chain` are in `resident` (a reference for tests)."""
    n = 0
    for h in chain:
        if h not in resident:
            break
        n += 1
    return n
