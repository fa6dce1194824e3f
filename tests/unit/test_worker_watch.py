"""Worker restarts and outages become events when the polled readings change."""

from __future__ import annotations

from dataclasses import dataclass

from appliance.domain.records import WorkerId
from appliance.domain.worker import AT_REST, WorkerState
from appliance.services.events import EventFeed
from appliance.services.worker_watch import WorkerWatch


@dataclass
class Worker:
    id: WorkerId
    healthy: bool = True
    restarts: int = 0
    state: WorkerState = WorkerState.HEALTHY


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


def test_a_worker_put_to_rest_and_woken_is_no_outage() -> None:
    feed = EventFeed()
    watch = WorkerWatch(feed, restarts=lambda w: 0, resting=lambda w: w.state in AT_REST)  # type: ignore[attr-defined]
    w0 = Worker(WorkerId("w0"))
    watch.observe([w0], 1.0)
    for at, state in enumerate([WorkerState.ASLEEP, WorkerState.WAKING, WorkerState.HEALTHY,
                                WorkerState.STOPPED, WorkerState.WAKING], start=2):  # fmt: skip
        w0.state, w0.healthy = state, state == WorkerState.HEALTHY
        watch.observe([w0], float(at))
    assert kinds(feed) == []
    w0.state = WorkerState.HEALTHY
    w0.healthy = True
    watch.observe([w0], 8.0)
    w0.state, w0.healthy = WorkerState.EXITED, False  # a crash is still one
    watch.observe([w0], 9.0)
    assert kinds(feed) == [("worker_down", "w0")]
