"""The simulated engine core: vLLM 0.32's scheduler over the sim's prefix cache, timed by a
latency model instead of a GPU.

Model of the world (vLLM `v1/core/sched/scheduler.py`, synchronous scheduling, one
full-attention group, chunked prefill on, no speculative decoding, connectors or LoRA):
every `step(now)` schedules a batch under a token budget (`max_num_batched_tokens`) and a
cap on running requests (`max_num_seqs`). RUNNING requests go first, in order: each gets
what it still needs (the rest of its prompt, else the one token it sampled last), cut to
`long_prefill_token_threshold` (when set and more than one request runs or waits at the
step's start; with `prompt_a_step`, the appliance's scheduler, never: there, while two or
more prompts are in flight, only the first in the queue's order computes prompt tokens, the
other running prompts pausing and no other request admitted, `engine_batch.py`) and to the
budget; when the cache cannot hold it, the last running request (FCFS), or the one with the
largest (priority, arrival) (policy "priority"), is preempted
(blocks freed, computed tokens reset, put back at the head of the waiting queue) and the
allocation retried, until it fits or the request preempted itself. Only if nobody was
preempted, WAITING requests are admitted in queue order: look up the cached prefix,
schedule the rest (a chunk if the budget or that threshold is short) provided the whole
sequence fits in the cache (`scheduler_reserve_full_isl`); the first that does not fit
stops admission. A request whose computed tokens reach its length samples one token (a
partial prefill chunk samples nothing); it stops on `eos_after` tokens ("stop", when not
`ignore_eos`), then on `max_tokens` or `max_model_len` ("length"), and its blocks are freed.
A preempted request recomputes its prompt and output later, from whatever of it is still
cached.

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

Where it lives: `SimEngine` here holds the requests and runs the step; mixed into it,
`engine_batch.py` chooses a step's batch, `engine_sessions.py` does a session's part between
turns (`demote`, `evict`, `restore`, `release_session`), `engine_fast_path.py` runs plain
decode steps without scheduling.

Public API (the server builds on these names; everything else is private):
- `SimRequest`: what to run (`eos_after` stands in for an EOS when not `ignore_eos`;
  `arrival_s` is informational, the engine orders by the `now` given to `add_request`).
  It, `RequestOutput` and `StepResult` live in `sim/engine_io.py`, `EngineStats` in
  `engine_stats.py`, the residency hook's types in `sim/kv/residency_hook.py`.
- `EngineConfig` (`engine_config.py`): vLLM's settings the engine honours.
- `SimEngine(config, hasher=, latency=, residency=None, host=None, output_token_ids=None,
  retention=None)`:
  `add_request(req, now)` (ValueError for a duplicate id, an empty prompt, one of
  max_model_len tokens or more, max_tokens < 1), `abort_request(request_id, now)`,
  `has_unfinished_requests()`, `step(now) -> StepResult`, `stats -> EngineStats`
  (`queue_lengths()`: its running and waiting counts alone), `decode_step(now)`,
  `decode_stretch(now)`, `run_stretch` and `take_decoded(steps)` (plain decode steps with
  their outputs held: `decode_run.py`),
  `reset_prefix_cache() -> bool`, `block_ids(request_id)`, `cache` (the `PrefixCache`, to
  peek at; never change it), `host` (the `HostTier` or None), `demote(session_id)` and
  `evict(session_id)` (`sim/kv/residency_hook.py`), `restore(session_id, now, hold_s)` (with a
  retention: the session's newest finished prompt promoted from the host tier, a prefetch
  below).
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

Host tier (`host=`, a `HostTier`, default none; vLLM's `--kv-offloading-size`, native
OffloadingConnector): how a waiting request's hit that continues there is loaded,
`engine_batch.py`.

Residency (`residency=`) and retention (`retention=`): when the engine calls each and what
it does with the answers, `sim/kv/residency_hook.py`.

Prefetches (`prefetches`, a `PrefetchLane`: `sim/kv/prefetch_lane.py` says what it does): a
session's KV restored before its next turn, a promotion on the host -> GPU channel the host
loads use, a prefill in what a step leaves when no request waits. A real allocation that
would be short cancels prefetches in flight first; `release_session(session, own)` ends a
session's pin when it ends and drops its own blocks on every tier.

Cost: a prompt is hashed once, at `add_request`; a decode token that neither needs a new
block nor fills one skips the cache call (it would only bump a counter), so a step costs
a few microseconds per running request; plain decode steps (`decode_step`, and runs of them
that touch no block: `decode_stretch`) cost only their counting until their outputs are
taken.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from appliance.domain.block_hash import NO_KEYS, BlockHasher, RequestKeys
from appliance.perf.latency import LatencyModel
from appliance.sim.core.decode_run import DecodeRun
from appliance.sim.core.engine_batch import EngineBatching
from appliance.sim.core.engine_config import EngineConfig
from appliance.sim.core.engine_fast_path import EngineFastPath
from appliance.sim.core.engine_sessions import EngineSessions
from appliance.sim.core.engine_stats import EngineCounters, EngineStats, engine_stats
from appliance.sim.core.waiting_queue import (
    RequestState,
    SchedulingPolicy,
    WaitingQueue,
    request_output,
)
from appliance.sim.engine_io import (
    FinishReason,
    RequestOutput,
    SimRequest,
    StepResult,
    default_output_token,
)
from appliance.sim.kv.cache_request import CacheRequest
from appliance.sim.kv.copy_channel import CopyChannel
from appliance.sim.kv.host_tier import HostTier
from appliance.sim.kv.pin_keeper import PinKeeper
from appliance.sim.kv.pins import latest_expiry_first
from appliance.sim.kv.prefetch_lane import PrefetchLane
from appliance.sim.kv.prefix_cache import PrefixCache
from appliance.sim.kv.residency_hook import ResidencyHook, RetentionHook


class SimEngine(EngineBatching, EngineSessions, EngineFastPath):
    """One simulated vLLM engine: a scheduler, a prefix cache and a latency model."""

    def __init__(
        self,
        config: EngineConfig,
        *,
        hasher: BlockHasher,
        latency: LatencyModel,
        residency: ResidencyHook | None = None,
        host: HostTier | None = None,
        output_token_ids: Callable[[SimRequest, int], int] | None = None,
        retention: RetentionHook | None = None,
    ) -> None:
        if hasher.block_size != config.block_size:
            raise ValueError(
                f"hasher block size {hasher.block_size} != block_size {config.block_size}"
            )
        self.config = config
        self.block_size = config.block_size
        self.hasher = hasher
        self.latency = latency
        self.max_model_len = config.max_model_len
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.long_prefill_token_threshold = config.long_prefill_token_threshold
        self.prompt_a_step = config.prompt_a_step
        self._chunk = config.max_model_len  # this step's cap per request (`_chunk_cap`)
        self.policy: SchedulingPolicy = config.policy
        self.host = host
        self.cache = PrefixCache(
            config.num_blocks,
            config.block_size,
            max_model_len=config.max_model_len,
            enable_caching=config.enable_prefix_caching,
            enable_events=config.enable_kv_events,
            host=host if config.enable_prefix_caching else None,
            pin_priority=residency.pin_priority if residency is not None else latest_expiry_first,
        )
        self._residency = residency
        self._retention = retention
        if retention is not None:
            retention.bind(self.cache.pool, self.cache if self.cache.host is not None else None)
        self._turn_arrived: Callable[[SimRequest, float], None] | None = getattr(
            residency, "turn_arrived", None
        )
        self._token = output_token_ids or default_output_token
        self._entries: dict[str, RequestState] = {}
        self._running: list[RequestState] = []
        self._waiting = WaitingQueue(config.policy)
        self._loading: list[RequestState] = []  # admitted, their host hit on its way to the GPU
        self._h2d = CopyChannel()
        self.prefetches = PrefetchLane(self.cache, hasher, latency, self._h2d)
        self._now = 0.0  # the `now` of the step under way
        self._pending: list[RequestOutput] = []  # abort outputs for the next step
        self._seq = 0
        self._n = EngineCounters()
        self._pins = PinKeeper(self.cache, self._n, residency, host)
        self._last_prompts: OrderedDict[str, SimRequest] = OrderedDict()
        """Each session's newest finished request (the retention's, for `restore`)."""
        self._fast_decode = True  # tests turn it off to check it changes nothing
        self._decode = DecodeRun(self.cache, latency, self._token, self._n, config.max_model_len)

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
        creq = CacheRequest.for_prompt(
            req.request_id,
            req.prompt_token_ids,
            self.hasher,
            keys=keys,
            session_id=req.session_id,
            block_hashes=req.block_hashes,
        )
        self._seq += 1
        entry = RequestState(req, creq, now, self._seq)
        self._entries[req.request_id] = entry
        if not self.prefetches.turn_arrived(entry, now):
            self._waiting.add(entry)
        if self._turn_arrived is not None:
            self._turn_arrived(req, now)

    def abort_request(self, request_id: str, now: float) -> None:
        """Drop a request wherever it is and free its blocks; unknown ids are ignored."""
        entry = self._entries.pop(request_id, None)
        if entry is None:
            return
        self._decode.settle()
        self._decode.left = 0
        if entry in self._running:
            self._running.remove(entry)
            self._finished(entry)
            self.cache.free(entry.cache)
        elif entry in self._loading:
            self._loading.remove(entry)
            self.cache.free(entry.cache)
        elif not self.prefetches.unpark(entry):
            self._waiting.remove(entry)
        self._n.success["abort"] += 1
        self._pending.append(request_output(entry, [], "abort"))

    def abort_all(self, now: float) -> int:
        """Abort every request in the engine (vLLM's pause in "abort" mode); how many."""
        ids = list(self._entries)
        for request_id in ids:
            self.abort_request(request_id, now)
        return len(ids)

    def has_unfinished_requests(self) -> bool:
        return bool(self._entries) or bool(self._pending) or self.prefetches.busy

    def block_ids(self, request_id: str) -> tuple[int, ...]:
        """The KV blocks an unfinished request holds, in token order (empty if none)."""
        entry = self._entries.get(request_id)
        return self.cache.block_ids(entry.cache) if entry is not None else ()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (refused while any request holds blocks)."""
        return self.cache.reset()

    @property
    def stats(self) -> EngineStats:
        running, waiting = self.queue_lengths()
        pins = self._residency is not None
        return engine_stats(self._n, self.cache, self.host, running, waiting, pins=pins)

    def queue_lengths(self) -> tuple[int, int]:
        """`stats`' num_running and num_waiting (a router's look, without the counters)."""
        waiting = len(self._waiting) + len(self._loading) + self.prefetches.num_parked
        return len(self._running), waiting

    # --- the step ---

    def step(self, now: float) -> StepResult:
        """Schedule one batch, run it on the modelled GPU and return what it produced."""
        if self._decode.held:
            raise RuntimeError("take the held decode steps' outputs first (take_decoded)")
        self._decode.settle()
        self._decode.left = 0
        scheduled: list[tuple[RequestState, int, int]] = []  # entry, tokens, computed before
        preempted: list[str] = []
        if self._retention is not None:
            self._retention.step_begins()
        lane = self.prefetches
        self._now = now
        if self._residency is not None or lane.started:
            self._pins.expire(now, self._waiting)
        if self.host is not None:
            self.host.now_s = now
            if self._loading:
                self._finish_loads(now)
            if lane.busy:
                self._queue_first(lane.finish_loads(now))
        budget = self._schedule_running(scheduled, preempted)
        if not preempted:
            budget = self._schedule_waiting(scheduled, budget, now)
        self._note_first(scheduled)
        speculative = lane.schedule(0 if preempted or self._waiting else budget, now)
        outputs, self._pending = self._pending, []
        duration = self._duration(scheduled + speculative)
        lane.after_step(speculative, now)
        by_request = {e.cache.request_id: n for e, n, _ in speculative}
        total = sum(by_request.values())
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
        ready = [e.ready_s for e in self._loading]
        if (lane_ready := lane.next_ready_s()) is not None:
            ready.append(lane_ready)
        if not (total or outputs or events or preempted) and ready:
            result.idle_until_s = min(ready)
            result.duration_s = result.idle_until_s - now
        return result

    def _sample(self, entry: RequestState, now: float) -> RequestOutput:
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
            self._finished(entry)
            self._pins.release(entry, now)
            self._n.success[reason] += 1
        out = request_output(entry, [token], reason)
        out.first_token = first
        return out
