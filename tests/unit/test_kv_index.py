"""The KV index: residency per worker and tier from events, leading-prefix lookups."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from appliance.domain.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvEvent,
    KvEventBatch,
)
from appliance.domain.kv_index import KvIndex, leading_blocks
from appliance.domain.records import WorkerId

W0, W1, W2 = WorkerId("w0"), WorkerId("w1"), WorkerId("w2")


def stored(*hashes: int, parent: int | None = None, medium: str | None = "GPU", session=None):
    return BlockStored(
        block_hashes=hashes,
        parent_block_hash=parent,
        token_ids=tuple(range(4 * len(hashes))),
        block_size=4,
        medium=medium,
        session_id=session,
    )


def removed(*hashes: int, medium: str | None = "GPU") -> BlockRemoved:
    return BlockRemoved(block_hashes=hashes, medium=medium)


@dataclass(frozen=True)
class Case:
    name: str
    events: list[tuple[WorkerId, KvEvent]]
    chain: tuple[int, ...]
    expected: dict[WorkerId, int]
    medium: str | None = None


CASES = [
    Case("empty index", [], (1, 2, 3), {}),
    Case("empty chain", [(W0, stored(1, 2))], (), {}),
    Case("whole chain on one worker", [(W0, stored(1, 2, 3))], (1, 2, 3), {W0: 3}),
    Case("chain longer than resident", [(W0, stored(1, 2))], (1, 2, 3, 4), {W0: 2}),
    Case("first block missing: no match", [(W0, stored(2, 3))], (1, 2, 3), {}),
    Case(
        "match stops at the first miss",
        [(W0, stored(1)), (W0, stored(3, parent=2))],
        (1, 2, 3),
        {W0: 1},
    ),
    Case(
        "two workers, different depths",
        [(W0, stored(1, 2, 3)), (W1, stored(1))],
        (1, 2, 3),
        {W0: 3, W1: 1},
    ),
    Case(
        "eviction in the middle cuts the prefix",
        [(W0, stored(1, 2, 3)), (W0, removed(2))],
        (1, 2, 3),
        {W0: 1},
    ),
    Case(
        "stored twice, removed once: still resident",
        [(W0, stored(1, 2)), (W0, stored(1, 2)), (W0, removed(1, 2))],
        (1, 2),
        {W0: 2},
    ),
    Case(
        "stored twice, removed twice: gone",
        [(W0, stored(1)), (W0, stored(1)), (W0, removed(1)), (W0, removed(1))],
        (1,),
        {},
    ),
    Case("removal of an unknown block is ignored", [(W0, removed(9))], (9,), {}),
    Case(
        "removal on another worker does not touch this one",
        [(W0, stored(1)), (W1, stored(1)), (W1, removed(1))],
        (1,),
        {W0: 1},
    ),
    Case(
        "all blocks cleared on one worker",
        [(W0, stored(1, 2)), (W1, stored(1, 2)), (W0, AllBlocksCleared())],
        (1, 2),
        {W1: 2},
    ),
    Case(
        "tiers: any tier counts by default",
        [(W0, stored(1)), (W0, stored(2, parent=1, medium="CPU"))],
        (1, 2),
        {W0: 2},
    ),
    Case(
        "tiers: GPU only",
        [(W0, stored(1)), (W0, stored(2, parent=1, medium="CPU"))],
        (1, 2),
        {W0: 1},
        medium="GPU",
    ),
    Case(
        "removal from CPU keeps the GPU copy",
        [(W0, stored(1)), (W0, stored(1, medium="CPU")), (W0, removed(1, medium="CPU"))],
        (1,),
        {W0: 1},
        medium="GPU",
    ),
    Case("missing medium reads as GPU", [(W0, stored(1, medium=None))], (1,), {W0: 1}, "GPU"),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_lookup(case: Case) -> None:
    index = KvIndex()
    for worker, event in case.events:
        index.apply(worker, event)
    assert index.lookup(case.chain, medium=case.medium) == case.expected


def test_batch_parents_sessions_and_counts() -> None:
    index = KvIndex()
    batch = KvEventBatch(
        seq=0,
        ts=0.0,
        events=(stored(10, 11, session="s1"), stored(12, parent=11, session="s2")),
    )
    index.apply_batch(W0, batch)
    index.apply(W1, stored(10, session="s2"))
    assert [index.parent(h) for h in (10, 11, 12)] == [None, 10, 11]
    assert index.sessions(10) == {"s1", "s2"}
    # A session's blocks count wherever their content is, whoever stored that copy.
    assert index.session_blocks("s1") == {W0: 2, W1: 1}
    assert index.session_blocks("s2") == {W0: 2, W1: 1}
    assert index.worker_blocks(W0) == 3 and index.worker_blocks(W1) == 1
    assert index.media(10) == {W0: frozenset({"GPU"}), W1: frozenset({"GPU"})}
    assert index.workers() == {W0, W1}
    assert len(index) == 3 and 12 in index

    index.apply(W0, removed(10, 11))
    assert index.session_blocks("s1") == {W1: 1}
    assert index.sessions(11) == frozenset()  # gone everywhere: nothing kept
    assert index.parent(10) is None and 10 in index  # still on W1
    assert index.stats().removed == 2


def test_forget_worker_drops_only_that_worker() -> None:
    index = KvIndex()
    index.apply(W0, stored(1, 2, session="s"))
    index.apply(W0, stored(3, parent=2, medium="CPU"))
    index.apply(W1, stored(1))
    assert index.forget_worker(W0) == 3
    assert index.hashes() == {1}
    assert index.lookup((1, 2)) == {W1: 1}
    assert index.session_blocks("s") == {W1: 1}  # the content of block 1, held by W1
    assert index.forget_worker(W2) == 0  # unknown worker: nothing to do
    index.apply(W0, removed(1))  # stale removal after a forget is ignored
    assert index.stats().unknown_removals == 1
    assert index.lookup((1,)) == {W1: 1}


# --- invariants against a model: a multiset of (worker, medium, hash) ---

WORKERS = st.sampled_from([W0, W1, W2])
HASHES = st.integers(0, 7)
MEDIA = st.sampled_from(["GPU", "CPU"])
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("store"), WORKERS, MEDIA, st.lists(HASHES, min_size=1, max_size=4)),
        st.tuples(st.just("remove"), WORKERS, MEDIA, st.lists(HASHES, min_size=1, max_size=4)),
        st.tuples(st.just("forget"), WORKERS, MEDIA, st.just([])),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(ops=OPS, chain=st.lists(HASHES, max_size=8))
def test_index_matches_a_reference_multiset(ops, chain) -> None:
    index = KvIndex()
    model: dict[tuple[WorkerId, str, int], int] = {}
    for op, worker, medium, hashes in ops:
        if op == "store":
            index.apply(worker, stored(*hashes, medium=medium))
            for h in hashes:
                model[(worker, medium, h)] = model.get((worker, medium, h), 0) + 1
        elif op == "remove":
            index.apply(worker, removed(*hashes, medium=medium))
            for h in hashes:
                if model.get((worker, medium, h), 0) > 0:
                    model[(worker, medium, h)] -= 1
        else:
            index.forget_worker(worker)
            model = {k: v for k, v in model.items() if k[0] != worker}
    live = {k for k, v in model.items() if v > 0}

    for medium in (None, "GPU", "CPU"):
        expected = {}
        for worker in (W0, W1, W2):
            resident = {h for (w, m, h) in live if w == worker and medium in (None, m)}
            n = leading_blocks(chain, resident)
            if n:
                expected[worker] = n
        assert index.lookup(chain, medium=medium) == expected
    assert index.hashes() == {h for (_, _, h) in live}
    for worker in (W0, W1, W2):
        assert index.hashes(worker) == {h for (w, _, h) in live if w == worker}
        for medium in ("GPU", "CPU"):
            for h in range(8):
                assert index.refs(worker, h, medium) == model.get((worker, medium, h), 0)


def test_blocks_add_nothing_for_the_cyclic_collector_to_walk() -> None:
    """A full collection walks every object the collector tracks: an index of a few
    hundred thousand blocks must not make each one tens of milliseconds long."""
    import gc

    index = KvIndex()
    index.apply(W0, stored(1, session="warm"))  # the per-worker and per-session sets
    index.apply(W1, stored(1, medium="CPU", session="warm"))
    gc.collect()
    before = len(gc.get_objects())
    for start in range(2, 20_002, 100):
        index.apply(W0, stored(*range(start, start + 100), parent=start - 1, session="warm"))
        index.apply(W1, stored(*range(start, start + 100), medium="CPU", session="other"))
    index.apply(W0, removed(*range(2, 5_000)))
    gc.collect()
    assert len(index) == 20_001
    assert len(gc.get_objects()) - before < 50
    # Nor does a full collection walk a session's hashes item by item.
    assert not any(map(gc.is_tracked, index._by_session.values()))
