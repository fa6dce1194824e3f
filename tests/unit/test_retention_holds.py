"""The retention connector's hold bookkeeping over a stand-in for vLLM's block pool: a free
queue (head evicted first), reference counts and a hash per cached block, behaving as
`BlockPool.touch` / `free_blocks` / `get_new_blocks` do (tests/integration/
test_retention_pool.py runs the same book over vLLM's own pool)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from appliance.engines.retention.holds import HoldBook
from appliance.engines.retention.protocol import (
    GiveBackReason,
    GivenBack,
    RetentionDemote,
    RetentionEvictFirst,
    RetentionHold,
    RetentionOrder,
    RetentionRelease,
)

BS = 32
NOW = 1000.0


class FakePool:
    def __init__(self, blocks: int) -> None:
        self.ref = dict.fromkeys(range(blocks), 0)
        self.hashes: dict[int, object] = {}
        self.queue = list(range(blocks))
        self._next_hash = 0
        self.host: list[tuple[str, list[object]]] = []
        """What `copy_to_host` was given, in order."""
        self.dropped: list[object] = []
        """What `drop_from_host` was given."""

    # --- the KvPool protocol ---

    def usable_blocks(self) -> int:
        return len(self.ref)

    def free_blocks(self) -> int:
        return len(self.queue)

    def is_cached(self, block: object, block_hash: object) -> bool:
        return self.hashes.get(block) == block_hash  # type: ignore[call-overload]

    def hold(self, blocks: Sequence[object]) -> None:
        for b in blocks:
            assert isinstance(b, int)
            if self.ref[b] == 0:
                self.queue.remove(b)
            self.ref[b] += 1

    def give_back(self, blocks: Sequence[object], *, first: bool) -> None:
        idle = []
        for b in reversed(blocks):
            assert isinstance(b, int) and self.ref[b] > 0
            self.ref[b] -= 1
            if self.ref[b] == 0:
                idle.append(b)
        self.queue = idle + self.queue if first else self.queue + idle

    def evict_first(self, blocks: Sequence[object]) -> None:
        idle = [b for b in reversed(blocks) if self.ref[b] == 0]  # type: ignore[index]
        self.queue = idle + [b for b in self.queue if b not in idle]

    def copy_to_host(self, blocks: Sequence[object], key: str) -> int:
        self.host.append((key, list(blocks)))
        return len(blocks)

    def host_blocks(self) -> tuple[int, int]:
        return 64, sum(len(b) for _, b in self.host)

    def drop_from_host(self, blocks: Sequence[object]) -> int:
        self.dropped += blocks
        return len(blocks)

    # --- what vLLM does around it ---

    def run(self, n: int, shared: Sequence[int] = ()) -> list[tuple[int, object]]:
        """A request that hits `shared` and fills `n` new blocks, then finishes: its
        blocks, with hashes, freed into the queue as vLLM frees them. Returns its entries."""
        self.hold(list(shared))
        new = self.allocate(n)
        for b in new:
            self._next_hash += 1
            self.hashes[b] = f"h{self._next_hash}"
        blocks = [*shared, *new]
        self.give_back(blocks, first=False)
        return [(b, self.hashes[b]) for b in blocks]

    def allocate(self, n: int) -> list[int]:
        """Takes n blocks from the head of the queue, evicting what they cached."""
        assert n <= len(self.queue), "allocation failed"
        taken, self.queue = self.queue[:n], self.queue[n:]
        for b in taken:
            self.hashes.pop(b, None)
            self.ref[b] = 1
        return taken

    def held_refs(self, blocks: Sequence[tuple[int, object]]) -> list[int]:
        return [self.ref[b] for b, _ in blocks]


def book_over(blocks: int = 100, **kw: float) -> tuple[FakePool, HoldBook]:
    pool = FakePool(blocks)
    return pool, HoldBook(pool, [BS], **kw)  # type: ignore[arg-type]


def hold(book: HoldBook, key: str, until_s: float = NOW + 60, priority: float = 0.0) -> None:
    book.apply(RetentionHold(key, until_s, priority), NOW)


def test_a_hold_keeps_the_finished_requests_blocks_through_a_flood() -> None:
    pool, book = book_over(100)
    entries = pool.run(10)
    book.finished("t/a", [entries])
    assert pool.held_refs(entries) == [0] * 10 and not book  # remembered, not held
    hold(book, "t/a")
    assert pool.held_refs(entries) == [1] * 10 and pool.free_blocks() == 90
    pool.allocate(90)  # the whole rest of the pool
    assert all(pool.is_cached(b, h) for b, h in entries)
    [held] = book.held()
    assert (held.key, held.blocks, held.tokens, held.until_s) == ("t/a", 10, 10 * BS, NOW + 60)
    assert book.take_given_back() == () and not book.dirty


def test_without_a_hold_the_flood_evicts_them() -> None:
    pool, book = book_over(100)
    entries = pool.run(10)
    book.finished("t/a", [entries])
    pool.allocate(100)
    hold(book, "t/a")
    assert not book and book.take_given_back() == (GivenBack("t/a", 0, GiveBackReason.NOT_FOUND),)


def test_a_hold_takes_only_the_leading_blocks_still_cached() -> None:
    pool, book = book_over(20)
    entries = pool.run(10)
    book.finished("t/a", [entries])
    pool.queue.remove(entries[4][0])  # block 4 was evicted and reused meanwhile
    pool.queue.insert(0, entries[4][0])
    pool.allocate(1)
    hold(book, "t/a")
    # Blocks 0-3 held; block 4 is the other request's now; 5-9 are not part of a prefix.
    assert pool.held_refs(entries) == [1, 1, 1, 1, 1, 0, 0, 0, 0, 0]
    assert (book.held()[0].blocks, book.held()[0].tokens) == (4, 4 * BS)


def test_nothing_finished_under_the_key_is_not_found() -> None:
    _, book = book_over()
    hold(book, "t/never")
    assert book.take_given_back() == (GivenBack("t/never", 0, GiveBackReason.NOT_FOUND),)


def test_holding_again_extends_without_a_second_reference() -> None:
    pool, book = book_over()
    entries = pool.run(5)
    book.finished("t/a", [entries])
    hold(book, "t/a", until_s=NOW + 10, priority=1.0)
    hold(book, "t/a", until_s=NOW + 90, priority=2.0)
    assert pool.held_refs(entries) == [1] * 5
    [held] = book.held()
    assert (held.until_s, held.priority) == (NOW + 90, 2.0)


def test_the_newest_request_replaces_the_hold_and_shared_blocks_stay_referenced() -> None:
    pool, book = book_over()
    first = pool.run(5)
    book.finished("t/a", [first])
    hold(book, "t/a")
    second = pool.run(3, shared=[b for b, _ in first])  # the next turn: the prefix, then 3
    book.finished("t/a", [second])
    freed_before = list(pool.queue)
    hold(book, "t/a")
    assert pool.held_refs(second) == [1] * 8
    # The 3 new blocks left the free queue; the 5 shared ones were never put in it.
    assert pool.queue == [b for b in freed_before if b not in dict(second[5:])]
    assert book.held()[0].blocks == 8


def test_release_gives_the_blocks_back_to_the_tail_of_the_queue() -> None:
    pool, book = book_over(20)
    entries = pool.run(5)
    book.finished("t/a", [entries])
    hold(book, "t/a")
    book.apply(RetentionRelease("t/a"), NOW)
    assert pool.queue[-5:] == [b for b, _ in reversed(entries)]  # tail block first
    assert book.take_given_back() == (GivenBack("t/a", 5, GiveBackReason.RELEASED),)
    book.apply(RetentionRelease("t/a"), NOW)  # not held: nothing to say
    assert book.take_given_back() == ()


@pytest.mark.parametrize("held", [True, False])
def test_evict_first_puts_the_blocks_at_the_head_of_the_queue(held: bool) -> None:
    pool, book = book_over(20)
    entries = pool.run(5)
    book.finished("t/a", [entries])
    if held:
        hold(book, "t/a")
    book.apply(RetentionEvictFirst("t/a"), NOW)
    assert pool.queue[:5] == [b for b, _ in reversed(entries)]
    assert pool.allocate(5) == [b for b, _ in reversed(entries)]  # they go before any other
    assert book.take_given_back() == (GivenBack("t/a", 5, GiveBackReason.EVICTED),)
    hold(book, "t/a")  # forgotten: a later hold finds nothing
    assert book.take_given_back()[0].reason == GiveBackReason.NOT_FOUND


@pytest.mark.parametrize("held", [True, False])
def test_a_branchs_end_evicts_its_own_blocks_first_everywhere_and_leaves_the_inherited(
    held: bool,
) -> None:
    """A fan-out branch shares its parent's first 3 blocks and adds 4: its end puts its 4
    first and drops their host copies; the 3 go back as LRU, where its parent's hit them."""
    pool, book = book_over(20)
    parent = pool.run(3)
    entries = pool.run(4, shared=[b for b, _ in parent])
    book.finished("t/kid", [entries])
    if held:
        hold(book, "t/kid")
    book.apply(RetentionEvictFirst("t/kid", keep_blocks=3, drop_host=True), NOW)
    own = [b for b, _ in entries[3:]]
    assert pool.queue[:4] == own[::-1]  # they go before any other
    assert all(pool.queue.index(b) >= 4 for b, _ in parent)  # not first: LRU
    assert pool.dropped == [h for _, h in entries[3:]]  # their copies, by hash
    assert book.take_given_back() == (GivenBack("t/kid", 7, GiveBackReason.EVICTED),)


