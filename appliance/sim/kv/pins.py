"""A residency pin as the prefix cache keeps it, the default order in which pins are given
back under pressure, and the pin counters (`prefix_cache.py` says what a pin does)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Pin:
    """One owner's pinned blocks: what the eviction order among pins sees."""

    owner: str
    num_blocks: int
    pinned_at_s: float
    until_s: float
    """When `expire_pins` releases it on its own."""
    seq: int = 0
    """Order of pinning (the mechanism's bookkeeping)."""


PinPriority = Callable[[Pin, float], float]
"""(pin, now) -> rank: under pressure the lowest-ranked pin is given back first."""


def latest_expiry_first(pin: Pin, now: float) -> float:
    """The default order under pressure: the pin with the most time left goes first."""
    return -pin.until_s


@dataclass(frozen=True, slots=True)
class PinStats:
    """Cumulative pin counters: pins taken and how each ended."""

    pinned: int = 0
    expired: int = 0
    """Released by `expire_pins` at their time."""
    resumed: int = 0
    """Released because the owner came back (`unpin`)."""
    reclaimed: int = 0
    """Given back early because an allocation was short."""
    replaced: int = 0
    """Superseded by a newer pin of the same owner."""
    evicted: int = 0
    """Ended by `evict_pin`: its blocks went first in the eviction order."""
    demoted: int = 0
    """Ended by `demote_pin`: its blocks went to the host tier."""


class PinnedBlocks:
    """The distinct blocks the standing pins hold, kept as pins start and end (a block two
    pins share counts once), so reading it costs nothing however many blocks are pinned.
    Blocks are told apart by identity (the pool has one object per block id)."""

    __slots__ = ("_holds",)

    def __init__(self) -> None:
        self._holds: Counter[object] = Counter()  # block -> pins holding it

    def __len__(self) -> int:
        return len(self._holds)

    def add(self, blocks: Iterable[object]) -> None:
        self._holds.update(blocks)  # counted in C

    def drop(self, blocks: Iterable[object]) -> None:
        holds = self._holds
        for block in blocks:
            n = holds.pop(block)
            if n > 1:
                holds[block] = n - 1
