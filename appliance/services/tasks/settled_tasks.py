"""Which task trees the task book (services/tasks/tasks.py) may forget, so its memory stays flat
however many tasks come and go.

A tree is settled when none of its tasks counts any more (services/tasks/task_load.py: closed, or
idle for the admission's `task_idle_s`, or a one-turn task whose turn ended) and none has a
turn in flight. The book keeps the newest `keep` settled tasks (for the console's tasks
screen and a client's quick GET), and forgets whole trees, oldest settled first, beyond
that. A forgotten task is still the ledger's: the book reads it back when a request names it
(ledger/task_history.py), open ones taken back, closed ones refusing as before.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Protocol

from appliance.domain.records import TaskId
from appliance.services.tasks.task_load import Loaded, Standing

KEEP_SETTLED_TASKS = 1_000


class Node(Loaded, Protocol):
    """A task as the shelf walks a tree (TaskState)."""

    @property
    def children(self) -> list[TaskId]: ...


def tree_of(root: Node, find: Callable[[TaskId], Node | None]) -> Iterator[Node]:
    """The root and its descendants the book holds."""
    stack = [root]
    while stack:
        task = stack.pop()
        yield task
        stack.extend(c for k in task.children if (c := find(k)) is not None)


def settled(root: Node, find: Callable[[TaskId], Node | None]) -> int:
    """The tree's size when it is settled (every task let go, none in flight); else 0."""
    size = 0
    for task in tree_of(root, find):
        if task.load.standing is not Standing.LET_GO or task.load.in_flight:
            return 0
        size += 1
    return size


class SettledShelf:
    """Settled trees by root, oldest first, with their sizes when shelved."""

    def __init__(self, keep: int = KEEP_SETTLED_TASKS) -> None:
        self.keep = keep
        self._roots: OrderedDict[TaskId, int] = OrderedDict()
        self._tasks = 0

    def shelve(self, root: TaskId, size: int) -> None:
        self._tasks += size - self._roots.pop(root, 0)
        self._roots[root] = size

    def overflow(self) -> Iterator[TaskId]:
        """Roots of the oldest trees beyond `keep` tasks, each taken off the shelf."""
        while self._tasks > self.keep and self._roots:
            root, size = self._roots.popitem(last=False)
            self._tasks -= size
            yield root