@pytest.mark.parametrize("held", [True, False])
def test_a_demotion_copies_to_the_host_tier_then_evicts_first(held: bool) -> None:
    pool, book = book_over(20)
    entries = pool.run(5)
    book.finished("t/a", [entries])
    if held:
        hold(book, "t/a")
    book.apply(RetentionDemote("t/a"), NOW)
    assert pool.host == [("t/a", [b for b, _ in entries])]  # before they go first
    assert pool.queue[:5] == [b for b, _ in reversed(entries)] and not book
    assert book.take_given_back() == (GivenBack("t/a", 5, GiveBackReason.DEMOTED),)
    book.apply(RetentionDemote("t/b"), NOW)  # nothing finished under it: nothing to copy
    assert len(pool.host) == 1 and book.take_given_back() == ()


def test_a_demoted_sessions_end_drops_its_host_copies_after_its_gpu_blocks_are_gone() -> None:
    """Demoted, then its GPU blocks taken by other requests: its end (`drop_host`) still
    drops its host copies past `keep_blocks`, by the hashes they had; nothing is given
    back on the GPU, and a second end drops nothing more."""
    pool, book = book_over(8)
    entries = pool.run(5)
    book.finished("t/a", [entries])
    book.apply(RetentionDemote("t/a"), NOW)
    book.take_given_back()
    pool.allocate(8)  # a flood: every GPU block reused
    book.apply(RetentionEvictFirst("t/a", keep_blocks=2, drop_host=True), NOW)
    assert pool.dropped == [h for _, h in entries[2:]]
    assert book.take_given_back() == ()
    book.apply(RetentionEvictFirst("t/a", drop_host=True), NOW)
    assert len(pool.dropped) == 3
    book.apply(RetentionEvictFirst("t/b", drop_host=True), NOW)  # never finished, never demoted
    assert len(pool.dropped) == 3


