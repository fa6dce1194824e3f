"""A task as the task book (services/tasks/tasks.py) holds it, its turns' events (published by
the turn desk), its refusals, and its document
(`GET /v1/tasks/{id}`) from the book or, for a task the book no longer holds, from the
ledger's rows (ledger/task_history.py) in the same shape."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol

from appliance.domain.errors import ApplianceError
from appliance.domain.records import (
    ArchivedTask,
    OpenTask,
    TaskEventType,
    TaskId,
    TaskRecord,
    TaskStatus,
    TenantId,
)
from appliance.services.tasks.task_load import Standing, TaskLoad


@dataclass(frozen=True, slots=True)
class TaskTurnBegan:
    """A turn of `task` starts `at` at the turn desk: admitted, going to the box or outside.
    The task is the task book's: to read, never to change."""

    task: TaskState
    at: float


@dataclass(frozen=True, slots=True)
class TaskTurnEnded:
    """A turn of `task` has ended `at` (its answer, or its stream), however it ended."""

    task: TaskState
    at: float


ToolEventHook = Callable[[TaskId, TaskEventType, str | None, float | None, float], None]
"""Told of each `tool_started` and `tool_finished`: task, kind, tool class, expected s, now."""


class TaskTurnSubscriber(Protocol):
    """Hears of each turn the turn desk begins and ends (the task book, and whoever the
    desk is built with)."""

    def turn_began(self, event: TaskTurnBegan) -> None: ...

    def turn_ended(self, event: TaskTurnEnded) -> None: ...


class TaskError(ApplianceError):
    code = "task_error"
    http_status = 400


class TaskClosed(TaskError):
    """The task (or the parent named) is closed: it takes no such change."""

    code = "task_closed"
    http_status = 409


@dataclass(eq=False)
class TaskState:
    key: TaskId
    """The ledger's id: tenant/client-id."""
    client_id: str
    tenant: TenantId
    created_at: float
    parent: TaskId | None = None
    task_class: str | None = None
    deadline_at: float | None = None
    status: TaskStatus = TaskStatus.OPEN
    verified: bool | None = None
    children: list[TaskId] = field(default_factory=list)
    turns: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    cost: float = 0.0
    """Sum of the ledger's costs of this task's attempts (children not included)."""
    gpu_s: float = 0.0
    """GPU-seconds of this task's attempts this run (children not included)."""
    budget: float | None = None
    """What the task's subtree may spend, in the ledger's currency; None: no budget."""
    tree_cost: float = 0.0
    """Sum of the ledger's costs of the attempts of this task and its descendants."""
    written: Future[None] | None = None
    """The ledger write of the latest change; await it before telling a client it is done."""
    load: TaskLoad = field(default_factory=TaskLoad)

    @property
    def unseen(self) -> bool:
        """Taken back after a restart and named by no turn since."""
        return self.load.standing is Standing.UNSEEN


def state_of(t: OpenTask | ArchivedTask) -> TaskState:
    """A task as the ledger keeps it, in the book's form (open; the book links it)."""
    return TaskState(
        TaskId(t.task_id),
        _client_id(t.task_id),
        TenantId(t.tenant),
        t.created_at,
        TaskId(t.parent_task_id) if t.parent_task_id else None,
        t.task_class,
        t.deadline_at,
        turns=t.turns,
        prompt_tokens=t.prompt_tokens,
        cached_tokens=t.cached_tokens,
        output_tokens=t.output_tokens,
        cost=t.cost,
    )


def task_record(state: TaskState) -> TaskRecord:
    """The ledger's row of the task as created."""
    return TaskRecord(
        state.key,
        state.tenant,
        state.created_at,
        state.parent,
        state.task_class,
        state.deadline_at,
        state.budget,
        state.load.max_children,
    )


def undo_refused(
    written: Future[None], state: TaskState, before: tuple[TaskStatus, bool | None]
) -> None:
    """A refused ledger write takes the status change back (the writer's thread)."""
    if written.exception() is not None:
        state.status, state.verified = before


def task_document(state: TaskState, find: Callable[[TaskId], TaskState | None]) -> dict[str, Any]:
    """The task and the descendants `find` has."""
    doc = _document(state, state.status, state.verified)
    doc["children"] = [task_document(c, find) for k in state.children if (c := find(k))]
    return doc


def archived_document(tree: Sequence[ArchivedTask]) -> dict[str, Any]:
    """The document of `tree` (TaskHistory.tree: the task first, parents before children)."""
    docs = {t.task_id: _document(t, t.status, t.verified) for t in tree}
    for t in tree[1:]:
        if t.parent_task_id in docs:
            docs[t.parent_task_id]["children"].append(docs[t.task_id])
    return docs[tree[0].task_id]


def _document(t: TaskState | OpenTask, status: TaskStatus, verified: bool | None) -> dict[str, Any]:
    key, parent = (t.key, t.parent) if isinstance(t, TaskState) else (t.task_id, t.parent_task_id)
    return {
        "id": _client_id(key),
        "parent_id": _client_id(parent) if parent else None,
        "tenant": t.tenant,
        "task_class": t.task_class,
        "status": status.value,
        "verified": verified,
        "deadline_at": t.deadline_at,
        "turns": t.turns,
        "cost": t.cost,
        "tokens": {"prompt": t.prompt_tokens, "cached": t.cached_tokens, "output": t.output_tokens},
        "children": [],
    }


def _client_id(key: str) -> str:
    return key.split("/", 1)[-1]
