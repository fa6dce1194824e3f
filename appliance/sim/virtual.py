"""Replay arrivals across N simulated engines in virtual time (a discrete-event driver).

Model of the world: each engine is a GPU that runs one step at a time. Events sit on a heap
ordered by (time, kind, sequence): an arrival is routed to an engine and queued there; an
idle engine steps at once; a step that starts at `t` and lasts `d` completes at `t + d`,
when its outputs become visible (first-token and finish times are read there) and the
engine steps again if it has work. At equal times arrivals come before step completions,
so a request that arrives as a step ends joins the next step, as in vLLM's busy loop. A
step that only waits for host loads (`StepResult.idle_until_s`) is cut short by an arrival
for its engine, which steps at once (vLLM's loop keeps stepping while loads are in flight).
Nothing reads a wall clock, so a replay is deterministic: the same arrivals, routing and
engine settings give the same records, bit for bit.

Arrivals are consumed lazily, in time order (an iterator of 12k prompts of 100k tokens
would not fit in memory as a list). An arrival names its engine, or the `route` callback
picks one: `route(request, views) -> engine index`, where `views` shows each engine's
index, load and cache (see `EngineView`); `round_robin()` and `session_hash()` are provided.

Closed loops: `on_finish(record)` sees each request as it finishes and may return more
arrivals (an agent's next turn after its tool wait), at that time or later; they join the
heap like any other arrival, so a workload whose turns wait on each other's completions
runs in the same virtual time.
"""

from __future__ import annotations

import heapq
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

from appliance.sim.engine import SimEngine
from appliance.sim.engine_io import SimRequest, StepResult
from appliance.sim.engine_stats import EngineStats


@dataclass(frozen=True, slots=True)
class Arrival:
    """A request that arrives at `time_s`, for engine `worker` (None: ask the router)."""

    time_s: float
    request: SimRequest
    worker: int | None = None


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


@dataclass(slots=True)
class RequestRecord:
    """One request's life in the replay (times in virtual seconds)."""

    request_id: str
    worker: int
    arrival_s: float
    prompt_tokens: int
    first_token_s: float | None = None
    finish_s: float | None = None
    cached_tokens: int = 0
    host_cached_tokens: int = 0
    """Of `cached_tokens`, those loaded from the host tier."""
    output_tokens: int = 0
    finish_reason: str | None = None

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s


@dataclass(slots=True)
class ReplayResult:
    records: list[RequestRecord]
    engine_stats: list[EngineStats]
    end_s: float
    """When the last step completed (or the last arrival, if later)."""
    num_steps: int = 0


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


_ARRIVAL, _STEP_DONE = 0, 1
_FOLLOW = -2  # the engine slot of an arrival `on_finish` returned (-1: from `arrivals`)


def replay(
    engines: Sequence[SimEngine],
    arrivals: Iterable[Arrival],
    route: Route | None = None,
    *,
    on_step: Callable[[int, float, StepResult], None] | None = None,
    on_finish: Callable[[RequestRecord], Iterable[Arrival]] | None = None,
) -> ReplayResult:
    """Run every arrival to completion; `on_step(engine, time, result)` sees each step as
    its outputs become visible (KV events included); `on_finish(record)` may answer a
    finished request with new arrivals (not before its finish)."""
    if not engines:
        raise ValueError("replay needs at least one engine")
    router = route or round_robin()
    records: dict[str, RequestRecord] = {}
    order: list[RequestRecord] = []
    heap: list[tuple[float, int, int, int, StepResult | Arrival]] = []
    seq = 0
    busy = [False] * len(engines)
    idle_step: list[int | None] = [None] * len(engines)  # seq of a step that only waits
    cut_short: set[int] = set()
    steps = 0
    now = 0.0
    empty_steps = [0] * len(engines)

    source: Iterator[Arrival] = iter(arrivals)
    last_arrival = float("-inf")

    def push_next_arrival() -> None:
        nonlocal seq, last_arrival
        arrival = next(source, None)
        if arrival is None:
            return
        if arrival.time_s < last_arrival:
            raise ValueError(
                f"arrivals must come in time order: {arrival.request.request_id} at "
                f"{arrival.time_s} after {last_arrival}"
            )
        last_arrival = arrival.time_s
        seq += 1
        heapq.heappush(heap, (arrival.time_s, _ARRIVAL, seq, -1, arrival))

    def start_step(i: int, t: float) -> None:
        nonlocal seq, steps
        result = engines[i].step(t)
        steps += 1
        if result.num_scheduled_tokens == 0 and not result.outputs and result.idle_until_s is None:
            empty_steps[i] += 1
            if empty_steps[i] > 2:
                raise RuntimeError(f"engine {i} has work but schedules nothing at {t}")
        else:
            empty_steps[i] = 0
        busy[i] = True
        seq += 1
        idle_step[i] = seq if result.idle_until_s is not None else None
        heapq.heappush(heap, (t + result.duration_s, _STEP_DONE, seq, i, result))

    push_next_arrival()
    while heap:
        t, _, step_seq, i, payload = heapq.heappop(heap)
        if step_seq in cut_short:
            cut_short.discard(step_seq)
            continue
        now = t
        if isinstance(payload, Arrival):
            if i != _FOLLOW:
                push_next_arrival()
            req = payload.request
            w = payload.worker
            if w is None:
                w = router(req, _views(engines))
            if not 0 <= w < len(engines):
                raise ValueError(f"route sent {req.request_id} to engine {w} of {len(engines)}")
            engines[w].add_request(req, now)
            rec = RequestRecord(req.request_id, w, now, len(req.prompt_token_ids))
            records[req.request_id] = rec
            order.append(rec)
            waited = idle_step[w]
            if waited is not None:  # the engine only waits for loads: it steps now
                cut_short.add(waited)
                start_step(w, now)
            elif not busy[w]:
                start_step(w, now)
            continue
        assert isinstance(payload, StepResult)
        busy[i] = False
        idle_step[i] = None
        for out in payload.outputs:
            rec = records[out.request_id]
            if out.first_token:
                rec.first_token_s = now
                rec.cached_tokens = out.num_cached_tokens
                rec.host_cached_tokens = out.num_host_cached_tokens
            rec.output_tokens += len(out.new_token_ids)
            if out.finished:
                rec.finish_s = now
                rec.finish_reason = out.finish_reason
                del records[out.request_id]
                for follow in on_finish(rec) if on_finish is not None else ():
                    if follow.time_s < now:
                        raise ValueError(
                            f"{follow.request.request_id} at {follow.time_s} would arrive "
                            f"before {rec.request_id} finished at {now}"
                        )
                    seq += 1
                    heapq.heappush(heap, (follow.time_s, _ARRIVAL, seq, _FOLLOW, follow))
        if on_step is not None:
            on_step(i, now, payload)
        if engines[i].has_unfinished_requests():
            start_step(i, now)
    return ReplayResult(
        records=order,
        engine_stats=[e.stats for e in engines],
        end_s=max(now, last_arrival) if order else 0.0,
        num_steps=steps,
    )


def _views(engines: Sequence[SimEngine]) -> list[EngineView]:
    views = []
    for i, e in enumerate(engines):
        s = e.stats
        views.append(EngineView(i, s.num_running, s.num_waiting, s.kv_cache_usage, e))
    return views
