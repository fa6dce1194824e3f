"""A task's tool events, as the idle reaper hears them (the task book's `on_tool_event`),
and the live restore on lead time that hears `tool_finished`.

A client that reports its tools (`POST /v1/tasks/{id}/events`) says when one starts (its
class and expected wait, `tool_started`) and when it finishes (`tool_finished`). The first
tells the reaper what the task's waiting sessions wait on (`ReaperLoop.tool_started`: they
are decided again on it); the second that their next turn is near (`LeadTime`: a demoted
session is restored).
"""

from __future__ import annotations

from appliance.domain.records import TaskEventType, TaskId
from appliance.policy.prefetch import (
    DEFAULT_TRIGGERS,
    RESTORE_AHEAD_TRIGGERS,
    PrefetchPolicy,
    PrefetchTuning,
)
from appliance.ports import Ledger
from appliance.services.residency.lead_time import LeadTime
from appliance.services.residency.reaper_loop import ReaperLoop
from appliance.services.residency.residency_inputs import LiveInputs
from appliance.services.tasks.task_state import ToolEventHook


def reaper_hears(loop: ReaperLoop) -> ToolEventHook:
    """The hook that passes a task's tool events to `loop` (and its lead time)."""

    def heard(
        task: TaskId,
        kind: TaskEventType,
        tool_class: str | None,
        expected_s: float | None,
        now: float,
    ) -> None:
        if kind is TaskEventType.TOOL_STARTED:
            loop.tool_started(task, tool_class, expected_s, now)
        elif kind is TaskEventType.TOOL_FINISHED and loop.lead_time is not None:
            loop.lead_time.tool_finished(task, tool_class, now)

    return heard


def restore_on_lead(
    loop: ReaperLoop, inputs: LiveInputs, ledger: Ledger, *, restore_ahead: bool
) -> LeadTime:
    """Restore on lead time for `loop`'s waiting sessions: on `tool_finished`, and with
    `restore_ahead` on the reaper's wait model's due times too. Live restores only promote
    (no prefill)."""
    triggers = RESTORE_AHEAD_TRIGGERS if restore_ahead else DEFAULT_TRIGGERS
    prefetch = PrefetchPolicy(PrefetchTuning(prefill=False, triggers=triggers))
    waiting = loop.waiting_sessions
    return LeadTime(
        prefetch,
        inputs,
        loop.outbox,
        ledger=ledger,
        waiting=waiting,
        survival=loop.driver.survival,  # the policy's wait model, where it has one
        horizon_s=loop.max_idle_s,  # its due times
    )
