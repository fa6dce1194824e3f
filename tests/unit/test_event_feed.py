import json

from appliance.services.operator.events import EventFeed, EventKind


def test_feed_keeps_the_newest_events_first_and_counts_every_kind() -> None:
    feed = EventFeed(capacity=3)
    for i in range(5):
        kind = EventKind.RELEASE if i % 2 else EventKind.REJECTION
        feed.record(float(i), kind, f"s{i}", f"why {i}")
    recent = feed.recent()
    assert [e["subject"] for e in recent] == ["s4", "s3", "s2"]
    assert recent[0] == {
        "at": 4.0,
        "kind": "rejection",
        "subject": "s4",
        "detail": "why 4",
        "tenant": None,
    }
    assert json.loads(json.dumps(recent))[1]["kind"] == "release"  # as the state sends it
    assert feed.counts == {"rejection": 3, "release": 2}
    assert [e["subject"] for e in feed.recent(limit=1)] == ["s4"]
    assert len(feed) == 3
