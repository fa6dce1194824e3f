"""What a routing callback of the virtual driver (`virtual.replay`) sees of the engines, and
two simple routes: engines in turn, and a fixed engine per session."""

from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from appliance.sim.core.engine import SimEngine
from appliance.sim.engine_io import SimRequest


@dataclass(frozen=True, slots=True)
class EngineView:
    """What a routing callback sees of one engine at the arrival time."""

    index: int
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    engine: SimEngine
    """The engine itself, e.g. for `engine.cache.lookup`; a router must not change it."""


Route = Callable[[SimRequest, Sequence[EngineView]], int]


def round_robin() -> Route:
    """Engines in turn, whatever their state."""
    state = {"next": 0}

    def route(req: SimRequest, views: Sequence[EngineView]) -> int:
        i = state["next"] % len(views)
        state["next"] = i + 1
        return i

    return route


def session_hash() -> Route:
    """A fixed engine per session (CRC-32 of the session id, else of the request id)."""

    def route(req: SimRequest, views: Sequence[EngineView]) -> int:
        key = req.session_id if req.session_id is not None else req.request_id
        return zlib.crc32(key.encode()) % len(views)

    return route


def engine_views(engines: Sequence[SimEngine]) -> list[EngineView]:
    """What a routing callback sees of each engine now."""
    views = []
    for i, e in enumerate(engines):
        running, waiting = e.queue_lengths()
        views.append(EngineView(i, running, waiting, e.cache.usage, e))
    return views
