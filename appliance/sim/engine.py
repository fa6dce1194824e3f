"""The simulated engine core: vLLM 0.32's scheduler over the sim's prefix cache, timed by a
latency model instead of a GPU.

Model of the world (vLLM `v1/core/sched/scheduler.py`, synchronous scheduling, one
full-attention group, chunked prefill on, no speculative decoding, connectors or LoRA):
every `step(now)` schedules a batch under a token budget (`max_num_batched_tokens`) and a
cap on running requests (`max_num_seqs`). RUNNING requests go first, in order: each gets
what it still needs (the rest of its prompt, else the one token it sampled last), cut to the
budget; when the cache cannot hold it, the last running request (FCFS), or the one with the
largest (priority, arrival) (policy "priority"), is preempted (blocks freed, computed
tokens reset, put back at the head of the waiting queue) and the allocation retried, until
it fits or the request preempted itself. Only if nobody was preempted, WAITING requests are
admitted in queue order: look up the cached prefix, schedule the rest (a chunk if the budget
is short) provided the whole sequence fits in the cache (`scheduler_reserve_full_isl`); the
first that does not fit stops admission. A request whose computed tokens reach its length
samples one token (a partial prefill chunk samples nothing); it stops on `eos_after` tokens
("stop", when not `ignore_eos`), then on `max_tokens` or `max_model_len` ("length"), and
its blocks are freed. A preempted request recomputes its prompt and output later, from
whatever of it is still cached.

Time: the engine never reads a clock. `step(now)` does the work at once and returns
`duration_s`, the time the modelled GPU needs for it; the caller makes the outputs visible
at `now + duration_s` (`clock.run_engine_loop` live, `virtual.replay` in virtual time).
`duration_s` = sum over prefill chunks of `latency.prefill_s(chunk, tokens already computed
or hit)`, less the fixed prefill overhead for every chunk after the first (the chunks share
one forward pass), plus `latency.decode_step_s(decoding requests, their KV tokens)`. A cache
hit thus shortens TTFT exactly as an earlier chunk of the same prompt would. Requests added
or aborted while a step is in flight take effect at the next step; an abort's output
(finish_reason "abort") comes with the next step's outputs, and the in-flight step's
outputs may still name the aborted request (ignore them). `tests/unit/test_sim_engine.py`
(marker `vllm`) runs scripted workloads through vLLM's own Scheduler and this engine and
compares every step: scheduled tokens, outputs, finish reasons, cached tokens, block ids,
preemptions and prefix-cache counters.

Public API (the server builds on these names; everything else is private):
- `SimRequest`: what to run (`eos_after` stands in for an EOS when not `ignore_eos`;
  `arrival_s` is informational, the engine orders by the `now` given to `add_request`).
- `SimEngine(num_blocks=, block_size=, hasher=, latency=, max_model_len=, max_num_seqs=256,
  max_num_batched_tokens=8192, enable_prefix_caching=True, output_token_ids=None,
  policy="fcfs", enable_kv_events=True, residency=None, host_bytes=0, host_tier=None,
  host_priority=None)` (ValueError unless
  max_model_len fits in the cache and 1 <= max_num_seqs <= max_num_batched_tokens):
  `add_request(req, now)` (ValueError for a duplicate id, an empty prompt, one of
  max_model_len tokens or more, max_tokens < 1), `abort_request(request_id, now)`,
  `has_unfinished_requests()`, `step(now) -> StepResult`, `stats -> EngineStats`,
  `reset_prefix_cache() -> bool`, `block_ids(request_id)`, `cache` (the `PrefixCache`, to
  peek at; never change it), `host` (the `HostTier` or None), `demote(session_id)` and
  `evict(session_id)` (below).
  `output_token_ids(req, index)` chooses the `index`-th generated token (default:
  `default_output_token`).
- `StepResult(duration_s, outputs, events, num_scheduled_tokens, scheduled, preempted,
  idle_until_s)`: `events` are this step's KV events, to publish as one batch; `scheduled`
  maps request id to tokens scheduled (vLLM's `num_scheduled_tokens`); `preempted` lists
  preempted ids; `idle_until_s` is set when the step did nothing but wait for host loads
  (it lasts until the first completes; a caller may step again sooner, e.g. on an arrival).
- `RequestOutput`: request_id, new_token_ids, finished, finish_reason ("length" | "stop" |
  "abort" | None), num_prompt_tokens, num_cached_tokens (prefix-cache hit at the first
  scheduling, the host tier's included, as vLLM counts a connector's), num_host_cached_tokens
  (of those, the host tier's), first_token, num_preemptions, first_scheduled_s. Emitted only
  for requests with new tokens or that finished.
- `EngineStats`: vLLM's counters (prefix-cache queries/hits count prompt tokens of admitted
  never-preempted requests; prompt tokens by source are counted at the first token;
  request_success_total by finish reason, aborts included; pin counters with a residency).

Host tier (`host_bytes=`, default 0: none; vLLM's `--kv-offloading-size`, native
OffloadingConnector, LRU): `host_bytes // (block_size * KV bytes per token)` blocks of
pinned host memory (`host_tier=` passes a `HostTier` instead, e.g. one shared by several
engines; `host_priority=` orders its evictions). Prompt blocks are copied there as they
are cached, and a waiting request's lookup continues past its GPU hit into the host tier
(`PrefixCache`). A request with a host hit is admitted like vLLM's request that waits for
remote KV: GPU blocks are allocated for the hit (it must fit whole, as any admission),
nothing is scheduled for it, and the copy host -> GPU (`latency.kv_copy_s` of the hit's
bytes, one batched copy) runs on the engine's one host-to-device channel, after any copy
queued before it; from the first step at or after the copy's end the blocks are cached and
the request waits again, at the head of the queue, to compute the rest. So the promotion
time lands in that request's TTFT, not in other requests' steps. Its host tokens count as
cached (`num_cached_tokens`) and, apart, as `host_hit_tokens_total`
(`vllm:prompt_tokens_cached_by_source{source="host"}`). A step with nothing to schedule
but loads in flight lasts until the first load completes (`idle_until_s`).

Residency (`residency=`, default none: vLLM as above): when a request finishes (not
aborted), `residency.after_turn(TurnEnd(...))` says what becomes of its cached blocks
(`AfterTurn`): "release" (vLLM's free), "hold" until a time (pinned, `PrefixCache.pin`,
owner: its session, else its id), "evict" (freed to the head of the eviction order) or
"demote" (copied to the host tier, then freed and forgotten on the GPU; ValueError without
a host tier). Pins due by a step's `now` are released at the start of that step, except
those of sessions whose next request is already waiting; a session's pin is released when
its next request is admitted (that request then holds what it reuses); and under pressure
the cache gives pins back in `residency.pin_priority` order before the scheduler would
preempt or stop admitting. `demote(session_id)` and `evict(session_id)` do the same to a
held session's pin at any time between steps. A hook with `revisit(PinDue)` is asked again
about each pin as it comes due (before it would lapse) and the engine extends it, demotes
or evicts it, or lets it lapse, as the answer says; a hook with `turn_arrived(req, now)` is
told of each request as it is added. A running request is never preempted for its own
session's pin (only a request adopting a hit spares it: it may hold those very blocks).

Cost: a prompt is hashed once, at `add_request`; a decode token that neither needs a new
block nor fills one skips the cache call (it would only bump a counter), so a step costs
a few microseconds per running request.
"""

