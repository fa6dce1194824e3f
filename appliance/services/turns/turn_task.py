"""The task a model turn names, judged before the turn goes anywhere (services/turns/turn_desk.py):
an open one, or none yet, whose parent (if it names one) exists and is open."""

from __future__ import annotations

from appliance.services.tasks.task_state import TaskClosed, TaskError, TaskState
from appliance.services.tasks.tasks import TaskBook
from appliance.services.turns.turn import TurnRequest


def known_task(tasks: TaskBook, t: TurnRequest) -> TaskState | None:
    """The open task the turn names, if it exists; a closed one (succeeded, failed,
    cancelled) takes no more turns, and a new task's parent must exist and be open."""
    known = tasks.get(t.tenant, t.client_task_id) if t.client_task_id else None
    if known is not None and known.status.is_terminal:
        raise TaskClosed(f"task {t.client_task_id} is {known.status}; it takes no more turns")
    if known is None and t.client_parent_id and not tasks.get(t.tenant, t.client_parent_id):
        raise TaskError(
            f"parent task {t.client_parent_id} not found", code="task_not_found", http_status=404
        )
    if known is None:
        tasks.check_parent(t.tenant, t.client_parent_id)  # a closed one takes no more
    return known
