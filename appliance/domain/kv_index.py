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
cache hit, but must not claim blocks that are gone.

Per hash the index keeps its parent (the previous block of the chain that announced it) and
the sessions whose requests stored it, while any worker holds it. Pure and single-threaded:
callers that feed it from several threads hold one lock around it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

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


@dataclass(slots=True)
class _Block:
    refs: dict[tuple[WorkerId, str], int] = field(default_factory=dict)
    """(worker, medium) -> announcements not yet removed."""
    parent: int | None = None
    sessions: set[str] = field(default_factory=set)


@dataclass(frozen=True, slots=True)
class IndexStats:
    blocks: int
    """Distinct hashes resident somewhere."""
    stored: int
    removed: int
    unknown_removals: int
    forgotten_workers: int


class KvIndex:
    """Residency of block hashes per worker and tier."""

    def __init__(self) -> None:
        self._blocks: dict[int, _Block] = {}
        self._by_worker: dict[WorkerId, set[int]] = {}
        self._by_session: dict[str, set[int]] = {}
        self._stored = 0
        self._removed = 0
        self._unknown_removals = 0
        self._forgotten = 0

    # --- feeding ---

    def apply_batch(self, worker: WorkerId, batch: KvEventBatch) -> None:
        for event in batch.events:
            self.apply(worker, event)

    def apply(self, worker: WorkerId, event: KvEvent) -> None:
        if isinstance(event, BlockStored):
            self._store(worker, event)
        elif isinstance(event, BlockRemoved):
            medium = event.medium or DEFAULT_MEDIUM
            for h in event.block_hashes:
                self._remove(worker, medium, h)
        elif isinstance(event, AllBlocksCleared):
            self.forget_worker(worker)

    def _store(self, worker: WorkerId, event: BlockStored) -> None:
        medium = event.medium or DEFAULT_MEDIUM
        key = (worker, medium)
        parent = event.parent_block_hash
        held = self._by_worker.setdefault(worker, set())
        for h in event.block_hashes:
            block = self._blocks.get(h)
            if block is None:
                block = self._blocks[h] = _Block(parent=parent)
            elif block.parent is None and parent is not None:
                block.parent = parent
            block.refs[key] = block.refs.get(key, 0) + 1
            if event.session_id:
                block.sessions.add(event.session_id)
                self._by_session.setdefault(event.session_id, set()).add(h)
            held.add(h)
            self._stored += 1
            parent = h

    def _remove(self, worker: WorkerId, medium: str, h: int) -> None:
        block = self._blocks.get(h)
        key = (worker, medium)
        count = block.refs.get(key, 0) if block is not None else 0
        if block is None or count == 0:
            self._unknown_removals += 1
            return
        self._removed += 1
        if count > 1:
            block.refs[key] = count - 1
            return
        del block.refs[key]
        if not any(w == worker for w, _ in block.refs):
            self._by_worker[worker].discard(h)
        if not block.refs:
            self._drop(h, block)

    def _drop(self, h: int, block: _Block) -> None:
        del self._blocks[h]
        for session in block.sessions:
            hashes = self._by_session[session]
            hashes.discard(h)
            if not hashes:
                del self._by_session[session]

    def forget_worker(self, worker: WorkerId) -> int:
        """Drops every block the worker held, on every tier; returns how many hashes."""
        held = self._by_worker.pop(worker, set())
        for h in held:
            block = self._blocks[h]
            for key in [k for k in block.refs if k[0] == worker]:
                del block.refs[key]
            if not block.refs:
                self._drop(h, block)
        self._forgotten += 1
        return len(held)

    # --- reading ---

    def lookup(self, chain: Sequence[int], *, medium: str | None = None) -> dict[WorkerId, int]:
        """Per worker, how many leading blocks of `chain` it holds (on `medium`, or any tier).

        Workers holding not even the first block are left out.
        """
        first = self._blocks.get(chain[0]) if chain else None
        if first is None:
            return {}
        return {w: self._leading(w, chain, medium) for w in self._holders(first, medium)}

    def _leading(self, worker: WorkerId, chain: Sequence[int], medium: str | None) -> int:
        """How many leading blocks of `chain` the worker holds (the router's hot path: one
        set probe per block)."""
        if medium is None:
            held = self._by_worker.get(worker, set())
            if held.issuperset(chain):  # the usual answer at a session's home, in C
                return len(chain)
            for i, h in enumerate(chain):
                if h not in held:
                    return i
            return len(chain)
        key = (worker, medium)
        blocks = self._blocks
        for i, h in enumerate(chain):
            block = blocks.get(h)
            if block is None or key not in block.refs:
                return i
        return len(chain)

    @staticmethod
    def _holders(block: _Block, medium: str | None) -> set[WorkerId]:
        return {w for (w, m) in block.refs if medium is None or m == medium}

    def resident(self, worker: WorkerId, h: int, *, medium: str | None = None) -> bool:
        block = self._blocks.get(h)
        return block is not None and worker in self._holders(block, medium)

    def media(self, h: int) -> Mapping[WorkerId, frozenset[str]]:
        """Where one block is: worker -> tiers."""
        block = self._blocks.get(h)
        out: dict[WorkerId, set[str]] = {}
        for w, m in block.refs if block is not None else ():
            out.setdefault(w, set()).add(m)
        return {w: frozenset(ms) for w, ms in out.items()}

    def refs(self, worker: WorkerId, h: int, medium: str = DEFAULT_MEDIUM) -> int:
        block = self._blocks.get(h)
        return block.refs.get((worker, medium), 0) if block is not None else 0

    def parent(self, h: int) -> int | None:
        block = self._blocks.get(h)
        return block.parent if block is not None else None

    def sessions(self, h: int) -> frozenset[str]:
        block = self._blocks.get(h)
        return frozenset(block.sessions) if block is not None else frozenset()

    def worker_blocks(self, worker: WorkerId, *, medium: str | None = None) -> int:
        held = self._by_worker.get(worker, set())
        if medium is None:
            return len(held)
        return sum(1 for h in held if (worker, medium) in self._blocks[h].refs)

    def session_blocks(self, session: str, *, medium: str | None = None) -> dict[WorkerId, int]:
        """Per worker, how many resident blocks hold content a session's requests stored
        (a hash names content, so another request's copy of it counts too)."""
        out: dict[WorkerId, int] = {}
        for h in self._by_session.get(session, ()):
            for w in self._holders(self._blocks[h], medium):
                out[w] = out.get(w, 0) + 1
        return out

    def workers(self) -> frozenset[WorkerId]:
        return frozenset(w for w, held in self._by_worker.items() if held)

    def hashes(self, worker: WorkerId | None = None) -> frozenset[int]:
        if worker is None:
            return frozenset(self._blocks)
        return frozenset(self._by_worker.get(worker, ()))

    def stats(self) -> IndexStats:
        return IndexStats(
            blocks=len(self._blocks),
            stored=self._stored,
            removed=self._removed,
            unknown_removals=self._unknown_removals,
            forgotten_workers=self._forgotten,
        )

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, h: object) -> bool:
        return h in self._blocks


def leading_blocks(chain: Iterable[int], resident: set[int]) -> int:
    """How many leading hashes of `chain` are in `resident` (a reference for tests)."""
    n = 0
    for h in chain:
        if h not in resident:
            break
        n += 1
    return n
