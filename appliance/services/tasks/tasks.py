"""Tasks and their lifecycle: created explicitly or by their first turn, closed by an event.

A task belongs to its tenant: ids are namespaced `tenant/id` in the ledger, so another
tenant's id is simply another task. A task is open until one terminal event (succeeded,
failed, cancelled; `done` for a one-turn task, when its turn ends: a turn without X-Task-ID
leaves no open task); a second terminal event is a conflict. Cancelling a task cancels its
open descendants too, and a closed task takes no new children. Every change is written to
the ledger where it is made; a cancellation is also told to the operator's event feed (one
event per cancel, naming how many open descendants went with it).

The book also keeps what admission counts of its tasks (services/tasks/task_load.py), which
admission reads through its `TaskView`. It forgets settled trees beyond a bound
(services/tasks/settled_tasks.py) and reads a task it does not hold back from the ledger when a
request names it (`get`): an open one is taken back, a closed one refuses as before.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from concurrent.futures import Future
from typing import Any

from appliance.domain.records import (
    OpenTask,
    TaskEvent,
    TaskEventType,
    TaskId,
    TaskStatus,
    TenantId,
    TurnRecord,
    can_transition,
)
from appliance.policy.admission import ParentLoad, TenantLoad
from appliance.policy.deadline_share import effective_deadline
from appliance.ports import Ledger, TaskArchive
from appliance.services.operator.events import EventFeed, EventKind
from appliance.services.tasks.settled_tasks import SettledShelf, settled, tree_of
from appliance.services.tasks.task_load import Loaded, Standing, TaskLoad, TaskLoads
from appliance.services.tasks.task_state import (
    TaskClosed,
    TaskError,
    TaskState,
    TaskTurnBegan,
    TaskTurnEnded,
    ToolEventHook,
    archived_document,
    state_of,
    task_document,
    task_record,
    undo_refused,
)


class TaskBook:
    def __init__(
        self,
        ledger: Ledger,
        events: EventFeed | None = None,
        *,
        idle_s: float = 600.0,
        archive: TaskArchive | None = None,
        shelf: SettledShelf | None = None,
        states: dict[TaskId, TaskState] | None = None,
        on_close: Callable[[TaskState], None] | None = None,
        on_tool_event: ToolEventHook | None = None,
    ) -> None:
        """`archive`: the ledger's tasks, read back for an id the book does not hold (None:
        such an id is unknown). `states`: an empty dict the book keeps its tasks in, which
        others may read. `on_close`: told of a task closed (not `done`): its sessions end
        (SessionTable.forget_task). `on_tool_event`: told of each tool event (the reaper)."""
        self._ledger = ledger
        self._events = events
        self._archive = archive
        self._tasks: dict[TaskId, TaskState] = states if states is not None else {}
        self._loads = TaskLoads(self._tasks.get, idle_s, on_let_go=self._settle)
        self._shelf = shelf if shelf is not None else SettledShelf()
        self._on_tool_event = on_tool_event
        self._on_close = on_close

    @staticmethod
    def key(tenant: TenantId, client_id: str) -> TaskId:
        return TaskId(f"{tenant}/{client_id}")

    def get(self, tenant: TenantId, client_id: str) -> TaskState | None:
        """The task, from the ledger when the book does not hold it (`_recall`)."""
        key = self.key(tenant, client_id)
        return self._tasks.get(key) or self._recall(key)

    def _recall(self, key: TaskId) -> TaskState | None:
        """A task the ledger has and the book does not: an open one is taken back (its open
        parent first); a closed one comes back detached, only to refuse what it forbids."""
        found = self._archive.find(key) if self._archive is not None else None
        if found is None:
            return None
        if found.status is not TaskStatus.OPEN:
            state = state_of(found)
            state.status, state.verified = found.status, found.verified
            state.load.standing = Standing.LET_GO
            return state
        if found.parent_task_id and found.parent_task_id not in self._tasks:
            self._recall(TaskId(found.parent_task_id))
        self.restore([found])
        return self._tasks[key]

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(list(self._tasks.values()))

    def create(
        self,
        tenant: TenantId,
        client_id: str,
        now: float,
        *,
        parent_id: str | None = None,
        task_class: str | None = None,
        deadline_s: float | None = None,
        budget: float | None = None,
        max_children: int | None = None,
    ) -> TaskState:
        key = self.key(tenant, client_id)
        if key in self._tasks:
            raise TaskError(f"task {client_id} exists already", code="task_exists", http_status=409)
        self.check_parent(tenant, parent_id)
        parent = self._tasks.get(self.key(tenant, parent_id)) if parent_id else None
        if parent_id and parent is None:
            parent = self.ensure(tenant, parent_id, now)
        state = TaskState(
            key,
            client_id,
            tenant,
            now,
            parent.key if parent else None,
            task_class,
            effective_deadline(now, deadline_s, parent.deadline_at if parent else None),
            budget=budget,
            load=TaskLoad(parent.load.depth + 1 if parent else 0, max_children),
        )
        self._tasks[key] = state
        if parent is not None:
            parent.children.append(key)
        self._loads.count(state, now)
        # Not awaited here: the writer keeps order, so the task row lands before its turns;
        # the API awaits `written` where a client is told the task exists.
        state.written = self._ledger.record_task(task_record(state))
        return state

    def check_parent(self, tenant: TenantId, parent_id: str | None) -> None:
        """Raises unless a new task may open under `parent_id`: a closed task (succeeded,
        failed, cancelled: a cancelled root's whole tree) takes no new children. A parent
        the book does not have passes (`create` opens it as a root)."""
        parent = self.get(tenant, parent_id) if parent_id else None
        if parent is not None and parent.status.is_terminal:
            raise TaskClosed(
                f"parent task {parent_id} is {parent.status}; it takes no new children"
            )

    def repeats(self, state: TaskState, *, parent_id: str | None, task_class: str | None) -> bool:
        """Whether a creation with these fields is a retry of the one that made `state`."""
        parent = self.key(state.tenant, parent_id) if parent_id else None
        return (state.parent, state.task_class) == (parent, task_class)

    def restore(self, tasks: Iterable[OpenTask]) -> None:
        """Takes back open tasks from the ledger after a restart, parents before children."""
        for t in tasks:
            state = state_of(t)
            self._tasks[state.key] = state
            parent = self._tasks.get(state.parent) if state.parent else None
            if parent is not None:
                parent.children.append(state.key)
                state.load.depth = parent.load.depth + 1

    def drop(self, state: TaskState) -> None:
        """Forgets a task whose creation the ledger refused: memory never runs ahead of it."""
        self._loads.let_go(state)
        self._tasks.pop(state.key, None)
        parent = self._tasks.get(state.parent) if state.parent else None
        if parent is not None and state.key in parent.children:
            parent.children.remove(state.key)

    def ensure(
        self,
        tenant: TenantId,
        client_id: str,
        now: float,
        *,
        parent_id: str | None = None,
        deadline_s: float | None = None,
        one_turn: bool = False,
    ) -> TaskState:
        """The task a turn names, created on its first turn (with the turn's X-Deadline-S);
        `one_turn`: a task of that turn alone (the turn named none)."""
        known = self.get(tenant, client_id)
        if known is not None:
            return known
        state = self.create(tenant, client_id, now, parent_id=parent_id, deadline_s=deadline_s)
        state.load.one_turn = one_turn
        return state

    def event(
        self,
        tenant: TenantId,
        client_id: str,
        kind: TaskEventType,
        now: float,
        *,
        verified: bool | None = None,
        evidence: str | None = None,
        tool_class: str | None = None,
        expected_s: float | None = None,
        cost: float = 0.0,
        announce: bool = True,
    ) -> TaskState:
        """Records the event; a terminal one closes the task. `announce`: a cancellation
        goes to the event feed (the cascade of `cancel` announces once, itself)."""
        state = self.get(tenant, client_id)
        if state is None:
            raise TaskError(f"task {client_id} not found", code="task_not_found", http_status=404)
        new = kind.terminal_status
        if new is not None and (state.status, state.verified) == (new, verified):
            return state  # a retry of the event that closed it: already recorded, once
        if new is not None and not can_transition(state.status, new):
            raise TaskClosed(f"task {client_id} is already {state.status}; it cannot become {new}")
        state.written = self._ledger.record_task_event(
            TaskEvent(state.key, kind, now, verified, evidence, tool_class, expected_s, cost)
        )
        if cost:
            self._spent(state, state.written, cost)
        if kind.is_tool_event and self._on_tool_event is not None:
            self._on_tool_event(state.key, kind, tool_class, expected_s, now)
        if new is not None:
            before = (state.status, state.verified)
            state.status = new
            state.verified = verified
            self._loads.let_go(state)  # for good: a refused write leaves it uncounted
            if self._on_close is not None and new.ends_sessions:
                self._on_close(state)
            # A refused write takes the change back (the writer's thread: two assignments).
            state.written.add_done_callback(lambda f: undo_refused(f, state, before))
        if kind == TaskEventType.CANCELLED and announce:
            self._announce_cancel(state, "reported cancelled by its client", now)
        return state

    def cancel(self, tenant: TenantId, client_id: str, now: float) -> list[TaskState]:
        """Cancels the task and its open descendants; returns those it cancelled."""
        root = self.get(tenant, client_id)
        if root is None:
            raise TaskError(f"task {client_id} not found", code="task_not_found", http_status=404)
        cancelled = self._close_open(root, now)
        if cancelled and self._events is not None:
            more = len(cancelled) - (1 if root in cancelled else 0)
            kids = f"{more} open descendant{'' if more == 1 else 's'}"
            if root not in cancelled:
                detail = f"{kids} cancelled; the task itself was closed already"
            else:
                detail = f"cancelled with {kids}" if more else "cancelled"
            self._announce_cancel(root, detail, now)
        return cancelled

    def discard_branches(self, state: TaskState, now: float) -> list[TaskState]:
        """`state` succeeded: its descendants still open are branches it did without. They
        are closed (cancelled, with evidence saying they were discarded) and returned, so
        their turns in flight can be stopped and recorded `discarded`."""
        if state.status is not TaskStatus.SUCCEEDED:
            return []
        discarded = self._close_open(state, now, f"discarded: {state.client_id} succeeded")
        if discarded and self._events is not None:
            n = len(discarded)
            detail = f"succeeded; {n} open branch{'' if n == 1 else 'es'} discarded"
            self._announce_cancel(state, detail, now)
        return discarded

    def _announce_cancel(self, task: TaskState, detail: str, now: float) -> None:
        """A cancellation, told to the operator's event feed (where there is one)."""
        if self._events is not None:
            kind = EventKind.TASK_CANCELLED
            self._events.record(now, kind, task.client_id, detail, tenant=task.tenant)

    def _close_open(
        self, root: TaskState, now: float, evidence: str | None = None
    ) -> list[TaskState]:
        """Cancels `root` and its descendants that are still open; returns them."""
        closed = []
        stack = [root]
        while stack:
            task = stack.pop()
            stack.extend(self._tasks[c] for c in task.children if c in self._tasks)
            if task.status == TaskStatus.OPEN:
                self.event(
                    task.tenant,
                    task.client_id,
                    TaskEventType.CANCELLED,
                    now,
                    evidence=evidence,
                    announce=False,
                )
                closed.append(task)
        return closed

    def add_turn(self, turn: TurnRecord, cost: Future[float | None]) -> None:
        """Counts an attempt's tokens, and its cost once the ledger has priced it."""
        task = self._tasks.get(turn.task_id) if turn.task_id else None
        if task is None:
            return
        task.prompt_tokens += turn.prompt_tokens
        task.cached_tokens += turn.cached_tokens
        task.output_tokens += turn.output_tokens
        task.gpu_s += turn.gpu_s
        self._spent(task, cost)

    def _spent(self, task: TaskState, written: Future[Any], cost: float | None = None) -> None:
        """Adds to the task's and its lineage's cost what the ledger wrote: `cost`, or the
        price the write resolves to when None."""
        tree = self._lineage(task)  # here, not on the writer's thread

        def priced(f: Future[Any]) -> None:
            # Runs on the ledger's writer thread; float additions under the GIL.
            if f.exception() is None and (cost is not None or f.result() is not None):
                spent = cost if cost is not None else f.result() or 0.0
                task.cost += spent
                for state in tree:
                    state.tree_cost += spent

        written.add_done_callback(priced)

    def tree(self, state: TaskState) -> dict[str, object]:
        """`GET /v1/tasks/{id}`'s document of the task and its descendants."""
        return task_document(state, self._tasks.get)

    def archived(self, tenant: TenantId, client_id: str) -> dict[str, object] | None:
        """The same document from the ledger (blocking: for a task the book does not hold)."""
        tree = self._archive.tree(self.key(tenant, client_id)) if self._archive else []
        return archived_document(tree) if tree else None

    # --- turns, and what admission reads (its TaskView) --------------------------------

    def turn_began(self, event: TaskTurnBegan) -> None:
        """A model turn of the task was admitted and starts now."""
        event.task.turns += 1
        self._loads.turn_began(event.task, event.at)

    def turn_ended(self, event: TaskTurnEnded) -> None:
        """The turn's answer (or its stream) has ended, however it ended. A one-turn task
        closes with its turn: `done`, its outcome unknown (a refused write reopens it)."""
        state, now = event.task, event.at
        if state.load.one_turn and state.load.in_flight == 1 and state.status is TaskStatus.OPEN:
            self.event(state.tenant, state.client_id, TaskEventType.DONE, now)
        self._loads.turn_ended(state, now)
        if state.load.standing is Standing.LET_GO and not state.load.in_flight:
            self._settle(state)  # closed while the turn ran

    def _settle(self, task: Loaded) -> None:
        """The task counts no more: its tree is shelved once settled, and the oldest settled
        trees beyond the shelf's bound are forgotten."""
        state = self._tasks.get(task.key)
        if state is None:
            return
        root = self._lineage(state)[-1]
        size = settled(root, self._tasks.get)
        if size:
            self._shelf.shelve(root.key, size)
        for key in list(self._shelf.overflow()):
            top = self._tasks.get(key)
            if top is not None and settled(top, self._tasks.get):
                self._forget(top)

    def _forget(self, root: TaskState) -> None:
        """Forgets the tree; the sessions of its closed tasks ended at their close, and an
        idle one's stay (a session named without a task binds one-turn tasks)."""
        for task in list(tree_of(root, self._tasks.get)):
            del self._tasks[task.key]

    def find(self, key: TaskId) -> TaskState | None:
        return self._tasks.get(key)

    def budget_left(self, key: TaskId) -> float | None:
        """The least budget left over the task and its ancestors (each budget covers its
        subtree's spending); None when none of them has a budget."""
        task = self._tasks.get(key)
        left = [s.budget - s.tree_cost for s in self._lineage(task) if s.budget is not None]
        return min(left) if left else None

    def _lineage(self, task: TaskState | None) -> list[TaskState]:
        """The task, its parent, and so on up to its root (those still in the book)."""
        chain = []
        while task is not None:
            chain.append(task)
            task = self._tasks.get(task.parent) if task.parent is not None else None
        return chain

    def parent_load(self, key: TaskId) -> ParentLoad | None:
        """The task as the parent of a new one; None when the book has no such task."""
        state = self._tasks.get(key)
        if state is None:
            return None
        load = state.load
        return ParentLoad(state.client_id, load.open_children, load.max_children, load.depth)

    def tenant_loads(self, now: float) -> dict[str, TenantLoad]:
        """Turns in flight and counted open tasks per tenant, as of `now`."""
        return self._loads.tenant_loads(now)
