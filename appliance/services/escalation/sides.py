"""Each turn's side, and the side each task is pinned to: the rules are
policy/escalation.py's; this keeps the pins (a task's turns stay on the side its first
escalated turn chose, or that a header named), the most recent `MAX_PINNED` tasks'."""

from __future__ import annotations

from collections import OrderedDict

from appliance.domain.records import TaskId
from appliance.policy.escalation import Side, SideRules, choose_side

MAX_PINNED = 100_000


class TaskSides:
    def __init__(self, rules: SideRules) -> None:
        self.rules = rules
        self._pins: OrderedDict[TaskId, str] = OrderedDict()

    def choose(self, task: TaskId, *, header: str | None, task_class: str | None) -> Side:
        """The turn's side (raises UnknownEndpoint for a header naming none); a side a rule
        chose is the task's from now on."""
        side = choose_side(
            self.rules, header=header, task_class=task_class, pinned=self._pins.get(task)
        )
        if side.pin is not None:
            self._pins[task] = side.pin
            self._pins.move_to_end(task)
            while len(self._pins) > MAX_PINNED:
                self._pins.popitem(last=False)
        return side

    def pinned(self, task: TaskId) -> str | None:
        return self._pins.get(task)
