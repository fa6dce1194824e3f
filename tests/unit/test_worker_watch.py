"""Worker restarts and outages become events when the polled readings change."""

from __future__ import annotations

from dataclasses import dataclass

from appliance.domain.records import WorkerId
from appliance.domain.worker import WorkerEvent, WorkerEventKind, WorkerState
from appliance.services.operator.events import EventFeed
from appliance.services.workers.worker_watch import WorkerWatch, record_power_event


@dataclass
class Worker:
    id: WorkerId
    healthy: bool = True
    restarts: int = 0


def kinds(feed: EventFeed) -> list[tuple[str, str]]:
    return [(e["kind"], e["subject"]) for e in reversed(feed.recent())]


def test_restarts_and_health_changes_are_recorded_once_each() -> None:
    feed = EventFeed()
    watch = WorkerWatch(feed, restarts=lambda w: w.restarts)  # type: ignore[attr-defined]
    w0, w1 = Worker(WorkerId("w0")), Worker(WorkerId("w1"), restarts=2)
    watch.observe([w0, w1], 1.0)
    assert kinds(feed) == [], "the first reading only sets the baseline"
    w0.healthy = False
    watch.observe([w0, w1], 2.0)
    watch.observe([w0, w1], 2.5)
    w0.restarts, w0.healthy = 1, True
    w1.restarts = 4
    watch.observe([w0, w1], 3.0)
    assert kinds(feed) == [
        ("worker_down", "w0"),
        ("worker_restart", "w0"),
        ("worker_up", "w0"),
        ("worker_restart", "w1"),
    ]
    newest = feed.recent(1)[0]
    assert newest["at"] == 3.0 and "4 restarts" in newest["detail"]
    assert "2 times" in newest["detail"]


def test_a_worker_seen_first_while_down_is_not_an_outage() -> None:
    feed = EventFeed()
    watch = WorkerWatch(feed, restarts=lambda w: 0)
    down = Worker(WorkerId("w0"), healthy=False)
    watch.observe([down], 1.0)
    watch.observe([down], 2.0)
    assert kinds(feed) == []


@dataclass
class Resting(Worker):
    resting: bool = False


def test_a_worker_put_to_rest_on_request_is_no_outage() -> None:
    feed = EventFeed()
    watch = WorkerWatch(feed, restarts=lambda w: 0, resting=lambda w: w.resting)  # type: ignore[attr-defined]
    w0 = Resting(WorkerId("w0"))
    watch.observe([w0], 1.0)
    w0.healthy, w0.resting = False, True  # asleep, stopped or waking
    watch.observe([w0], 2.0)
    w0.healthy, w0.resting = True, False  # woken
    watch.observe([w0], 3.0)
    assert kinds(feed) == []
    w0.healthy = False  # a crash
    watch.observe([w0], 4.0)
    assert kinds(feed) == [("worker_down", "w0")]


def _event(kind: WorkerEventKind, **fields: object) -> WorkerEvent:
    return WorkerEvent(WorkerId("w1"), kind, 5.0, WorkerState.HEALTHY, **fields)  # type: ignore[arg-type]


def test_power_changes_become_events_with_their_measured_time() -> None:
    feed = EventFeed()
    record_power_event(feed, _event(WorkerEventKind.STOPPED_ON_REQUEST, duration_s=0.4))
    record_power_event(feed, _event(WorkerEventKind.WAKE_STARTED))
    record_power_event(feed, _event(WorkerEventKind.WOKEN, duration_s=12.345))
    record_power_event(feed, _event(WorkerEventKind.SLEPT, level=1, duration_s=0.05))
    record_power_event(feed, _event(WorkerEventKind.WAKE_FAILED, level=1, detail="boom"))
    assert record_power_event(feed, _event(WorkerEventKind.HEALTHY)) is None
    shown = [(e["kind"], e["detail"]) for e in reversed(feed.recent())]
    assert shown == [
        ("worker_stopped", "stopped on request in 0.40 s; its KV is gone"),
        ("worker_waking", "waking from stopped"),
        ("worker_woken", "woke from stopped in 12.35 s"),
        ("worker_slept", "put to sleep at level 1 in 0.05 s; its KV is gone"),
        ("worker_wake_failed", "the wake from sleep level 1 failed: boom"),
    ]
    assert feed.recent(1)[0]["at"] == 5.0 and feed.recent(1)[0]["subject"] == "w1"
