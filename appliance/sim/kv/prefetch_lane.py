"""Prefetches on one simulated engine: a waiting session's KV brought back into HBM before
its next turn arrives (the mechanism behind `appliance.policy.prefetch`).

Model of the world: `start(req, now, prefill=, hold_s=)` takes the session's stable prefix
(`req`: its last prompt, session and salt; its whole blocks, all of them, are what may be
restored) and looks it up as a waiting request would. A part the host tier holds past the
HBM hit is promoted: HBM blocks are allocated for it now and its copy queued on the
engine's host -> GPU channel (`CopyChannel`) after any copy before it; the blocks are
cached when it lands. With
`prefill`, the rest of the prefix is then computed in what each step leaves of its token
budget, at most `max_tokens_per_step`, and only in a step where no real request waits
for admission. A prefetch never takes what others need or hold: it only uses blocks an
allocation may take without a pin giving way (free ones, or cached ones nobody holds), and
when a real allocation would be short the engine cancels prefetches in flight first
(`cancel_one`), freeing their blocks. Done,
its blocks are pinned for the session for `hold_s` (a residency pin: the next turn's
admission takes it over; under pressure it gives way in the pin order), and the
speculative request is forgotten: no output, no sampled token, no finish. The session's
next turn, arriving meanwhile (`turn_arrived`), waits for a copy in flight (its TTFT then
holds only what is left of the copy) and stops a prefill where it is (what is computed is
pinned for it). Each prefetch's end is written down (`take_done`): tokens restored, copy
and prefill seconds, how it ended.

What the sim leaves out: a speculative chunk is charged to its step like any chunk (a real
request's first token in the same step waits for it: `max_tokens_per_step` bounds that),
and a cancelled copy keeps its slot on the channel.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from appliance.domain.block_hash import NO_KEYS, BlockHash, BlockHasher, RequestKeys
from appliance.perf.latency import CopyDirection, LatencyModel
from appliance.sim.core.waiting_queue import RequestState
from appliance.sim.engine_io import SimRequest
from appliance.sim.kv.cache_request import CacheHit, CacheRequest
from appliance.sim.kv.copy_channel import CopyChannel
from appliance.sim.kv.prefix_cache import PrefixCache

DEFAULT_MAX_TOKENS_PER_STEP = 8192
"""vLLM's default step budget: a speculative prefill takes what a step leaves, whole. In
smaller chunks each would read the context again (the latency model's cost per reused
token) and pay its own overhead: 2,048-token chunks cost about half again a turn's own
prefill of the same tokens here. The price: a request that arrives during such a step
waits for it (up to about 0.3 s on the bundled profile)."""
PREFETCH_ID = "prefetch"
"""Speculative requests are named `prefetch:SESSION:N`."""

PrefetchEnd = Literal["completed", "stopped", "cancelled"]
Scheduled = list[tuple[RequestState, int, int]]
"""(request, tokens scheduled, tokens computed before), as the engine's step lists them."""


@dataclass(frozen=True, slots=True)
class PrefetchStart:
    gpu_tokens: int
    """Tokens of the prefix in HBM when it started."""
    host_tokens: int
    """Tokens it copies from the host tier."""
    target_tokens: int
    """The prefix's whole blocks, in tokens: all it may restore."""


@dataclass(frozen=True, slots=True)
class PrefetchDone:
    session_id: str
    ended_s: float
    restored_tokens: int
    """Tokens it copied or computed that were cached when it ended."""
    copy_s: float
    prefill_tokens: int
    prefill_s: float
    end: PrefetchEnd


class _Spec:
    """A prefetch in flight: its speculative request and its progress."""

    __slots__ = ("admitted", "copy_s", "gpu_tokens", "hold_s", "loading", "prefill",
                 "prefill_s", "prefill_tokens", "state", "target")  # fmt: skip

    def __init__(self, state: RequestState, prefill: bool, hold_s: float, gpu_tokens: int,
                 target: int) -> None:  # fmt: skip
        self.state, self.prefill, self.hold_s = state, prefill, hold_s
        self.gpu_tokens, self.target = gpu_tokens, target
        self.copy_s = self.prefill_s = 0.0
        self.prefill_tokens = 0
        self.loading = self.admitted = False