def test_a_last_steps_eviction_leaves_the_host_copies_for_the_sessions_end() -> None:
    pool, book = book_over(8)
    entries = pool.run(5)
    book.finished("t/a", [entries])
    book.apply(RetentionEvictFirst("t/a"), NOW)  # a last step: the GPU's order only
    assert pool.dropped == []
    book.apply(RetentionEvictFirst("t/a", drop_host=True), NOW)  # then its task closes
    assert pool.dropped == [h for _, h in entries]


def test_holds_lapse_at_their_time() -> None:
    pool, book = book_over()
    for key, until in (("t/a", NOW + 5), ("t/b", NOW + 50)):
        book.finished(key, [pool.run(2)])
        hold(book, key, until_s=until)
    book.expire(NOW + 5)
    assert [h.key for h in book.held()] == ["t/b"]
    assert book.take_given_back() == (GivenBack("t/a", 2, GiveBackReason.EXPIRED),)
    hold(book, "t/b", until_s=NOW - 1)  # a time already past ends it
    assert not book


def make_holds(
    pool: FakePool, book: HoldBook, priorities: dict[str, float], size: int = 10
) -> None:
    for key, priority in priorities.items():
        book.finished(key, [pool.run(size)])
        hold(book, key, priority=priority)
    book.take_given_back()