from __future__ import annotations

import heapq
import zlib
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Literal, Protocol

from appliance.domain.block_hash import NO_KEYS, BlockHasher, RequestKeys
from appliance.domain.kv_events import KvEvent
from appliance.sim.cache_request import NO_HIT, CacheHit, CacheRequest
from appliance.sim.host_tier import HostPriority, HostTier
from appliance.sim.latency import CopyDirection, LatencyModel
from appliance.sim.pins import Pin
from appliance.sim.prefix_cache import PrefixCache

FinishReason = Literal["length", "stop", "abort"]
SchedulingPolicy = Literal["fcfs", "priority"]
KvAction = Literal["release", "hold", "evict", "demote"]
DEFAULT_VOCAB_SIZE = 32000
"""Default generated token ids fall below this (a size every supported tokenizer exceeds)."""


@dataclass(slots=True)
class SimRequest:
    """One generation request. Lower `priority` runs first under the priority policy."""

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    ignore_eos: bool = True
    cache_salt: str | None = None
    session_id: str | None = None
    priority: int = 0
    arrival_s: float = 0.0
    eos_after: int | None = None
    """When not `ignore_eos`: stop ("stop") after this many generated tokens."""


@dataclass(slots=True)
class RequestOutput:
    """What one step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_cached_tokens: int
    first_token: bool
    num_preemptions: int = 0
    """Times the request was preempted so far."""
    first_scheduled_s: float | None = None
    """The `now` of the step that first scheduled it (queue time = this - arrival)."""
    num_host_cached_tokens: int = 0
    """Of `num_cached_tokens`, those loaded from the host tier."""


@dataclass(slots=True)
class StepResult:
    duration_s: float
    """Modelled GPU time of the step; its outputs are visible at `now + duration_s`."""
    outputs: list[RequestOutput]
    events: list[KvEvent]
    """The step's KV events, oldest first: publish them as one batch."""
    num_scheduled_tokens: int
    scheduled: dict[str, int] = field(default_factory=dict)
    """Request id -> tokens scheduled in this step, in schedule order (running first)."""
    preempted: list[str] = field(default_factory=list)
    """Requests preempted (sent back to waiting) in this step."""
    idle_until_s: float | None = None
    """Set when the step only waited for host loads: when the first completes."""


