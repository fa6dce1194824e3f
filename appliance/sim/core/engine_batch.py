"""How a simulated engine's step chooses its batch, mixed into `SimEngine` (`engine.py` says
the rules, vLLM's): running requests first, preempting as needed, then waiting requests
admitted in queue order; host loads started and finished; the batch's modelled duration.

Host tier (vLLM's `--kv-offloading-size`, native OffloadingConnector, LRU: its blocks of
pinned host memory, a tier possibly shared by several engines, its own priority ordering its
evictions). Prompt blocks are copied there as they are cached, and a waiting request's
lookup continues past its GPU hit into the host tier (`PrefixCache`). A request with a host
hit is admitted like vLLM's request that waits for remote KV: GPU blocks are allocated for
the hit (it must fit whole, as any admission), nothing is scheduled for it, and the copy
host -> GPU (`latency.kv_copy_s` of the hit's bytes, one batched copy) runs on the engine's
one host-to-device channel, after any copy queued before it; from the first step at or after
the copy's end the blocks are cached and the request waits again, at the head of the queue,
to compute the rest. So the promotion time lands in that request's TTFT, not in other
requests' steps. Its host tokens count as cached (`num_cached_tokens`) and, apart, as
`host_hit_tokens_total` (`vllm:prompt_tokens_cached_by_source{source="host"}`). A step with
nothing to schedule but loads in flight lasts until the first load completes
(`idle_until_s`).
"""

from __future__ import annotations

from appliance.perf.latency import CopyDirection, LatencyModel
from appliance.sim.core.engine_stats import EngineCounters
from appliance.sim.core.waiting_queue import RequestState, SchedulingPolicy, WaitingQueue
from appliance.sim.kv.cache_request import NO_HIT, CacheHit, CacheRequest
from appliance.sim.kv.copy_channel import CopyChannel
from appliance.sim.kv.pin_keeper import pin_owner
from appliance.sim.kv.prefetch_lane import PrefetchLane
from appliance.sim.kv.prefix_cache import PrefixCache
from appliance.sim.kv.residency_hook import ResidencyHook, RetentionHook


