"""The operator's event feed: worker restarts and outages, workers slept, stopped and woken,
admission rejections, releases and task cancellations (`EventKind` names every kind the
appliance records).

Every component that makes such a change records it here in the same place it makes the
change (and writes its ledger row there too, where the change has one). The feed keeps the
newest `capacity` events in memory for `/admin/v1/state` and the console's Events screen;
the ledger, not this feed, is the history.
"""

from __future__ import annotations

from collections import deque
from dataclasses import asdict, dataclass
from enum import StrEnum
from typing import Any

DEFAULT_CAPACITY = 500


class EventKind(StrEnum):
    WORKER_RESTART = "worker_restart"
    WORKER_DOWN = "worker_down"
    WORKER_UP = "worker_up"
    REJECTION = "rejection"
    """Admission refused a task or a turn."""
    RELEASE = "release"
    """An operator released a session's KV."""
    TASK_CANCELLED = "task_cancelled"
    WORKER_SLEPT = "worker_slept"
    """A worker was put to sleep (detail: the level and how long the sleep took)."""
    WORKER_STOPPED = "worker_stopped"
    """A worker's process was ended on request while the appliance runs (not a crash)."""
    WORKER_WAKING = "worker_waking"
    """A wake began, from a sleep level or from stopped."""
    WORKER_WOKEN = "worker_woken"
    """A worker serves again; the detail has the measured wake time."""
    WORKER_WAKE_FAILED = "worker_wake_failed"
    """A wake did not bring the worker up; it stays where it was."""


@dataclass(frozen=True, slots=True)
class Event:
    at: float
    kind: EventKind
    subject: str
    """What it happened to: a worker id, a session id, a task id."""
    detail: str
    """One line an operator can read: why it happened."""
    tenant: str | None = None


class EventFeed:
    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        self._events: deque[Event] = deque(maxlen=capacity)
        self.counts: dict[str, int] = {}
        """Events of each kind since start (not bounded by the capacity)."""

    def record(
        self, at: float, kind: EventKind, subject: str, detail: str, *, tenant: str | None = None
    ) -> Event:
        event = Event(at, kind, subject, detail, tenant)
        self._events.append(event)
        self.counts[kind] = self.counts.get(kind, 0) + 1
        return event

    def recent(self, limit: int | None = None) -> list[dict[str, Any]]:
        """Newest first, as JSON-ready dicts."""
        newest = reversed(self._events)
        out = [asdict(e) for e in newest]
        return out if limit is None else out[:limit]

    def __len__(self) -> int:
        return len(self._events)