def test_room_for_a_waiting_request_comes_from_the_lowest_priority_first() -> None:
    pool, book = book_over(50)
    make_holds(pool, book, {"t/high": 3.0, "t/low": 1.0, "t/mid": 2.0})
    assert pool.free_blocks() == 20
    assert book.make_room(35) == 2
    assert [g.key for g in book.take_given_back()] == ["t/low", "t/mid"]
    assert [h.key for h in book.held()] == ["t/high"]
    assert book.make_room(30) == 0  # enough room already


def test_room_for_a_restore_comes_only_from_holds_worth_less_than_it() -> None:
    """A restore (a session's KV brought back before its turn) is speculative: it takes the
    room of holds of a lower priority than its own, never of more valuable ones."""
    pool, book = book_over(50)
    make_holds(pool, book, {"t/high": 3.0, "t/low": 1.0, "t/mid": 2.0})
    assert book.make_room(45, protect="t/back", below=2.5) == 2
    assert [g.key for g in book.take_given_back()] == ["t/low", "t/mid"]
    assert [h.key for h in book.held()] == ["t/high"] and pool.free_blocks() == 40
    assert book.make_room(45, below=0.5) == 0


def test_a_waiting_requests_own_session_is_never_given_back() -> None:
    pool, book = book_over(50)
    make_holds(pool, book, {"t/own": 0.0, "t/other": 5.0})
    assert book.make_room(50, protect="t/own") == 1
    assert [h.key for h in book.held()] == ["t/own"]


def test_equal_priorities_give_back_the_hold_asked_for_longest_ago() -> None:
    pool, book = book_over(50)
    make_holds(pool, book, {"t/a": 1.0, "t/b": 1.0})
    hold(book, "t/a", priority=1.0)  # asked for again: now the newer
    book.make_room(40)
    assert [g.key for g in book.take_given_back()] == ["t/b"]


def test_the_order_the_appliance_sent_last_decides() -> None:
    pool, book = book_over(50)
    make_holds(pool, book, {"t/a": 1.0, "t/b": 2.0})
    book.apply(RetentionOrder({"t/a": 9.0, "t/gone": 0.0}), NOW)
    book.make_room(40)
    assert [g.key for g in book.take_given_back()] == ["t/b"]


def test_a_running_request_short_of_blocks_takes_at_least_one_hold() -> None:
    pool, book = book_over(50)
    assert not book.relieve(5)  # nothing held: vLLM preempts as it would
    make_holds(pool, book, {"t/a": 1.0, "t/b": 2.0, "t/c": 3.0})
    assert book.relieve(0)  # one even when the reserve is free
    assert book.relieve(35)  # then until the reserve is: 30 free, then 40
    given = book.take_given_back()
    assert [(g.key, g.reason) for g in given] == [
        ("t/a", GiveBackReason.PRESSURE),
        ("t/b", GiveBackReason.PRESSURE),
    ]
    assert [h.key for h in book.held()] == ["t/c"]


def test_the_cap_displaces_lower_priorities_then_cuts_the_new_hold() -> None:
    pool, book = book_over(100, max_held_fraction=0.3)  # 30 blocks
    make_holds(pool, book, {"t/low": 1.0, "t/high": 9.0}, size=12)
    book.finished("t/new", [pool.run(12)])
    hold(book, "t/new", priority=5.0)
    assert {h.key: h.blocks for h in book.held()} == {"t/high": 12, "t/new": 12}
    assert book.take_given_back() == (GivenBack("t/low", 12, GiveBackReason.CAPPED),)
    book.finished("t/last", [pool.run(12)])
    hold(book, "t/last", priority=0.0)  # comes before both: only the 6 left under the cap
    assert {h.key: h.blocks for h in book.held()} == {"t/high": 12, "t/new": 12, "t/last": 6}
    assert book.held_blocks == 30