class EngineBatching:
    """The scheduler half of `SimEngine`, over the engine's queues and cache."""

    block_size: int
    latency: LatencyModel
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    long_prefill_token_threshold: int
    prompt_a_step: bool
    _chunk: int
    _first: RequestState | None = None
    """This step's one prompt (`_first_prompt`)."""
    _first_stalled = False
    """The first prompt of the step before was left out of it (`_note_first`)."""
    policy: SchedulingPolicy
    cache: PrefixCache
    prefetches: PrefetchLane
    _residency: ResidencyHook | None
    _retention: RetentionHook | None
    _running: list[RequestState]
    _waiting: WaitingQueue
    _loading: list[RequestState]
    _h2d: CopyChannel
    _n: EngineCounters
    _now: float
    _fast_decode: bool

    def _queue_first(self, entries: list[RequestState]) -> None:
        """Requests that waited for their session's prefetch go to the head of the queue."""
        for entry in reversed(entries):
            self._waiting.prepend(entry)

    def _room(self, creq: CacheRequest, n: int, hit: CacheHit = NO_HIT, full: bool = False) -> None:
        """Cancel prefetches in flight while a real allocation would be short (before any
        pin gives way: speculation goes first)."""
        lane = self.prefetches
        while lane.busy and not self.cache.can_allocate(creq, n, hit, full_sequence_must_fit=full):
            released = lane.cancel_one(self._now)
            if released is None:
                return
            self._queue_first(released)

    def _finish_loads(self, now: float) -> None:
        """Requests whose host blocks have arrived cache them and wait again, in front."""
        done = [e for e in self._loading if e.ready_s <= now]
        if not done:
            return
        self._loading = [e for e in self._loading if e.ready_s > now]
        for entry in reversed(done):
            self.cache.complete_load(entry.cache)
            self._waiting.prepend(entry)

    def _start_load(self, entry: RequestState, hit: CacheHit, now: float) -> bool:
        """Admit the waiting request at the head with a hit that continues in the host
        tier: GPU blocks for the whole hit, and its host part's copy queued on the host ->
        GPU channel. False (nothing changed) when the sequence does not fit."""
        n = hit.num_host_tokens
        self._room(entry.cache, n, hit, full=True)
        new_blocks = self.cache.allocate(
            entry.cache, n, hit, full_sequence_must_fit=True, delay_cache_blocks=True
        )
        if new_blocks is None:
            return False
        self._waiting.pop()
        copy_s = self.latency.kv_copy_s(n, CopyDirection.H2D)
        entry.ready_s = self._h2d.reserve(now, copy_s)
        self._n.host_load_s += copy_s
        self._loading.append(entry)
        return True

    def _schedule_running(
        self, scheduled: list[tuple[RequestState, int, int]], preempted: list[str]
    ) -> int:
        """Schedule running requests (preempting as needed); returns the budget left. With
        a first prompt (`_first_prompt`), the other running prompts sit this step out, as
        if not running (the appliance's scheduler hides them from vLLM's)."""
        self._first = self._first_prompt()
        if self._first is None:
            return self._schedule_visible(scheduled, preempted)
        everyone = self._running
        paused = [e for e in everyone if e is not self._first and _in_prompt(e)]
        self._running = [e for e in everyone if e is self._first or not _in_prompt(e)]
        try:
            return self._schedule_visible(scheduled, preempted)
        finally:
            still = {id(e) for e in self._running} | {id(e) for e in paused}
            self._running = [e for e in everyone if id(e) in still]

    def _first_prompt(self) -> RequestState | None:
        """`prompt_a_step`: while two or more prompts are in flight (running requests short
        of their prompt, waiting and loading ones), the first of them in the queue's order,
        which alone computes prompt tokens this step; None otherwise, and for one step after
        the first was not scheduled (it did not fit beside the paused prompts' blocks: they
        go on, or it would wait for them forever)."""
        if not self.prompt_a_step or self._first_stalled:
            return None
        prompts = [e for e in self._running if _in_prompt(e)]
        if len(prompts) + len(self._waiting) + len(self._loading) < 2:
            return None
        if self._waiting:
            prompts.append(self._waiting.peek())
        if not prompts:
            return None
        return min(prompts, key=self._waiting.order_key)

    def _schedule_visible(
        self, scheduled: list[tuple[RequestState, int, int]], preempted: list[str]
    ) -> int:
        budget = self.max_num_batched_tokens
        running = self._running
        self._chunk = self._chunk_cap()
        bs = self.block_size
        fast = self._fast_decode
        i = 0
        while i < len(running) and budget > 0:
            entry = running[i]
            creq = entry.cache
            c = creq.num_computed_tokens
            n = min(len(creq.all_token_ids) - c, self._chunk, budget, self.max_model_len - c - 1)
            if n <= 0:
                i += 1
                continue
            if fast and n == 1 and c % bs and (c + 1) % bs:
                # The token lands in the request's last, partly filled block and does not
                # fill it: exactly what allocate() would do, without its bookkeeping.
                creq.num_computed_tokens = c + 1
                ok = True
            else:
                self._room(creq, n)
                while not (ok := self.cache.allocate(creq, n) is not None):
                    if self._retention is not None and self._retention.relieve():
                        break  # holds given back: retried next step, nobody preempted
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

    def _note_first(self, scheduled: list[tuple[RequestState, int, int]]) -> None:
        """After the step's scheduling: whether the first prompt was left out."""
        first = self._first
        self._first_stalled = first is not None and all(e is not first for e, _, _ in scheduled)

    def _chunk_cap(self) -> int:
        """The most tokens one request computes this step: vLLM's long prefill threshold,
        but only while another request runs, waits or loads (none to starve otherwise);
        none with `prompt_a_step` (one prompt computes a step)."""
        cap = self.long_prefill_token_threshold
        in_flight = len(self._running) + len(self._waiting) + len(self._loading)
        if cap and not self.prompt_a_step and in_flight > 1:
            return cap
        return self.max_model_len

    def _victim(self) -> RequestState:
        if self.policy == "priority":
            return max(self._running, key=lambda e: (e.req.priority, e.arrival_s))
        return self._running[-1]

    def _preempt(self, entry: RequestState) -> None:
        self.cache.preempt(entry.cache)
        self._n.preemptions += 1
        self._waiting.prepend(entry)

    def _schedule_waiting(
        self, scheduled: list[tuple[RequestState, int, int]], budget: int, now: float
    ) -> int:
        """Admit waiting requests in queue order; returns the budget left. With a first
        prompt, only it: none while it runs, one (at most) while it waits at the head."""
        waiting, cache = self._waiting, self.cache
        limit = self.max_num_seqs
        if self._first is not None:
            if not waiting or waiting.peek() is not self._first:
                return budget
            limit = min(limit, len(self._running) + 1)
        while budget > 0 and waiting and len(self._running) < limit:
            entry = waiting.peek()
            creq = entry.cache
            hit = cache.lookup(creq) if creq.num_computed_tokens == 0 else NO_HIT
            retention, fresh = self._retention, creq.num_computed_tokens == 0
            if retention is not None and fresh and not retention.admitting(creq, hit):
                break  # holds were given back for a running request: its room first
            if hit.num_host_tokens:
                if not self._start_load(entry, hit, now):
                    if self._unblock(entry):
                        continue
                    break
            else:
                n = creq.num_tokens - creq.num_computed_tokens - hit.num_tokens
                n = min(n, self._chunk, budget)
                self._room(creq, n, hit, full=True)
                if cache.allocate(creq, n, hit, full_sequence_must_fit=True) is None:
                    if self._unblock(entry):
                        continue
                    break
                waiting.pop()
                self._running.append(entry)
                scheduled.append((entry, n, creq.num_computed_tokens - n))
                budget -= n
            if self._residency is not None or self.prefetches.started:
                cache.unpin(pin_owner(entry.req))
            if entry.first_scheduled_s is None:
                entry.num_cached_tokens = hit.num_tokens + hit.num_host_tokens
                entry.num_host_cached_tokens = hit.num_host_tokens
                entry.first_scheduled_s = now
        return budget

    def _unblock(self, head: RequestState) -> bool:
        """Nothing runs or loads and the head does not fit: the other waiting requests give
        back the host blocks they had loaded (preempted, to load again), so that loaded
        requests cannot hold each other up forever. Whether any did."""
        if self._running or self._loading:
            return False
        loaded = [e for e in self._waiting if e is not head and e.cache.num_computed_tokens]
        for e in loaded:
            self.cache.preempt(e.cache)
            self._n.preemptions += 1
        return bool(loaded)

    def _duration(self, scheduled: list[tuple[RequestState, int, int]]) -> float:
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


def _in_prompt(entry: RequestState) -> bool:
    """Not yet past its prompt (a preempted request recomputes its output after it)."""
    return entry.cache.num_computed_tokens < entry.cache.num_prompt_tokens
