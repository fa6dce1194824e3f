"""Task classes' paces: what the finished tasks of each class took, learned live, and each
turn's share of its task's deadline from them (appliance/policy/deadline_share.py states the
model and the rule).

A task of a class (`task_class` at `POST /v1/tasks`) that closes `succeeded`, with every turn
it ran seen here (the task book's `TurnPace`: not one taken back after a restart, nor one
closed with a turn still in flight), adds a run to its class's history: per tenant and class
the newest HISTORY_RUNS, for the HISTORY_CLASSES classes most recently learned from, so memory
stays bounded whatever names clients send. A task that failed or was cancelled is not learned
from: it stopped short of what its class takes. A restart starts from the ledger's newest
succeeded tasks of each class (appliance/start/class_paces.py).

Each turn of a task with a deadline gets its share when it takes off (`share`): the deadline
less its class's reserve after this turn (the task book has counted it), never below the
turn's own need at the worker placement chose (admission's estimate of its first token there),
never after the deadline. The answer says both (`share_headers`):

    X-Appliance-Turn-Timeout-S      the seconds from admission the turn had to start
                                    answering (its first byte; a non-streamed answer: the
                                    whole answer)
    X-Appliance-Deadline-Reserve-S  the seconds of the task's deadline kept after that for
                                    its expected remaining work (0: no history, none kept)

A turn that has not started by then is aborted at its worker and answered 504
`deadline_missed` (services/turns/flights.py), the message saying what was kept and why.
"""

from __future__ import annotations

import logging
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable

from appliance.domain.records import TaskId, TaskStatus
from appliance.policy.deadline_share import (
    MIN_RUNS,
    Reserve,
    TaskRun,
    TurnShare,
    effective_deadline,
    reserve_after,
    turn_share,
)
from appliance.ports import Clock
from appliance.services.tasks.task_state import TaskState

log = logging.getLogger(__name__)

HISTORY_RUNS = 64
"""Finished tasks kept per tenant and class, the newest."""
HISTORY_CLASSES = 1024
"""Tenant and class pairs kept, those most recently learned from."""
ClassRun = tuple[str, str, TaskRun]
"""(tenant, task class, one of its finished tasks)."""


class TaskPaces:
    def __init__(
        self,
        clock: Clock,
        *,
        runs: int = HISTORY_RUNS,
        classes: int = HISTORY_CLASSES,
        min_runs: int = MIN_RUNS,
    ) -> None:
        self._clock = clock
        self._runs = runs
        self._classes = classes
        self._min_runs = min_runs
        self._history: OrderedDict[tuple[str, str], deque[TaskRun]] = OrderedDict()

    def observe(self, tenant: str, task_class: str, run: TaskRun) -> None:
        """One finished task of the class."""
        key = (tenant, task_class)
        runs = self._history.get(key)
        if runs is None:
            runs = self._history[key] = deque(maxlen=self._runs)
        runs.append(run)
        self._history.move_to_end(key)
        while len(self._history) > self._classes:
            self._history.popitem(last=False)

    def warm(self, runs: Iterable[ClassRun]) -> None:
        """Finished tasks from before a restart, oldest first."""
        for tenant, task_class, run in runs:
            self.observe(tenant, task_class, run)

    def closed(self, task: TaskState) -> None:
        """A task closed: one that succeeded, of a class, its turns all timed here, is
        learned from."""
        run = run_of(task, self._clock.now())
        if run is not None and task.task_class is not None:
            self.observe(task.tenant, task.task_class, run)

    def hearing(self, then: Callable[[TaskId], None]) -> Callable[[TaskState], None]:
        """The task book's `on_close`: learns from the closed task, then tells `then`."""

        def done(task: TaskState) -> None:
            self.closed(task)
            then(task.key)

        return done

    def reserve(self, task: TaskState) -> Reserve | None:
        """What the task's class asks to keep after its current turn (None: no history)."""
        if task.task_class is None:
            return None
        runs = self._history.get((task.tenant, task.task_class), ())
        return reserve_after(runs, task.turns, self._min_runs)

    def share(
        self, task: TaskState, now: float, deadline_s: float | None, need_s: float
    ) -> TurnShare | None:
        """The share of the task's deadline of its turn taking off now, whose own need is
        `need_s` (None: no deadline); `deadline_s`: the turn's own X-Deadline-S."""
        deadline_at = effective_deadline(now, deadline_s, task.deadline_at)
        if deadline_at is None:
            return None
        share = turn_share(now, deadline_at, self.reserve(task), need_s)
        if share.cut and share.reserve is not None:
            log.info(
                "turn %d of task %s needs %.3f s, beyond its share of the deadline: it runs "
                "into the %.3f s kept for %s",
                task.turns,
                task.key,
                need_s,
                share.reserve.seconds,
                share.reserve.describe(),
            )
        return share


def run_of(task: TaskState, now: float) -> TaskRun | None:
    """The task as a run of its class's history, closed at `now`; None unless it
    succeeded with every turn it ran timed here and none in flight."""
    pace = task.load.pace
    whole = pace.turns == task.turns and not task.load.in_flight
    if task.status is not TaskStatus.SUCCEEDED or not whole or pace.last_ended_at is None:
        return None
    span = pace.last_ended_at - (pace.first_began_at or pace.last_ended_at)
    between = max(0.0, span - pace.busy_s)
    return TaskRun(pace.turns, pace.busy_s, between, max(0.0, now - pace.last_ended_at))


def share_headers(share: TurnShare | None) -> dict[str, str]:
    """What the answer says of its turn's share of the deadline (the module docstring)."""
    if share is None:
        return {}
    return {
        "X-Appliance-Turn-Timeout-S": f"{share.given_s:.3f}",
        "X-Appliance-Deadline-Reserve-S": f"{share.kept_s:.3f}",
    }
