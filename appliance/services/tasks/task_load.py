"""What admission counts of the tasks, kept inside the task book (services/tasks/tasks.py), which
admission reads through its `TaskView` (services/tasks/admission.py).

Per task: its depth, cap, open children and turns in flight, and when its turns ran
(`TurnPace`: its class's history learns from it when it succeeds, services/tasks/task_paces.py);
per tenant: its open tasks and turns in flight. A task counts from its creation until its
terminal event, or until it has had no turn in flight, no new turn and no new child for
`idle_s`: then it is let go for good, so that a client that never closes its tasks cannot
lock itself out. A one-turn task (a turn without X-Task-ID) is let go when its turn ends,
closed then (`done`). A task taken back after a restart counts again once a turn or a new
child names it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Protocol

from appliance.domain.records import TaskId, TenantId
from appliance.policy.admission import TenantLoad


class Standing(StrEnum):
    """Whether a task counts toward its tenant's open tasks and its parent's children."""

    UNSEEN = "unseen"
    """Taken back after a restart and named by no turn or child since."""
    COUNTED = "counted"
    LET_GO = "let_go"
    """Closed, dropped, or idle for `idle_s`: it counts no more, for good."""


@dataclass(eq=False)
class TurnPace:
    """When a task's turns ran, as far as this process saw them (services/tasks/task_paces.py)."""

    turns: int = 0
    """Its turns that began here (fewer than it ran when it was taken back after a restart)."""
    first_began_at: float | None = None
    last_ended_at: float | None = None
    busy_s: float = 0.0
    """Seconds with a turn of it in flight, up to `last_ended_at`."""
    busy_since: float = 0.0

    def began(self, now: float, in_flight: int) -> None:
        """A turn began, with `in_flight` of its turns running before it."""
        self.turns += 1
        if self.first_began_at is None:
            self.first_began_at = now
        if not in_flight:
            self.busy_since = now

    def ended(self, now: float, in_flight: int) -> None:
        """A turn ended, leaving `in_flight` of its turns running."""
        if not in_flight:
            self.busy_s += now - self.busy_since
            self.last_ended_at = now


@dataclass(eq=False)
class TaskLoad:
    """What admission counts of one task."""

    depth: int = 0
    max_children: int | None = None
    open_children: int = 0
    """Its children that count (Standing.COUNTED)."""
    in_flight: int = 0
    """Its model turns running now."""
    last_active_at: float = 0.0
    one_turn: bool = False
    """A turn without X-Task-ID: let go when that turn ends."""
    standing: Standing = Standing.UNSEEN
    pace: TurnPace = field(default_factory=TurnPace)
    """When its turns ran (this process's): its class's history learns from it."""


class Loaded(Protocol):
    """A task of the book, as the counting reads it (TaskState)."""

    @property
    def key(self) -> TaskId: ...
    @property
    def tenant(self) -> TenantId: ...
    @property
    def parent(self) -> TaskId | None: ...
    @property
    def load(self) -> TaskLoad: ...


class TaskLoads:
    """The counts over the book's tasks; `find` is the book's lookup."""

    def __init__(
        self,
        find: Callable[[TaskId], Loaded | None],
        idle_s: float,
        on_let_go: Callable[[Loaded], None] | None = None,
    ) -> None:
        """`on_let_go`: told of each task let go, once it is (the book's forgetting)."""
        self._find = find
        self._on_let_go = on_let_go
        self._idle_s = idle_s
        self._idle: OrderedDict[TaskId, None] = OrderedDict()
        """Counted tasks with no turn in flight, least recently active first."""
        self._turns: dict[TenantId, int] = {}
        self._open: dict[TenantId, int] = {}

    def tenant_loads(self, now: float) -> dict[str, TenantLoad]:
        """Turns in flight and counted open tasks per tenant (those holding either), as of
        `now`: tasks idle for `idle_s` are let go first."""
        horizon = now - self._idle_s
        while self._idle:
            task = self._find(next(iter(self._idle)))
            assert task is not None  # the book lets go of a task before it drops it
            if task.load.last_active_at > horizon:
                break
            self.let_go(task)
        return {
            t: TenantLoad(self._turns.get(t, 0), self._open.get(t, 0))
            for t in self._turns.keys() | self._open.keys()
        }

    def count(self, task: Loaded, now: float) -> None:
        """The task counts from now on, toward its tenant's open tasks and its parent's
        children; a parent not counted since a restart counts again too."""
        above = self._find(task.parent) if task.parent is not None else None
        if above is not None:
            if above.load.standing is Standing.UNSEEN:
                self.count(above, now)
            above.load.open_children += 1
            above.load.last_active_at = now
            if above.key in self._idle:
                self._idle.move_to_end(above.key)
        task.load.standing = Standing.COUNTED
        task.load.last_active_at = now
        self._idle[task.key] = None
        self._open[task.tenant] = self._open.get(task.tenant, 0) + 1

    def let_go(self, task: Loaded) -> None:
        """The task counts no more (closed, dropped or idle too long), for good."""
        if task.load.standing is Standing.COUNTED:
            self._idle.pop(task.key, None)
            _decrement(self._open, task.tenant)
            above = self._find(task.parent) if task.parent is not None else None
            if above is not None:
                above.load.open_children -= 1
        task.load.standing = Standing.LET_GO
        if self._on_let_go is not None:
            self._on_let_go(task)

    def turn_began(self, task: Loaded, now: float) -> None:
        load = task.load
        if load.standing is Standing.UNSEEN:
            self.count(task, now)
        load.pace.began(now, load.in_flight)
        load.in_flight += 1
        load.last_active_at = now
        self._idle.pop(task.key, None)
        self._turns[task.tenant] = self._turns.get(task.tenant, 0) + 1

    def turn_ended(self, task: Loaded, now: float) -> None:
        load = task.load
        load.in_flight -= 1
        load.pace.ended(now, load.in_flight)
        load.last_active_at = now
        _decrement(self._turns, task.tenant)
        if load.in_flight > 0 or load.standing is not Standing.COUNTED:
            return
        if load.one_turn:
            self.let_go(task)
        else:
            self._idle[task.key] = None
            self._idle.move_to_end(task.key)


def _decrement(counts: dict[TenantId, int], tenant: TenantId) -> None:
    left = counts.get(tenant, 0) - 1
    if left > 0:
        counts[tenant] = left
    else:
        counts.pop(tenant, None)
