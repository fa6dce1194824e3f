"""Turns in flight by task: what a task's cancellation and the turn's deadline reach.

A turn waiting on its worker is cancelled there (the desk answers 409); a stream being
relayed stops at its next chunk with an error event. A task closed because its parent
succeeded without it (a discarded branch) is stopped the same way, its attempts recorded
`discarded`. Either way the worker's request is
closed, which aborts it.

A turn whose task has a deadline arms one alarm when it takes off, disarmed when it lands:
at its share of the deadline, the deadline less what its task's class is expected to need
after it (services/tasks/task_paces.py). If the alarm goes off while the turn still waits on its
worker (no first byte: a stream not started, or an answer not yet given), the turn is
aborted as a cancellation aborts it and the desk answers 504 `deadline_missed`, saying what
of the deadline was kept; a stream already relaying runs on.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from appliance.domain.records import TaskId, TurnOutcome
from appliance.policy.deadline_share import TurnShare
from appliance.ports import Clock
from appliance.services.tasks.task_state import TaskError

DEADLINE_MISSED = "deadline_missed"
"""The error of a turn aborted at its deadline: its turn row's, and the client's code."""
Disarm = Callable[[], None]
Alarm = Callable[[float, Callable[[], None]], Disarm]
"""(when, on the clock's scale; what to call then) -> what disarms it."""


def loop_alarm(clock: Clock) -> Alarm:
    """An alarm on the event loop's timer: at `when` by `clock`, as far ahead as it says."""

    def arm(when: float, call: Callable[[], None]) -> Disarm:
        delay = max(0.0, when - clock.now())
        return asyncio.get_running_loop().call_later(delay, call).cancel

    return arm


@dataclass(eq=False)
class Flight:
    """One turn in flight, as its task's cancellation and its deadline reach it."""

    task: asyncio.Task[Any] | None
    """The request's own task, cancelled while it waits on its worker."""
    stopped: bool = False
    relaying: bool = False
    """Its stream is being relayed: it stops at its next chunk instead."""
    missed: bool = False
    """Its deadline passed while it waited on its worker: it was stopped for that."""
    share: TurnShare | None = None
    """Its share of its task's deadline (None: no deadline)."""
    outcome: TurnOutcome = TurnOutcome.CANCELLED
    """What its attempt is recorded as once stopped: `discarded` when its task was closed
    because its parent succeeded without it."""
    disarm: Disarm | None = None

    def stopped_as(self) -> TurnOutcome | None:
        """What its attempt is recorded as, once stopped; None while it is not."""
        return self.outcome if self.stopped else None


class Flights:
    def __init__(self, alarm: Alarm) -> None:
        self._by_task: dict[TaskId, set[Flight]] = {}
        self._alarm = alarm

    def take_off(self, task: TaskId, share: TurnShare | None = None) -> Flight:
        """The current request's turn of `task` is in flight; it must have its first byte
        by its share of the deadline (None: no deadline)."""
        flight = Flight(asyncio.current_task(), share=share)
        self._by_task.setdefault(task, set()).add(flight)
        if share is not None:
            flight.disarm = self._alarm(share.deadline_at, partial(_deadline, flight))
        return flight

    def land(self, task: TaskId, flight: Flight) -> None:
        if flight.disarm is not None:
            flight.disarm()
        flights = self._by_task.get(task)
        if flights is not None:
            flights.discard(flight)
            if not flights:
                del self._by_task[task]

    def stop(self, task: TaskId, outcome: TurnOutcome = TurnOutcome.CANCELLED) -> int:
        """Ends the task's turns in flight, their attempts recorded as `outcome`; how many
        it ended."""
        flights = self._by_task.get(task, set())
        for flight in flights:
            flight.stopped = True
            flight.outcome = outcome
            if not flight.relaying and flight.task is not None:
                flight.task.cancel()
        return len(flights)


def _deadline(flight: Flight) -> None:
    """The flight's deadline has come: aborted unless it has started or was stopped."""
    if flight.relaying or flight.stopped or flight.task is None:
        return
    flight.stopped = flight.missed = True
    flight.task.cancel()


def stopped_error(client_task: str, flight: Flight) -> TaskError:
    """What a client whose turn was stopped while it waited on its worker is told."""
    if flight.missed:
        return TaskError(_missed(client_task, flight.share), code=DEADLINE_MISSED, http_status=504)
    if flight.outcome is TurnOutcome.DISCARDED:
        return TaskError(
            f"task {client_task} was discarded: its parent succeeded without it",
            code="task_discarded",
            http_status=409,
        )
    return TaskError(f"task {client_task} was cancelled", code="task_cancelled", http_status=409)


def _missed(client_task: str, share: TurnShare | None) -> str:
    if share is None or share.reserve is None or share.kept_s <= 0:
        return (
            f"task {client_task}'s deadline passed before its worker started the turn; "
            "the turn was aborted"
        )
    return (
        f"task {client_task}'s turn had not started within its share of the deadline "
        f"({share.given_s:.3f} s; {share.kept_s:.3f} s kept for {share.reserve.describe()}); "
        "the turn was aborted"
    )
