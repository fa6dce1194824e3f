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
index, load and cache (`engine_views.py`: `EngineView`, `round_robin()`, `session_hash()`).

Closed loops: `on_finish(record)` sees each request as it finishes and may return more
arrivals (an agent's next turn after its tool wait), at that time or later; they join the
heap like any other arrival, so a workload whose turns wait on each other's completions
runs in the same virtual time. It may also return `Timer`s: a callback at a time (a
client's announcement, a scheduled look at a waiting session), run before arrivals of the
same time, which may answer with more timers; after it every engine with work that is not
stepping steps (one waiting for a host load goes on waiting).

Plain decode steps (`fast_decode`, the default): a step in which an engine has nothing to
do but decode its batch and nobody finishes (`sim/core/decode_run.py` says exactly when) runs
through `SimEngine.decode_step`: the same step at the same time, doing the same to the
engine, its completion on the heap as any step's, so every event keeps its time and order
(one whose completion would be the next event anyway ends at once, off the heap). Only its
outputs (tokens, KV events) are held back, and handed over together (`take_decoded`) as one
`StepResult` at the last such step's end, before the engine's next other step, an arrival,
a timer or a finish anywhere, whichever comes first. Records and engines end exactly as
when each step is handed over alone (`fast_decode=False`); `on_step` sees such a run as
one step (durations summed, tokens and events together). A run of such steps that touch
no block goes on the heap as one event and runs when someone may look (`decode_stretch.py`).
"""

from __future__ import annotations

import gc
import heapq
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from appliance.sim.core.engine import SimEngine
from appliance.sim.core.engine_stats import EngineStats
from appliance.sim.engine_io import SimRequest, StepResult
from appliance.sim.runtime.decode_stretch import DecodeStretch
from appliance.sim.runtime.engine_views import Route, engine_views, round_robin


@dataclass(frozen=True, slots=True)
class Arrival:
    """A request that arrives at `time_s`, for engine `worker` (None: ask the router)."""

    time_s: float
    request: SimRequest
    worker: int | None = None


@dataclass(frozen=True, slots=True)
class Timer:
    """A callback at `time_s` in virtual time, given that time; it may return more."""

    time_s: float
    fire: Callable[[float], Iterable[Timer] | None]


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


_TIMER, _ARRIVAL, _STEP_DONE = 0, 1, 2
_DECODED = StepResult(0.0, [], [], 0)  # a plain decode step's, its outputs held (module)
_STRETCH = StepResult(0.0, [], [], 0)  # a stretch of them ended (`decode_stretch.py`)
_FOLLOW = -2  # the engine slot of an arrival `on_finish` returned (-1: from `arrivals`)


def replay(
    engines: Sequence[SimEngine],
    arrivals: Iterable[Arrival],
    route: Route | None = None,
    *,
    on_step: Callable[[int, float, StepResult], None] | None = None,
    on_finish: Callable[[RequestRecord], Iterable[Arrival | Timer]] | None = None,
    fast_decode: bool = True,
) -> ReplayResult:
    """Run every arrival to completion; `on_step(engine, time, result)` sees each step as
    its outputs become visible (KV events included), plain decode steps in runs (see the
    module; `fast_decode=False`: each alone); `on_finish(record)` may answer a finished
    request with new arrivals (not before its finish)."""
    if not engines:
        raise ValueError("replay needs at least one engine")
    router = route or round_robin()
    with _young_collections_rarer():
        return _Replay(engines, arrivals, router, on_step, on_finish, fast_decode).run()


@contextmanager
def _young_collections_rarer(threshold: int = 100_000) -> Iterator[None]:
    """Run the cyclic collector's young generation after `threshold` allocations, not 700.

    A replay allocates millions of objects that live for many steps (requests with their
    token lists, blocks, events); at the default the collector walked them again every few
    hundred allocations, a sixth of a long replay's time. Nothing here depends on when
    cycles are collected; the older generations keep their thresholds."""
    old = gc.get_threshold()
    gc.set_threshold(max(threshold, old[0]), *old[1:])
    try:
        yield
    finally:
        gc.set_threshold(*old)


class _Replay:
    """One replay's state: the event heap, each engine's step in flight, the records."""

    def __init__(
        self,
        engines: Sequence[SimEngine],
        arrivals: Iterable[Arrival],
        router: Route,
        on_step: Callable[[int, float, StepResult], None] | None,
        on_finish: Callable[[RequestRecord], Iterable[Arrival | Timer]] | None,
        fast_decode: bool = True,
    ) -> None:
        self.engines = engines
        self.router = router
        self.on_step = on_step
        self.on_finish = on_finish
        self.records: dict[str, RequestRecord] = {}  # the unfinished ones
        self.order: list[RequestRecord] = []
        self.heap: list[tuple[float, int, int, int, StepResult | Arrival | Timer]] = []
        self.seq = 0
        self.busy = [False] * len(engines)
        self.idle_step: list[int | None] = [None] * len(engines)  # seq of a step that waits
        self.cut_short: set[int] = set()
        self.steps = 0
        self.now = 0.0
        self.empty_steps = [0] * len(engines)
        self.source: Iterator[Arrival] = iter(arrivals)
        self.last_arrival = float("-inf")
        self.fast = fast_decode
        self.held = [0] * len(engines)  # plain decode steps done, their outputs held
        self.held_at = [0.0] * len(engines)  # when the last of them ended
        self.stretches: list[DecodeStretch | None] = [None] * len(engines)  # not yet run

    def run(self) -> ReplayResult:
        self.push_next_arrival()
        heap = self.heap
        while heap:
            t, _, step_seq, i, payload = heapq.heappop(heap)
            if step_seq in self.cut_short:
                self.cut_short.discard(step_seq)
                continue
            self.now = t
            if payload is _DECODED:
                self.decoded(i)
            elif payload is _STRETCH:
                self.stretch_ended(i)
            elif isinstance(payload, Arrival):
                if i != _FOLLOW:
                    self.push_next_arrival()
                self.deliver_held()
                self.arrive(payload)
            elif isinstance(payload, Timer):
                self.deliver_held()
                for timer in payload.fire(t) or ():
                    self.push(max(timer.time_s, t), _TIMER, timer)
                for w, engine in enumerate(self.engines):
                    if not self.busy[w] and engine.has_unfinished_requests():
                        self.start_step(w, t)
            else:
                self.step_done(i, payload)
        self.deliver_held()
        return ReplayResult(
            records=self.order,
            engine_stats=[e.stats for e in self.engines],
            end_s=max(self.now, self.last_arrival) if self.order else 0.0,
            num_steps=self.steps,
        )

    def push_next_arrival(self) -> None:
        arrival = next(self.source, None)
        if arrival is None:
            return
        if arrival.time_s < self.last_arrival:
            raise ValueError(
                f"arrivals must come in time order: {arrival.request.request_id} at "
                f"{arrival.time_s} after {self.last_arrival}"
            )
        self.last_arrival = arrival.time_s
        self.seq += 1
        heapq.heappush(self.heap, (arrival.time_s, _ARRIVAL, self.seq, -1, arrival))

    def start_step(self, i: int, t: float) -> None:
        engine, heap = self.engines[i], self.heap
        while self.fast:  # plain decode steps, outputs held (see the module)
            durations = engine.decode_stretch(t)
            if len(durations) > 1:
                stretch = DecodeStretch.plan(t, durations, self.seq + 1)
                if heap and heap[0][0] <= stretch.end_s:  # run when someone may look
                    self.seq += 1
                    self.stretches[i] = stretch
                    self.busy[i] = True
                    self.idle_step[i] = None
                    heapq.heappush(heap, (stretch.end_s, _STEP_DONE, self.seq, i, _STRETCH))
                    return
                self.run_stretch(i, stretch, len(durations))  # nothing comes before its end
                self.now = t = stretch.end_s
                self.held[i] += 1
                self.held_at[i] = t
                continue
            duration = engine.decode_step(t)
            if duration is None:
                if self.held[i]:
                    self.deliver(i)
                break
            self.steps += 1
            self.empty_steps[i] = 0
            self.seq += 1
            end = t + duration
            if heap and heap[0][0] <= end:
                self.busy[i] = True
                self.idle_step[i] = None
                heapq.heappush(heap, (end, _STEP_DONE, self.seq, i, _DECODED))
                return
            # Its end would be the next event: it ends now, and the engine steps again.
            self.now = t = end
            self.held[i] += 1
            self.held_at[i] = end
        result = engine.step(t)
        self.steps += 1
        if result.num_scheduled_tokens == 0 and not result.outputs and result.idle_until_s is None:
            self.empty_steps[i] += 1
            if self.empty_steps[i] > 2:
                raise RuntimeError(f"engine {i} has work but schedules nothing at {t}")
        else:
            self.empty_steps[i] = 0
        self.busy[i] = True
        self.seq += 1
        self.idle_step[i] = self.seq if result.idle_until_s is not None else None
        heapq.heappush(self.heap, (t + result.duration_s, _STEP_DONE, self.seq, i, result))

    def arrive(self, arrival: Arrival) -> None:
        """Route the request, queue it on its engine and step that engine if it is idle."""
        engines, now = self.engines, self.now
        req = arrival.request
        w = arrival.worker
        if w is None:
            w = self.router(req, engine_views(engines))
        if not 0 <= w < len(engines):
            raise ValueError(f"route sent {req.request_id} to engine {w} of {len(engines)}")
        engines[w].add_request(req, now)
        rec = RequestRecord(req.request_id, w, now, len(req.prompt_token_ids))
        self.records[req.request_id] = rec
        self.order.append(rec)
        waited = self.idle_step[w]
        if waited is not None:  # the engine only waits for loads: it steps now
            self.cut_short.add(waited)
            self.start_step(w, now)
        elif not self.busy[w]:
            self.start_step(w, now)

    def decoded(self, i: int) -> None:
        """A plain decode step ended: its outputs wait with the engine's others."""
        self.busy[i] = False
        self.held[i] += 1
        self.held_at[i] = self.now
        self.start_step(i, self.now)  # it finished nobody: the engine has work

    def stretch_ended(self, i: int) -> None:
        """Every step of engine `i`'s stretch ended: they run, their outputs held."""
        stretch = self.stretches[i]
        assert stretch is not None
        self.stretches[i] = None
        self.run_stretch(i, stretch, len(stretch.durations))
        self.decoded(i)  # its last step

    def run_stretch(self, i: int, stretch: DecodeStretch, steps: int) -> None:
        """The first `steps` steps of the stretch run; all but the last held."""
        self.engines[i].run_stretch(stretch.durations[:steps], stretch.starts[steps - 1])
        self.steps += steps
        self.empty_steps[i] = 0
        if steps > 1:
            self.held[i] += steps - 1
            self.held_at[i] = stretch.starts[steps - 1]

    def cut_stretches(self) -> None:
        """Someone may look now: each stretch's steps begun so far run, the one under way
        ending at its own end (`decode_stretch.py`)."""
        for i, stretch in enumerate(self.stretches):
            if stretch is None:
                continue
            self.stretches[i] = None
            steps = stretch.started_by(self.now)
            self.run_stretch(i, stretch, steps)
            self.cut_short.add(stretch.seq)
            self.seq += 1
            heapq.heappush(self.heap, (stretch.starts[steps], _STEP_DONE, self.seq, i, _DECODED))

    def deliver(self, i: int) -> None:
        """The held outputs of engine `i`'s ended decode steps, as one step's."""
        result = self.engines[i].take_decoded(self.held[i])
        self.held[i] = 0
        records = self.records
        for out in result.outputs:
            records[out.request_id].output_tokens += len(out.new_token_ids)
        if self.on_step is not None:
            self.on_step(i, self.held_at[i], result)

    def deliver_held(self) -> None:
        """Every engine's held outputs, before anything that may look at them."""
        self.cut_stretches()
        for i, n in enumerate(self.held):
            if n:
                self.deliver(i)

    def step_done(self, i: int, result: StepResult) -> None:
        """The step's outputs become visible; the engine steps again if it has work."""
        now = self.now
        self.busy[i] = False
        self.idle_step[i] = None
        if any(out.finished for out in result.outputs):
            self.deliver_held()  # `on_finish` may look at anything
        for out in result.outputs:
            rec = self.records[out.request_id]
            if out.first_token:
                rec.first_token_s = now
                rec.cached_tokens = out.num_cached_tokens
                rec.host_cached_tokens = out.num_host_cached_tokens
            rec.output_tokens += len(out.new_token_ids)
            if out.finished:
                rec.finish_s = now
                rec.finish_reason = out.finish_reason
                del self.records[out.request_id]
                self.follow(rec)
        if self.on_step is not None:
            self.on_step(i, now, result)
        if self.engines[i].has_unfinished_requests():
            self.start_step(i, now)

    def follow(self, rec: RequestRecord) -> None:
        """Queue the arrivals `on_finish` answers a finished request with."""
        now = self.now
        for event in self.on_finish(rec) if self.on_finish is not None else ():
            if isinstance(event, Timer):  # a callback due now or earlier runs now
                self.push(max(event.time_s, now), _TIMER, event)
                continue
            if event.time_s < now:
                raise ValueError(
                    f"{event.request.request_id} at {event.time_s} would arrive before "
                    f"{rec.request_id} finished at {now}"
                )
            self.push(event.time_s, _ARRIVAL, event)

    def push(self, t: float, kind: int, event: Arrival | Timer) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, kind, self.seq, _FOLLOW, event))