@dataclass(frozen=True, slots=True)
class EngineStats:
    """A snapshot of the engine's gauges and cumulative counters (vLLM semantics)."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    prompt_tokens_total: int
    prompt_tokens_by_source: dict[str, int]
    generation_tokens_total: int
    num_preemptions_total: int
    request_success_total: dict[str, int]
    num_steps_total: int = 0
    busy_s_total: float = 0.0
    pinned_blocks: int = 0
    """Blocks held by residency pins now (they count as used in `kv_cache_usage`)."""
    pins_total: int = 0
    pins_expired_total: int = 0
    pins_resumed_total: int = 0
    pins_reclaimed_total: int = 0
    """Pins given back early because an allocation was short."""
    host_blocks: int = 0
    """The host tier's capacity in blocks (0: none)."""
    host_hit_tokens_total: int = 0
    """Prompt tokens loaded from the host tier (counted at the first token)."""
    host_load_s_total: float = 0.0
    """Seconds of host -> GPU copies for those loads."""
    host_stored_blocks_total: int = 0
    host_evicted_blocks_total: int = 0
    demotions_total: int = 0
    """Finished turns and held sessions whose blocks were demoted to the host tier."""
    evictions_total: int = 0
    """Finished turns and held sessions whose blocks were put first in the eviction order."""


@dataclass(frozen=True, slots=True)
class TurnEnd:
    """A request that has just finished, as a residency hook sees it."""

    request: SimRequest
    resident_tokens: int
    """Tokens in the request's cached (pinnable) blocks."""
    kv_usage: float
    now_s: float
    host_blocks: int = 0
    """The worker's host tier's capacity in blocks (0: none)."""
    host_used_blocks: int = 0
    """Of those, blocks in use."""
    pins: tuple[Pin, ...] = ()
    """The worker's standing pins."""


@dataclass(frozen=True, slots=True)
class PinDue:
    """A held session whose pin has come due, as a residency hook that revisits sees it."""

    pin: Pin
    kv_usage: float
    now_s: float
    host_blocks: int = 0
    host_used_blocks: int = 0
    pins: tuple[Pin, ...] = ()


@dataclass(frozen=True, slots=True)
class AfterTurn:
    """What becomes of a finished request's cached blocks."""

    action: KvAction = "release"
    until_s: float | None = None
    """"hold" only: when the pin lapses."""


class Residency(Protocol):
    """What the engine asks about a finished request's blocks, and the order in which pins
    are given back under pressure (lowest first). A hook may also have
    `revisit(due: PinDue) -> AfterTurn` (asked for each pin as it comes due: "hold"
    extends it, "demote" or "evict" end it so, "release" lets it lapse) and
    `turn_arrived(req: SimRequest, now: float) -> None` (told of every request as it
    arrives: a session's next turn)."""

    def after_turn(self, end: TurnEnd) -> AfterTurn: ...

    def pin_priority(self, pin: Pin, now: float) -> float: ...


