"""Blocks held by a worker's holds, each counted once however many holds share it (a
fan-out's branches hold their parent's prefix): what the cap on held blocks counts
(`holds.HoldBook`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence


class HeldBlockCount:
    """How many holds reference each block, by the block's identity (vLLM's pool has one
    object per physical block), kept as holds come and go: the cap's count of distinct
    held blocks costs no pass over the holds."""

    def __init__(self) -> None:
        self._n: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self._n)

    def add(self, blocks: Sequence[object]) -> None:
        n = self._n
        for b in blocks:
            n[id(b)] = n.get(id(b), 0) + 1

    def remove(self, blocks: Sequence[object]) -> None:
        n = self._n
        for b in blocks:
            left = n[id(b)] - 1
            if left:
                n[id(b)] = left
            else:
                del n[id(b)]

    def held_besides(self, mine: Sequence[object]) -> Callable[[object], bool]:
        """Whether a block is referenced by a hold other than the one holding `mine`."""
        own = {id(b) for b in mine}
        return lambda b: self._n.get(id(b), 0) > (id(b) in own)


def unheld_blocks(run: tuple[object, ...], theirs: Callable[[object], bool]) -> int:
    return sum(1 for b in run if not theirs(b))


def prefix_within(
    run: tuple[object, ...], theirs: Callable[[object], bool], budget: int
) -> tuple[object, ...]:
    """The longest prefix of `run` with at most `budget` blocks that `theirs` does not hold."""
    for i, b in enumerate(run):
        if not theirs(b):
            if budget == 0:
                return run[:i]
            budget -= 1
    return run
