"""Turns in flight by task: what a task's cancellation reaches.

A turn waiting on its worker is cancelled there (the desk answers 409); a stream being
relayed stops at its next chunk with an error event. Either way the worker's request is
closed, which aborts it.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from appliance.domain.records import TaskId


@dataclass(eq=False)
class Flight:
    """One turn in flight, as its task's cancellation reaches it."""

    task: asyncio.Task[Any] | None
    """The request's own task, cancelled while it waits on its worker."""
    stopped: bool = False
    relaying: bool = False
    """Its stream is being relayed: it stops at its next chunk instead."""


class Flights:
    def __init__(self) -> None:
        self._by_task: dict[TaskId, set[Flight]] = {}

    def take_off(self, task: TaskId) -> Flight:
        """The current request's turn of `task` is in flight."""
        flight = Flight(asyncio.current_task())
        self._by_task.setdefault(task, set()).add(flight)
        return flight

    def land(self, task: TaskId, flight: Flight) -> None:
        flights = self._by_task.get(task)
        if flights is not None:
            flights.discard(flight)
            if not flights:
                del self._by_task[task]

    def stop(self, task: TaskId) -> int:
        """Ends the task's turns in flight; how many it ended."""
        flights = self._by_task.get(task, set())
        for flight in flights:
            flight.stopped = True
            if not flight.relaying and flight.task is not None:
                flight.task.cancel()
        return len(flights)
