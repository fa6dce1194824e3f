"""Worker restarts and outages as operator events, from the readings the appliance polls.

Model of the world: whoever keeps a worker (the supervisor for vLLM, the sim's process, or
nobody for an external server) counts its restarts on the worker's handle and keeps its
health current. The daemon polls every worker twice a second; this watch compares each
reading with the previous one and records in the event feed what changed: a restart count
that went up (`worker_restart`), a worker that stopped answering (`worker_down`) or answers
again (`worker_up`). The first reading of a worker only sets what later ones compare with.
A worker put to rest on request (asleep, stopped, waking: `resting`) is no outage: its
power changes arrive as the supervisor's worker events instead, which `record_power_event`
turns into `worker_slept`, `worker_stopped`, `worker_waking`, `worker_woken` (with the
measured wake time) and `worker_wake_failed`. The engines layer thus never imports the feed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from appliance.domain.worker import WorkerEvent, WorkerEventKind
from appliance.ports import WorkerEndpoint
from appliance.services.operator.events import Event, EventFeed, EventKind


class WorkerWatch:
    """`restarts(w)`: the worker's restart count; `resting(w)`: it is asleep, stopped or
    waking on request (default: never)."""

    def __init__(
        self,
        feed: EventFeed,
        restarts: Callable[[WorkerEndpoint], int],
        resting: Callable[[WorkerEndpoint], bool] = lambda w: False,
    ) -> None:
        self._feed = feed
        self._restarts = restarts
        self._resting = resting
        self._seen: dict[str, tuple[int, bool, bool]] = {}
        """Restarts, health and rest of each worker at the previous reading."""

    def observe(self, workers: Iterable[WorkerEndpoint], now: float) -> None:
        for w in workers:
            restarts, healthy, resting = self._restarts(w), w.healthy, self._resting(w)
            before = self._seen.get(w.id)
            self._seen[w.id] = (restarts, healthy, resting)
            if before is None:
                continue
            was_restarts, was_healthy, was_resting = before
            if restarts > was_restarts:
                more = restarts - was_restarts
                self._feed.record(
                    now,
                    EventKind.WORKER_RESTART,
                    w.id,
                    f"restarted{f' {more} times' if more > 1 else ''}; "
                    f"{restarts} restarts since the appliance started",
                )
            if was_healthy and not healthy and not resting:
                self._feed.record(now, EventKind.WORKER_DOWN, w.id, "stopped answering /health")
            elif healthy and not was_healthy and not was_resting:
                self._feed.record(now, EventKind.WORKER_UP, w.id, "answers /health again")


_POWER_KINDS = {
    WorkerEventKind.SLEPT: EventKind.WORKER_SLEPT,
    WorkerEventKind.STOPPED_ON_REQUEST: EventKind.WORKER_STOPPED,
    WorkerEventKind.WAKE_STARTED: EventKind.WORKER_WAKING,
    WorkerEventKind.WOKEN: EventKind.WORKER_WOKEN,
    WorkerEventKind.WAKE_FAILED: EventKind.WORKER_WAKE_FAILED,
}


def record_power_event(feed: EventFeed, event: WorkerEvent) -> Event | None:
    """A supervisor's worker event in the feed if it is a power change (None otherwise):
    e.g. `worker_woken` "woke from sleep level 1 in 0.42 s"."""
    kind = _POWER_KINDS.get(event.kind)
    if kind is None:
        return None
    came = "stopped" if event.level is None else f"sleep level {event.level}"
    took = "" if event.duration_s is None else f" in {event.duration_s:.2f} s"
    detail = {
        EventKind.WORKER_SLEPT: f"put to sleep at level {event.level}{took}; its KV is gone",
        EventKind.WORKER_STOPPED: f"stopped on request{took}; its KV is gone",
        EventKind.WORKER_WAKING: f"waking from {came}",
        EventKind.WORKER_WOKEN: f"woke from {came}{took}",
        EventKind.WORKER_WAKE_FAILED: f"the wake from {came} failed: {event.detail}",
    }[kind]
    return feed.record(event.time, kind, event.worker, detail)


def power_event_sink(feed: EventFeed) -> Callable[[WorkerEvent], None]:
    """The supervisor's `on_event`: each worker event to `record_power_event` on `feed`."""

    def sink(event: WorkerEvent) -> None:
        record_power_event(feed, event)

    return sink
