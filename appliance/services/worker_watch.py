"""Worker restarts and outages as operator events, from the readings the appliance polls.

Model of the world: whoever keeps a worker (the supervisor for vLLM, the sim's process, or
nobody for an external server) counts its restarts on the worker's handle and keeps its
health current. The daemon polls every worker twice a second; this watch compares each
reading with the previous one and records in the event feed what changed: a restart count
that went up (`worker_restart`), a worker that stopped answering (`worker_down`) or answers
again (`worker_up`). The first reading of a worker only sets what later ones compare with.
The engines layer thus never imports the feed.

A worker the appliance put to rest on purpose (asleep, stopped idle, or waking from either:
`resting`) does not answer /health either, yet it is no outage: it counts as up, so its
sleep and its wake record no `worker_down` or `worker_up` (their own events say them).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from appliance.ports import WorkerEndpoint
from appliance.services.events import EventFeed, EventKind


class WorkerWatch:
    def __init__(
        self,
        feed: EventFeed,
        restarts: Callable[[WorkerEndpoint], int],
        resting: Callable[[WorkerEndpoint], bool] = lambda w: False,
    ) -> None:
        self._feed = feed
        self._restarts = restarts
        self._resting = resting
        self._seen: dict[str, tuple[int, bool]] = {}
        """Restarts and health (resting counts as healthy) of each worker at the previous
        reading."""

    def observe(self, workers: Iterable[WorkerEndpoint], now: float) -> None:
        for w in workers:
            restarts, healthy = self._restarts(w), w.healthy or self._resting(w)
            before = self._seen.get(w.id)
            self._seen[w.id] = (restarts, healthy)
            if before is None:
                continue
            was_restarts, was_healthy = before
            if restarts > was_restarts:
                more = restarts - was_restarts
                self._feed.record(
                    now,
                    EventKind.WORKER_RESTART,
                    w.id,
                    f"restarted{f' {more} times' if more > 1 else ''}; "
                    f"{restarts} restarts since the appliance started",
                )
            if was_healthy and not healthy:
                self._feed.record(now, EventKind.WORKER_DOWN, w.id, "stopped answering /health")
            elif healthy and not was_healthy:
                self._feed.record(now, EventKind.WORKER_UP, w.id, "answers /health again")