def default_output_token(req: SimRequest, index: int) -> int:
    """A deterministic token id for the `index`-th generated token of `req`."""
    base = zlib.crc32(req.request_id.encode())
    return (base + 7919 * index) % DEFAULT_VOCAB_SIZE


class _Entry:
    """The engine's state of one unfinished request."""

    __slots__ = (
        "arrival_s",
        "cache",
        "first_scheduled_s",
        "first_token_sent",
        "num_cached_tokens",
        "num_host_cached_tokens",
        "ready_s",
        "req",
        "seq",
    )

    def __init__(self, req: SimRequest, cache: CacheRequest, arrival_s: float, seq: int):
        self.req = req
        self.cache = cache
        self.arrival_s = arrival_s
        self.seq = seq
        self.num_cached_tokens = 0
        self.num_host_cached_tokens = 0
        self.ready_s = 0.0  # while loading from the host tier: when the copy ends
        self.first_token_sent = False
        self.first_scheduled_s: float | None = None

    def priority_key(self) -> tuple[int, float, str, int]:
        """vLLM's `Request.__lt__`: priority, then arrival, then request id."""
        return (self.req.priority, self.arrival_s, self.req.request_id, self.seq)


class _WaitingQueue:
    """FCFS: a deque (preempted requests go back to the front). Priority: a heap on
    (priority, arrival, request id), where a preempted request simply goes back in."""

    def __init__(self, policy: SchedulingPolicy) -> None:
        self.priority = policy == "priority"
        self._fifo: deque[_Entry] = deque()
        self._heap: list[tuple[tuple[int, float, str, int], _Entry]] = []

    def __len__(self) -> int:
        return len(self._heap) if self.priority else len(self._fifo)

    def __iter__(self) -> Iterator[_Entry]:
        return (e for _, e in self._heap) if self.priority else iter(self._fifo)

    def add(self, e: _Entry) -> None:
        if self.priority:
            heapq.heappush(self._heap, (e.priority_key(), e))
        else:
            self._fifo.append(e)

    def prepend(self, e: _Entry) -> None:
        if self.priority:
            self.add(e)
        else:
            self._fifo.appendleft(e)

    def peek(self) -> _Entry:
        return self._heap[0][1] if self.priority else self._fifo[0]

    def pop(self) -> _Entry:
        return heapq.heappop(self._heap)[1] if self.priority else self._fifo.popleft()

    def remove(self, e: _Entry) -> None:
        if self.priority:
            self._heap = [x for x in self._heap if x[1] is not e]
            heapq.heapify(self._heap)
        else:
            self._fifo.remove(e)


@dataclass(slots=True)
class _Counters:
    prompt_tokens: int = 0
    prompt_cached: int = 0
    prompt_host: int = 0
    host_load_s: float = 0.0
    demotions: int = 0
    evictions: int = 0
    generation_tokens: int = 0
    preemptions: int = 0
    steps: int = 0
    busy_s: float = 0.0
    success: dict[str, int] = field(default_factory=lambda: {"stop": 0, "length": 0, "abort": 0})