class PrefetchLane:
    """One engine's prefetches in flight; see the module."""

    def __init__(
        self,
        cache: PrefixCache,
        hasher: BlockHasher,
        latency: LatencyModel,
        channel: CopyChannel,
        *,
        max_tokens_per_step: int = DEFAULT_MAX_TOKENS_PER_STEP,
    ) -> None:
        self.cache = cache
        self.hasher = hasher
        self.latency = latency
        self.channel = channel
        self.max_tokens_per_step = max_tokens_per_step
        self.started = False
        """Whether any prefetch ever started (the engine then minds their pins)."""
        self._specs: dict[str, _Spec] = {}
        self._parked: dict[str, list[RequestState]] = {}
        self._done: list[PrefetchDone] = []
        self._seq = 0

    @property
    def busy(self) -> bool:
        return bool(self._specs)

    @property
    def num_parked(self) -> int:
        return sum(len(p) for p in self._parked.values())

    def in_flight(self, session_id: str) -> bool:
        return session_id in self._specs

    def take_done(self) -> list[PrefetchDone]:
        done, self._done = self._done, []
        return done

    def block_hashes(self, req: SimRequest) -> list[BlockHash]:
        """The prompt's block hashes, as this engine hashes them (for `probe`)."""
        if req.block_hashes is not None:
            return req.block_hashes
        return self.hasher.hash_blocks(req.prompt_token_ids, keys=_keys(req))

    def probe(self, req: SimRequest, hashes: Sequence[BlockHash] | None = None) -> tuple[int, int]:
        """(tokens of the prompt in HBM, tokens past them on the host tier), in whole
        blocks, as a lookup would find them now; changes nothing. `hashes`: its
        `block_hashes`, if known."""
        bs = self.hasher.block_size
        if hashes is None:
            hashes = self.block_hashes(req)
        hashes = hashes[: len(req.prompt_token_ids) // bs]
        gpu = 0
        for h in hashes:
            if self.cache.pool.get_cached_block(h) is None:
                break
            gpu += 1
        host = self.cache.host.lookup(hashes[gpu:]) if self.cache.host is not None else 0
        return gpu * bs, host * bs

    def start(
        self, req: SimRequest, now: float, *, prefill: bool, hold_s: float
    ) -> PrefetchStart | None:
        """Start restoring `req`'s prompt for its session; None when there is nothing to do
        (or room for it), or one runs for the session already."""
        sid = req.session_id
        if sid is None or sid in self._specs:
            return None
        self._seq += 1
        rid = f"{PREFETCH_ID}:{sid}:{self._seq}"
        bs = self.hasher.block_size
        target = len(req.prompt_token_ids) // bs * bs
        # One token past the last whole block, so a lookup may cover that block too (it
        # never covers the block of a prompt's last token); it is never computed.
        tokens = [*req.prompt_token_ids[:target], 0]
        creq = CacheRequest.for_prompt(
            rid, tokens, self.hasher, keys=_keys(req), session_id=sid, block_hashes=req.block_hashes
        )
        hit = self.cache.lookup(creq)
        host = hit.num_host_tokens
        if not host and (not prefill or hit.num_tokens >= target):
            return None
        state = RequestState(req, creq, now, self._seq)
        spec = _Spec(state, prefill, hold_s, hit.num_tokens, target)
        if host:
            if not self.cache.can_allocate(creq, host, hit):
                return None
            self.cache.allocate(creq, host, hit, delay_cache_blocks=True)
            spec.copy_s = self.latency.kv_copy_s(host, CopyDirection.H2D)
            spec.state.ready_s = self.channel.reserve(now, spec.copy_s)
            spec.loading = spec.admitted = True
        self._specs[sid] = spec
        self.started = True
        return PrefetchStart(hit.num_tokens, host, target)

    def next_ready_s(self) -> float | None:
        """When the first copy in flight lands (None: none is in flight)."""
        ready = [s.state.ready_s for s in self._specs.values() if s.loading]
        return min(ready) if ready else None

    def finish_loads(self, now: float) -> list[RequestState]:
        """Copies landed by `now` are cached; a promotion (or a prefill whose turn came)
        ends there. Returns the real requests that waited for them, to queue in front."""
        released: list[RequestState] = []
        for sid, spec in list(self._specs.items()):
            if not spec.loading or spec.state.ready_s > now:
                continue
            self.cache.complete_load(spec.state.cache)
            spec.loading = False
            creq = spec.state.cache
            if not spec.prefill or sid in self._parked or creq.num_computed_tokens >= spec.target:
                released += self._end(spec, now, "completed")
        return released

    def schedule(self, budget: int, now: float) -> Scheduled:
        """Prefill chunks in `budget` (what the step left; 0 while real requests wait)."""
        out: Scheduled = []
        budget = min(budget, self.max_tokens_per_step)
        for spec in list(self._specs.values()):
            if budget <= 0:
                break
            if spec.loading or not spec.prefill:
                continue
            creq = spec.state.cache
            hit = None
            if not spec.admitted:
                found = self.cache.lookup(creq)
                hit = CacheHit(found.block_ids, found.num_tokens, 0)
            computed = creq.num_computed_tokens + (hit.num_tokens if hit else 0)
            n = min(spec.target - computed, budget)
            if n <= 0 or not self.cache.can_allocate(creq, n, hit or _NO_HIT):
                self._end(spec, now, "cancelled" if n > 0 else "completed")
                continue
            self.cache.allocate(creq, n, hit)
            spec.admitted = True
            spec.prefill_tokens += n
            spec.prefill_s += self.latency.prefill_s(n, computed)
            out.append((spec.state, n, computed))
            budget -= n
        return out

    def after_step(self, scheduled: Scheduled, now: float) -> None:
        """Prefills whose prefix is all computed end, pinned for their session."""
        for state, _, _ in scheduled:
            spec = self._specs.get(state.req.session_id or "")
            if spec is not None and state.cache.num_computed_tokens >= spec.target:
                self._end(spec, now, "completed")

    def turn_arrived(self, entry: RequestState, now: float) -> bool:
        """The session's next turn arrived: True when it must wait for a copy in flight
        (it is held here until `finish_loads` releases it); a prefill stops where it is."""
        sid = entry.req.session_id
        spec = self._specs.get(sid) if sid is not None else None
        if spec is None or sid is None:
            return False
        if spec.loading:
            self._parked.setdefault(sid, []).append(entry)
            return True
        self._end(spec, now, "stopped")
        return False

    def unpark(self, entry: RequestState) -> bool:
        """Forget a real request held for a copy (it was aborted)."""
        for sid, parked in self._parked.items():
            if entry in parked:
                parked.remove(entry)
                if not parked:
                    del self._parked[sid]
                return True
        return False

    def cancel_one(self, now: float, session_id: str | None = None) -> list[RequestState] | None:
        """Cancel one prefetch to make room (a prefill before a copy), or the session's;
        returns the real requests that waited for it (None: nothing to cancel)."""
        if session_id is not None:
            spec = self._specs.get(session_id)
        else:
            spec = min(self._specs.values(), key=lambda s: s.loading, default=None)
        return None if spec is None else self._end(spec, now, "cancelled")

    def _end(self, spec: _Spec, now: float, end: PrefetchEnd) -> list[RequestState]:
        creq = spec.state.cache
        sid = spec.state.req.session_id or ""
        restored = 0
        if spec.admitted:
            if end != "cancelled" or not spec.loading:
                restored = max(0, min(creq.num_computed_tokens, spec.target) - spec.gpu_tokens)
            if end != "cancelled":
                self.cache.pin(sid, creq, now_s=now, until_s=now + spec.hold_s)
            self.cache.free(creq)
        self._done.append(
            PrefetchDone(sid, now, restored, spec.copy_s, spec.prefill_tokens, spec.prefill_s, end)
        )
        del self._specs[sid]
        return self._parked.pop(sid, [])


_NO_HIT = CacheHit((), 0, 0)


def _keys(req: SimRequest) -> RequestKeys:
    return RequestKeys(cache_salt=req.cache_salt) if req.cache_salt else NO_KEYS
