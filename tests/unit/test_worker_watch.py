"""Worker restarts and outages become events when the polled readings change."""

from __future__ import annotations

from dataclasses import dataclass

from appliance.domain.records import WorkerId
from appliance.services.events import EventFeed
from appliance.services.worker_watch import WorkerWatch


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