class SimEngine:
    """One simulated vLLM engine: a scheduler, a prefix cache and a latency model."""

    def __init__(
        self,
        *,
        num_blocks: int,
        block_size: int,
        hasher: BlockHasher,
        latency: LatencyModel,
        max_model_len: int,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 8192,
        enable_prefix_caching: bool = True,
        output_token_ids: Callable[[SimRequest, int], int] | None = None,
        policy: SchedulingPolicy = "fcfs",
        enable_kv_events: bool = True,
        residency: Residency | None = None,
        host_bytes: int = 0,
        host_tier: HostTier | None = None,
        host_priority: HostPriority | None = None,
    ) -> None:
        if hasher.block_size != block_size:
            raise ValueError(f"hasher block size {hasher.block_size} != block_size {block_size}")
        if -(-max_model_len // block_size) > num_blocks - 1:
            raise ValueError(
                f"max_model_len {max_model_len} needs {-(-max_model_len // block_size)} blocks "
                f"of {block_size}; the cache has {num_blocks - 1}: lower max_model_len or "
                "give the cache more blocks"
            )
        if not 1 <= max_num_seqs <= max_num_batched_tokens:
            raise ValueError(
                f"need 1 <= max_num_seqs ({max_num_seqs}) <= max_num_batched_tokens "
                f"({max_num_batched_tokens}), as vLLM does"
            )
        self.block_size = block_size
        self.hasher = hasher
        self.latency = latency
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.policy: SchedulingPolicy = policy
        if host_bytes < 0 or (host_bytes and host_tier is not None):
            raise ValueError("give host_bytes >= 0 or a host_tier, not both")
        host_blocks = host_bytes // (block_size * latency.kv_bytes_per_token)
        if host_bytes and host_blocks < 1:
            raise ValueError(f"host_bytes {host_bytes} hold no block of {block_size} tokens")
        self.host = (
            host_tier
            if host_tier is not None
            else (HostTier(host_blocks, priority=host_priority) if host_blocks else None)
        )
        self.cache = PrefixCache(
            num_blocks,
            block_size,
            max_model_len=max_model_len,
            enable_caching=enable_prefix_caching,
            enable_events=enable_kv_events,
            host=self.host if enable_prefix_caching else None,
        )
        self._residency = residency
        self._revisit: Callable[[PinDue], AfterTurn] | None = getattr(residency, "revisit", None)
        self._turn_arrived: Callable[[SimRequest, float], None] | None = getattr(
            residency, "turn_arrived", None
        )
        if residency is not None:
            self.cache.pin_priority = residency.pin_priority
        self._token = output_token_ids or default_output_token
        self._entries: dict[str, _Entry] = {}
        self._running: list[_Entry] = []
        self._waiting = _WaitingQueue(policy)
        self._loading: list[_Entry] = []  # admitted, their host hit on its way to the GPU
        self._h2d_free_s = 0.0  # when the host -> GPU channel has finished its last copy
        self._pending: list[RequestOutput] = []  # abort outputs for the next step
        self._seq = 0
        self._n = _Counters()
        self._fast_decode = True  # tests turn it off to check it changes nothing

    # --- requests ---

    def add_request(self, req: SimRequest, now: float) -> None:
        """Queue a request; it is considered from the next step on."""
        n = len(req.prompt_token_ids)
        if req.request_id in self._entries:
            raise ValueError(f"request {req.request_id!r} is already in the engine")
        if n == 0 or n >= self.max_model_len:
            raise ValueError(
                f"prompt of {n} tokens: it must be non-empty and shorter than "
                f"max_model_len {self.max_model_len}"
            )
        if req.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {req.max_tokens}")
        keys = RequestKeys(cache_salt=req.cache_salt) if req.cache_salt else NO_KEYS
        creq = CacheRequest(
            req.request_id, req.prompt_token_ids, self.hasher, keys=keys, session_id=req.session_id
        )
        self._seq += 1
        entry = _Entry(req, creq, now, self._seq)
        self._entries[req.request_id] = entry
        self._waiting.add(entry)
        if self._turn_arrived is not None:
            self._turn_arrived(req, now)

    def abort_request(self, request_id: str, now: float) -> None:
        """Drop a request wherever it is and free its blocks; unknown ids are ignored."""
        entry = self._entries.pop(request_id, None)
        if entry is None:
            return
        if entry in self._running:
            self._running.remove(entry)
            self.cache.free(entry.cache)
        elif entry in self._loading:
            self._loading.remove(entry)
            self.cache.free(entry.cache)
        else:
            self._waiting.remove(entry)
        self._n.success["abort"] += 1
        self._pending.append(self._output(entry, [], "abort"))

    def has_unfinished_requests(self) -> bool:
        return bool(self._entries) or bool(self._pending)

    def block_ids(self, request_id: str) -> tuple[int, ...]:
        """The KV blocks an unfinished request holds, in token order (empty if none)."""
        entry = self._entries.get(request_id)
        return self.cache.block_ids(entry.cache) if entry is not None else ()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (refused while any request holds blocks)."""
        return self.cache.reset()

    @property
    def stats(self) -> EngineStats:
        n, cs = self._n, self.cache.stats
        return EngineStats(
            num_running=len(self._running),
            num_waiting=len(self._waiting) + len(self._loading),
            kv_cache_usage=self.cache.usage,
            prefix_cache_queries=cs.queries,
            prefix_cache_hits=cs.hits,
            prompt_tokens_total=n.prompt_tokens,
            prompt_tokens_by_source=self._by_source(),
            generation_tokens_total=n.generation_tokens,
            num_preemptions_total=n.preemptions,
            request_success_total=dict(n.success),
            num_steps_total=n.steps,
            busy_s_total=n.busy_s,
            demotions_total=n.demotions,
            evictions_total=n.evictions,
            **self._pin_fields(),
            **self._host_fields(),
        )

    def _by_source(self) -> dict[str, int]:
        n = self._n
        local = n.prompt_cached - n.prompt_host
        out = {"local_cache_hit": local, "local_compute": n.prompt_tokens - n.prompt_cached}
        if self.host is not None:
            out["external_kv_transfer"] = n.prompt_host
        return out

    def _host_fields(self) -> dict[str, int | float]:
        if self.host is None:
            return {}
        h = self.host.stats
        return {
            "host_blocks": self.host.num_blocks,
            "host_hit_tokens_total": self._n.prompt_host,
            "host_load_s_total": self._n.host_load_s,
            "host_stored_blocks_total": h.stored,
            "host_evicted_blocks_total": h.evicted,
        }

    def _pin_fields(self) -> dict[str, int]:
        if self._residency is None:
            return {}
        p = self.cache.pin_stats
        return {
            "pinned_blocks": self.cache.num_pinned_blocks,
            "pins_total": p.pinned,
            "pins_expired_total": p.expired,
            "pins_resumed_total": p.resumed,
            "pins_reclaimed_total": p.reclaimed,
        }

    # --- the step ---

    def step(self, now: float) -> StepResult:
        """Schedule one batch, run it on the modelled GPU and return what it produced."""
        scheduled: list[tuple[_Entry, int, int]] = []  # entry, tokens, computed before
        preempted: list[str] = []
        if self._residency is not None:
            self._expire_pins(now)
        if self.host is not None:
            self.host.now_s = now
            if self._loading:
                self._finish_loads(now)
        budget = self._schedule_running(scheduled, preempted)
        if not preempted:
            self._schedule_waiting(scheduled, budget, now)
        outputs, self._pending = self._pending, []
        duration = self._duration(scheduled)
        by_request: dict[str, int] = {}
        total = 0
        finished = False
        for entry, n, _ in scheduled:
            total += n
            by_request[entry.req.request_id] = n
            creq = entry.cache
            if creq.num_computed_tokens == len(creq.all_token_ids):
                out = self._sample(entry, now)
                outputs.append(out)
                finished |= out.finished
        if finished:
            self._running = [e for e in self._running if e.req.request_id in self._entries]
        if total:
            self._n.steps += 1
            self._n.busy_s += duration
        events = self.cache.take_events()
        result = StepResult(duration, outputs, events, total, by_request, preempted)
        if not (total or outputs or events or preempted) and self._loading:
            result.idle_until_s = min(e.ready_s for e in self._loading)
            result.duration_s = result.idle_until_s - now
        return result

    def _finish_loads(self, now: float) -> None:
        """Requests whose host blocks have arrived cache them and wait again, in front."""
        done = [e for e in self._loading if e.ready_s <= now]
        if not done:
            return
        self._loading = [e for e in self._loading if e.ready_s > now]
        for entry in reversed(done):
            self.cache.complete_load(entry.cache)
            self._waiting.prepend(entry)

    def _start_load(self, entry: _Entry, hit: CacheHit, now: float) -> bool:
        """Admit the waiting request at the head with a hit that continues in the host
        tier: GPU blocks for the whole hit, and its host part's copy queued on the host ->
        GPU channel. False (nothing changed) when the sequence does not fit."""
        n = hit.num_host_tokens
        new_blocks = self.cache.allocate(
            entry.cache, n, hit, full_sequence_must_fit=True, delay_cache_blocks=True
        )
        if new_blocks is None:
            return False
        self._waiting.pop()
        start = max(now, self._h2d_free_s)
        copy_s = self.latency.kv_copy_s(n, CopyDirection.H2D)
        entry.ready_s = self._h2d_free_s = start + copy_s
        self._n.host_load_s += copy_s
        self._loading.append(entry)
        return True

    def _schedule_running(
        self, scheduled: list[tuple[_Entry, int, int]], preempted: list[str]
    ) -> int:
        """Schedule running requests (preempting as needed); returns the budget left."""
        budget = self.max_num_batched_tokens
        running = self._running
        bs = self.block_size
        fast = self._fast_decode
        i = 0
        while i < len(running) and budget > 0:
            entry = running[i]
            creq = entry.cache
            c = creq.num_computed_tokens
            n = min(len(creq.all_token_ids) - c, budget, self.max_model_len - c - 1)
            if n <= 0:
                i += 1
                continue
            if fast and n == 1 and c % bs and (c + 1) % bs:
                # The token lands in the request's last, partly filled block and does not
                # fill it: exactly what allocate() would do, without its bookkeeping.
                creq.num_computed_tokens = c + 1
                ok = True
            else:
                while not (ok := self.cache.allocate(creq, n) is not None):
                    victim = self._victim()
                    vi = running.index(victim)
                    del running[vi]
                    if vi < i:  # priority policy: it was scheduled earlier in this step
                        i -= 1
                        for k, (e, vn, _) in enumerate(scheduled):
                            if e is victim:
                                budget += vn
                                del scheduled[k]
                                break
                    self._preempt(victim)
                    preempted.append(victim.req.request_id)
                    if victim is entry:
                        break
            if not ok:
                break
            scheduled.append((entry, n, c))
            budget -= n
            i += 1
        return budget

    def _victim(self) -> _Entry:
        if self.policy == "priority":
            return max(self._running, key=lambda e: (e.req.priority, e.arrival_s))
        return self._running[-1]

    def _preempt(self, entry: _Entry) -> None:
        self.cache.preempt(entry.cache)
        self._n.preemptions += 1
        self._waiting.prepend(entry)

    def _schedule_waiting(
        self, scheduled: list[tuple[_Entry, int, int]], budget: int, now: float
    ) -> None:
        waiting, cache = self._waiting, self.cache
        while budget > 0 and waiting and len(self._running) < self.max_num_seqs:
            entry = waiting.peek()
            creq = entry.cache
            hit = cache.lookup(creq) if creq.num_computed_tokens == 0 else NO_HIT
            if hit.num_host_tokens:
                if not self._start_load(entry, hit, now):
                    break
            else:
                n = min(creq.num_tokens - creq.num_computed_tokens - hit.num_tokens, budget)
                if cache.allocate(creq, n, hit, full_sequence_must_fit=True) is None:
                    break
                waiting.pop()
                self._running.append(entry)
                scheduled.append((entry, n, creq.num_computed_tokens - n))
                budget -= n
            if self._residency is not None:
                cache.unpin(self._owner(entry.req))
            if entry.first_scheduled_s is None:
                entry.num_cached_tokens = hit.num_tokens + hit.num_host_tokens
                entry.num_host_cached_tokens = hit.num_host_tokens
                entry.first_scheduled_s = now

    def _duration(self, scheduled: list[tuple[_Entry, int, int]]) -> float:
        latency = self.latency
        prefill_s = 0.0
        chunks = batch = context = 0
        for entry, n, c in scheduled:
            if n == 1 and c >= entry.cache.num_prompt_tokens:
                batch += 1
                context += c + 1
            else:
                chunks += 1
                prefill_s += latency.prefill_s(n, c)
        if chunks > 1:
            prefill_s -= (chunks - 1) * latency.prefill.overhead_s
        return prefill_s + (latency.decode_step_s(batch, context) if batch else 0.0)

    @staticmethod
    def _owner(req: SimRequest) -> str:
        return req.session_id if req.session_id is not None else req.request_id

    def _expire_pins(self, now: float) -> None:
        due = self.cache.next_pin_expiry_s()
        if due is None or due > now:
            return
        keep = {self._owner(e.req) for e in self._waiting}
        if self._revisit is not None:
            for pin in self.cache.due_pins(now, keep=keep):
                self._carry_out_revisit(pin, now)
        self.cache.expire_pins(now, keep=keep)

    def _carry_out_revisit(self, pin: Pin, now: float) -> None:
        """Ask the hook again about a due pin and do what it says ("release": it lapses)."""
        assert self._revisit is not None
        used, capacity = self._host_blocks()
        after = self._revisit(PinDue(pin, self.cache.usage, now, capacity, used, self.cache.pins))
        if after.action == "hold" and after.until_s is not None and after.until_s > now:
            self.cache.extend_pin(pin.owner, after.until_s)
        elif after.action == "demote" and self.host is not None:
            self.demote(pin.owner)
        elif after.action == "evict":
            self.evict(pin.owner)

    def _host_blocks(self) -> tuple[int, int]:
        """(blocks in use, capacity) of the host tier; (0, 0) without one."""
        return (len(self.host), self.host.num_blocks) if self.host is not None else (0, 0)

    def demote(self, session_id: str) -> int:
        """Copy a held session's pinned blocks to the host tier and free them on the GPU
        (forgotten there unless someone else holds them); returns the blocks copied (0:
        the session holds none). ValueError without a host tier."""
        n = self.cache.demote_pin(session_id)
        self._n.demotions += int(n > 0)
        return n

    def evict(self, session_id: str) -> int:
        """Put a held session's pinned blocks first in the GPU eviction order (still
        findable until reused); returns how many went there."""
        n = self.cache.evict_pin(session_id)
        self._n.evictions += int(n > 0)
        return n

    def _release(self, entry: _Entry, now: float) -> None:
        """Free a finished request's blocks as the residency hook says (vLLM's free when
        there is none)."""
        creq = entry.cache
        if self._residency is None:
            self.cache.free(creq)
            return
        blocks = self.cache.pool.blocks
        cached = sum(1 for i in self.cache.block_ids(creq) if blocks[i].block_hash)
        used, capacity = self._host_blocks()
        end = TurnEnd(
            entry.req,
            cached * self.block_size,
            self.cache.usage,
            now,
            capacity,
            used,
            self.cache.pins,
        )
        after = self._residency.after_turn(end)
        if after.action == "hold" and after.until_s is not None and after.until_s > now:
            self.cache.pin(self._owner(entry.req), creq, now_s=now, until_s=after.until_s)
        elif after.action == "demote":
            if self.host is None:
                raise ValueError(
                    f"the residency hook demoted {entry.req.request_id}, but this engine has "
                    "no host tier (host_bytes=0)"
                )
            self.cache.free_to_host(creq)
            self._n.demotions += 1
            return
        elif after.action == "evict":
            self.cache.free_first(creq)
            self._n.evictions += 1
            return
        self.cache.free(creq)

    def _sample(self, entry: _Entry, now: float) -> RequestOutput:
        """Append one generated token to a request whose sequence is all computed."""
        req, creq = entry.req, entry.cache
        tokens = creq.all_token_ids
        num_tokens = len(tokens) + 1
        index = num_tokens - 1 - creq.num_prompt_tokens
        token = self._token(req, index)
        if self._fast_decode and num_tokens % self.block_size:
            tokens.append(token)  # completes no block: nothing to hash
        else:
            creq.append_output((token,))
        num_output = index + 1
        self._n.generation_tokens += 1
        first = not entry.first_token_sent
        if first:
            entry.first_token_sent = True
            self._n.prompt_tokens += creq.num_prompt_tokens
            self._n.prompt_cached += entry.num_cached_tokens
            self._n.prompt_host += entry.num_host_cached_tokens
        reason: FinishReason | None = None
        if not req.ignore_eos and req.eos_after is not None and num_output >= req.eos_after:
            reason = "stop"
        elif num_output >= req.max_tokens or num_tokens >= self.max_model_len:
            reason = "length"
        if reason is not None:
            del self._entries[req.request_id]
            self._release(entry, now)
            self._n.success[reason] += 1
        out = self._output(entry, [token], reason)
        out.first_token = first
        return out

    @staticmethod
    def _output(entry: _Entry, tokens: list[int], reason: FinishReason | None) -> RequestOutput:
        return RequestOutput(
            entry.req.request_id,
            tokens,
            reason is not None,
            reason,
            entry.cache.num_prompt_tokens,
            entry.num_cached_tokens,
            False,
            entry.cache.num_preemptions,
            entry.first_scheduled_s,
            entry.num_host_cached_tokens,
        )
