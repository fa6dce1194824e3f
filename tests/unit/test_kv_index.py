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
from appliance.domain.kv_index import MAX_SLOTS, IndexStats, KvIndex, leading_blocks
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
    Case(
        "tiers: a block no worker holds ends the match",
        [(W0, stored(1)), (W0, stored(2, medium="CPU"))],
        (1, 9),
        {W0: 1},
        medium="GPU",
    ),
    Case(
        "a tier that joins after a removal still counts as the worker's",
        [
            (W0, stored(2)),
            (W0, removed(2)),
            (W0, stored(1, medium="CPU")),
            (W0, stored(1)),
            (W0, removed(1)),
        ],
        (1,),
        {W0: 1},
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_lookup(case: Case) -> None:
    index = KvIndex()
    for worker, event in case.events:
        index.apply(worker, event)
    assert index.lookup(case.chain, medium=case.medium) == case.expected


def test_batch_and_counts() -> None:
    index = KvIndex()
    batch = KvEventBatch(
        seq=0,
        ts=0.0,
        events=(stored(10, 11, session="s1"), stored(12, parent=11, session="s2")),
    )
    index.apply_batch(W0, batch)
    index.apply(W1, stored(10, session="s2"))
    assert index.lookup((10, 11, 12)) == {W0: 3, W1: 1}
    assert index.stats().stored == 4
    assert index.worker_blocks(W0) == 3 and index.worker_blocks(W1) == 1
    assert index.media(10) == {W0: frozenset({"GPU"}), W1: frozenset({"GPU"})}
    assert index.workers() == {W0, W1}
    assert len(index) == 3 and 12 in index

    index.apply(W0, removed(10, 11))
    assert 11 not in index  # gone everywhere: nothing kept
    assert 10 in index and index.lookup((10,)) == {W1: 1}  # still on W1
    assert index.stats().removed == 2


def test_forget_worker_drops_only_that_worker() -> None:
    index = KvIndex()
    index.apply(W0, stored(1, 2, session="s"))
    index.apply(W0, stored(3, parent=2, medium="CPU"))
    index.apply(W1, stored(1))
    assert index.forget_worker(W0) == 3
    assert index.hashes() == {1}
    assert index.lookup((1, 2)) == {W1: 1}
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
    index.apply(W0, stored(1, session="warm"))  # the per-worker sets
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


# --- counters, reads and edge cases, one behaviour each ---


def test_stats_count_every_block_of_every_announcement_and_removal() -> None:
    index = KvIndex()
    assert index.stats() == IndexStats(
        blocks=0, stored=0, removed=0, unknown_removals=0, forgotten_workers=0
    )
    index.apply(W0, stored(1, 2, 3))
    index.apply(W0, stored(1))  # a second reference to block 1
    index.apply(W1, stored(1, 4, medium="CPU"))
    index.apply(W0, removed(1, 2))  # 1 keeps a reference, 2 is gone
    assert index.stats() == IndexStats(
        blocks=3, stored=6, removed=2, unknown_removals=0, forgotten_workers=0
    )


def test_stats_count_each_unknown_removal() -> None:
    index = KvIndex()
    index.apply(W0, stored(1))
    index.apply(W0, removed(7, 8))
    index.apply(W0, removed(1, medium="CPU"))  # held on GPU only: unknown on CPU
    assert index.stats().unknown_removals == 3
    assert index.stats().removed == 0
    assert index.lookup((1,)) == {W0: 1}


def test_stats_count_each_forgotten_worker_even_an_empty_one() -> None:
    index = KvIndex()
    index.apply(W0, stored(1, 2))
    index.apply(W1, stored(1))
    assert index.forget_worker(W0) == 2
    assert index.forget_worker(W2) == 0
    index.apply(W1, AllBlocksCleared())
    assert index.stats() == IndexStats(
        blocks=0, stored=3, removed=0, unknown_removals=0, forgotten_workers=3
    )


def test_more_than_max_slots_worker_tier_pairs_is_refused_with_a_reason() -> None:
    index = KvIndex()
    for n in range(MAX_SLOTS):
        index.apply(WorkerId(f"w{n}"), stored(n))
    assert len(index) == MAX_SLOTS
    with pytest.raises(ValueError, match=f"more than {MAX_SLOTS} \\(worker, tier\\) pairs"):
        index.apply(WorkerId("one too many"), stored(1))
    # An existing pair still takes events.
    index.apply(W0, stored(0))
    assert index.refs(W0, 0) == 2


def test_removal_from_one_tier_keeps_the_block_on_the_worker_for_any_tier_reads() -> None:
    index = KvIndex()
    index.apply(W0, stored(1, 2))
    index.apply(W0, stored(1, medium="CPU"))
    index.apply(W0, removed(1, medium="CPU"))
    assert index.lookup((1, 2)) == {W0: 2}
    assert index.hashes(W0) == {1, 2}
    assert index.worker_blocks(W0) == 2
    assert index.workers() == {W0}
    index.apply(W0, removed(1))  # the last tier: now gone from the worker
    assert index.hashes(W0) == {2}
    assert index.lookup((1, 2)) == {}


def test_worker_blocks_per_tier() -> None:
    index = KvIndex()
    index.apply(W1, stored(9))  # another worker's slot first
    index.apply(W0, stored(1, 2, 3))
    index.apply(W0, stored(3, 4, medium="CPU"))
    index.apply(W0, stored(5, medium="STORAGE"))
    assert index.worker_blocks(W0) == 5
    assert index.worker_blocks(W0, medium="GPU") == 3
    assert index.worker_blocks(W0, medium="CPU") == 2
    assert index.worker_blocks(W0, medium="STORAGE") == 1
    assert index.worker_blocks(W1, medium="CPU") == 0
    assert index.worker_blocks(W1, medium="GPU") == 1


def test_worker_blocks_of_an_unknown_worker_is_zero() -> None:
    index = KvIndex()
    assert index.worker_blocks(W2) == 0
    index.apply(W0, stored(1))
    assert index.worker_blocks(W2) == 0
    assert index.worker_blocks(W2, medium="GPU") == 0


def test_media_of_a_block_names_only_its_holders_and_their_tiers() -> None:
    index = KvIndex()
    index.apply(W0, stored(1, 2))
    index.apply(W1, stored(2, medium="CPU"))
    index.apply(W0, stored(2, medium="CPU"))
    index.apply(W1, stored(3))
    assert index.media(1) == {W0: frozenset({"GPU"})}
    assert index.media(2) == {W0: frozenset({"GPU", "CPU"}), W1: frozenset({"CPU"})}
    assert index.media(3) == {W1: frozenset({"GPU"})}
    assert index.media(99) == {}  # unknown block


def test_media_of_an_empty_index_is_empty() -> None:
    assert KvIndex().media(1) == {}


def test_resident_per_worker_and_tier() -> None:
    index = KvIndex()
    index.apply(W0, stored(1, 2))
    index.apply(W1, stored(2, medium="CPU"))
    assert index.resident(W0, 1)
    assert index.resident(W0, 2, medium="GPU")
    assert not index.resident(W0, 2, medium="CPU")
    assert index.resident(W1, 2)
    assert index.resident(W1, 2, medium="CPU")
    assert not index.resident(W1, 2, medium="GPU")
    assert not index.resident(W1, 1)
    assert not index.resident(W2, 1)


def test_resident_of_an_unknown_block_is_false() -> None:
    index = KvIndex()
    assert not index.resident(W0, 1)
    index.apply(W0, stored(1))  # W0 holds the first slot
    assert not index.resident(W0, 99)
    assert not index.resident(W0, 0)
    assert not index.resident(W0, 99, medium="GPU")
    index.apply(W0, removed(1))
    assert not index.resident(W0, 1)


@settings(max_examples=300, deadline=None)
@given(ops=OPS, chain=st.lists(HASHES, max_size=8))
def test_a_worker_whose_losses_stay_the_same_answers_no_less(ops, chain) -> None:
    """The reaper looks a waiting session's prefix up again only after its worker's
    `losses` changed: in between, no lookup on that worker may answer less."""
    index = KvIndex()

    def answers(worker: WorkerId) -> list[int]:
        return [index.lookup(chain, medium=m).get(worker, 0) for m in (None, "GPU", "CPU")]

    for op, worker, medium, hashes in ops:
        before = {w: (index.losses(w), answers(w)) for w in (W0, W1, W2)}
        if op == "store":
            index.apply(worker, stored(*hashes, medium=medium))
        elif op == "remove":
            index.apply(worker, removed(*hashes, medium=medium))
        else:
            index.forget_worker(worker)
        for w, (losses, was) in before.items():
            if index.losses(w) == losses:
                assert all(now >= then for now, then in zip(answers(w), was, strict=True))
            else:
                assert w == worker and op != "store" and index.losses(w) > losses


@pytest.mark.parametrize(
    ("events", "losses"),
    [
        ([stored(1, 2)], 0),
        ([removed(9)], 0),
        ([stored(1, 2), stored(1), removed(1)], 0),  # one of two copies: still resident
        ([stored(1, 2), removed(2)], 1),
        ([stored(1, 2), removed(1, 2)], 2),
        ([stored(1), stored(1, medium="CPU"), removed(1, medium="CPU")], 1),
        ([stored(1, 2), AllBlocksCleared()], 1),
    ],
    ids=[
        "stored",
        "unknown removal",
        "a copy left",
        "one removed",
        "two removed",
        "off the host tier",
        "cleared",
    ],
)
def test_losses_count_the_blocks_a_worker_lost(events: list[KvEvent], losses: int) -> None:
    index = KvIndex()
    for event in events:
        index.apply(W0, event)
    index.apply(W1, stored(1, 2))
    assert (index.losses(W0), index.losses(W1)) == (losses, 0)


def test_a_one_tier_worker_answers_for_that_tier_only() -> None:
    index = KvIndex()
    index.apply(W0, stored(1, 2, 3))
    index.apply(W1, stored(1, 2, medium="CPU"))
    assert index.lookup((1, 2, 3), medium="GPU") == {W0: 3}
    assert index.lookup((1, 2, 3), medium="CPU") == {W1: 2}
    index.apply(W0, stored(1, 2, medium="CPU"))  # now two tiers: GPU still counts alone
    index.apply(W0, removed(2))
    assert index.lookup((1, 2, 3), medium="GPU") == {W0: 1}
    assert index.lookup((1, 2, 3)) == {W0: 3, W1: 2}  # 2 on the host, 1 and 3 on the GPU


# --- the workers' cache generations ---


@pytest.mark.parametrize(
    ("events", "generation"),
    [
        ([stored(1, 2)], 0),
        ([stored(1, 2), removed(1, 2)], 0),  # evictions: the same cache, fewer blocks
        ([stored(1, 2), AllBlocksCleared()], 1),
        ([AllBlocksCleared(), stored(1), AllBlocksCleared()], 2),
    ],
    ids=["stored", "evicted", "cleared", "cleared twice"],
)
def test_a_generation_moves_on_each_time_the_workers_cache_is_cleared(
    events: list[KvEvent], generation: int
) -> None:
    index = KvIndex()
    for event in events:
        index.apply(W0, event)
    index.apply(W1, stored(1, 2))
    assert (index.generation(W0), index.generation(W1)) == (generation, 0)


def test_a_restart_or_a_lost_worker_starts_a_new_generation_of_that_worker_only() -> None:
    index = KvIndex()
    index.apply(W0, stored(1, 2))
    index.apply(W1, stored(1, 2))
    index.forget_worker(W0)  # what the feed does on a restart, lost events, a worker lost
    assert (index.generation(W0), index.generation(W1), index.generation(W2)) == (1, 0, 0)
    index.forget_worker(W2)  # even a worker the index held nothing of
    index.forget_worker(W0)
    assert (index.generation(W0), index.generation(W1), index.generation(W2)) == (2, 0, 1)
    index.apply(W0, stored(1, 2))  # its new blocks are of the new generation
    assert index.generation(W0) == 2
    assert index.lookup((1, 2)) == {W0: 2, W1: 2}


def test_a_new_index_continues_after_the_generations_last_recorded() -> None:
    index = KvIndex()
    index.forget_worker(W1)
    index.forget_worker(W1)
    index.forget_worker(W1)
    index.start_generations({W0: 4, W1: 1, W2: 0})
    # After each one recorded (the previous index's knowledge is gone), never back.
    assert [index.generation(w) for w in (W0, W1, W2)] == [5, 3, 1]
    index.start_generations({})
    assert [index.generation(w) for w in (W0, W1, W2)] == [5, 3, 1]