def test_a_hold_with_no_room_under_the_cap_is_refused() -> None:
    pool, book = book_over(100, max_held_fraction=0.1)
    make_holds(pool, book, {"t/high": 9.0})
    book.finished("t/low", [pool.run(5)])
    hold(book, "t/low", priority=1.0)
    assert book.take_given_back() == (GivenBack("t/low", 0, GiveBackReason.CAPPED),)
    assert [h.key for h in book.held()] == ["t/high"]


def test_release_all_gives_everything_back() -> None:
    pool, book = book_over(50)
    make_holds(pool, book, {"t/a": 1.0, "t/b": 2.0})
    book.release_all(GiveBackReason.RESET)
    assert pool.free_blocks() == 50 and not book
    assert {g.reason for g in book.take_given_back()} == {GiveBackReason.RESET}


def test_remembered_requests_are_bounded_oldest_first() -> None:
    pool = FakePool(100)
    book = HoldBook(pool, [BS], remember_blocks=10)  # type: ignore[arg-type]
    for key in ("t/a", "t/b", "t/c"):
        book.finished(key, [pool.run(4)])
    for key in ("t/a", "t/b", "t/c"):
        hold(book, key)
    assert [h.key for h in book.held()] == ["t/b", "t/c"]
    assert book.take_given_back() == (GivenBack("t/a", 0, GiveBackReason.NOT_FOUND),)


def test_every_group_is_held_and_tokens_count_the_first() -> None:
    pool, book = book_over(50)
    full, window = pool.run(6), pool.run(2)
    book.finished("t/a", [full, window])
    hold(book, "t/a")
    assert pool.held_refs(full + window) == [1] * 8
    assert (book.held()[0].blocks, book.held()[0].tokens) == (8, 6 * BS)


def test_blocks_that_holds_share_count_once_under_the_cap() -> None:
    # A fan-out: four branches hold their parent's prefix and a little of their own. Counted
    # per hold, the prefix filled the cap five times over and branches' holds were refused.
    pool, book = book_over(100, max_held_fraction=0.3)  # 30 blocks
    root = pool.run(10)
    book.finished("t/root", [root])
    hold(book, "t/root", priority=1.0)
    shared = [b for b, _ in root]
    for i in range(4):
        book.finished(f"t/k{i}", [pool.run(2, shared=shared)])
        hold(book, f"t/k{i}", priority=1.0)
    assert book.take_given_back() == ()
    assert {h.key: h.blocks for h in book.held()} == {
        "t/root": 10,
        **{f"t/k{i}": 12 for i in range(4)},
    }
    assert book.held_blocks == 18
    book.finished("t/big", [pool.run(14, shared=shared)])
    hold(book, "t/big", priority=0.5)  # below the others: its 14 new blocks cut to the 12 left
    assert {h.key: h.blocks for h in book.held()}["t/big"] == 22
    assert book.held_blocks == 30


def test_the_hashes_kept_for_a_later_drop_are_at_most_what_the_host_tier_holds() -> None:
    pool, book = book_over(100)  # its host tier holds 64 blocks
    runs = {}
    for key in ("t/a", "t/b", "t/c"):
        runs[key] = pool.run(30)
        book.finished(key, [runs[key]])
        book.apply(RetentionEvictFirst(key), NOW)
    book.apply(RetentionEvictFirst("t/a", drop_host=True), NOW)  # the oldest: forgotten
    assert pool.dropped == []
    book.apply(RetentionEvictFirst("t/c", drop_host=True), NOW)
    assert pool.dropped == [h for _, h in runs["t/c"]]


def test_a_finished_request_forgotten_for_room_still_has_its_host_copies_dropped() -> None:
    pool, book = book_over(100, remember_blocks=40)
    first = pool.run(30)
    book.finished("t/a", [first])
    book.finished("t/b", [pool.run(20)])  # 50 remembered: the oldest record goes
    hold(book, "t/a")
    assert book.take_given_back()[-1].reason == GiveBackReason.NOT_FOUND  # forgotten
    book.apply(RetentionEvictFirst("t/a", drop_host=True), NOW)
    assert pool.dropped == [h for _, h in first]
