"""Routing callbacks for the virtual-time replay: one router per policy, with what it knows.

Model of the world: a router in front of the simulated engines sees each arrival's prompt
and the engines' gauges (waiting queue, KV usage), and keeps what a real router keeps: an
index of resident blocks fed by the engines' KV events (applied when a step's outputs
become visible, as vLLM publishes them after the step), and its own account of the work it
routed: requests in flight, prefill not yet started (tokens for Dynamo; for the appliance
the live router's own queue book, `appliance.services.turns.queue_book`, on the replay's virtual
clock, so the replay judges the policy with the inputs it has live) and the blocks of
active sequences. First tokens and finishes reach it through `on_step`. The appliance's
book reads each engine's gauges at the arrival as a worker reading (its waiting requests,
and its mean prompt over the first tokens so far, as vLLM's counters give it live); the
anchors read them as their sources do. The policy itself
is the appliance's `route` or an anchor policy, called unchanged: this module only builds
their inputs.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from appliance.domain.block_hash import (
    NO_KEYS,
    BlockHash,
    BlockHasher,
    RequestKeys,
    cacheable_tokens,
    event_block_hash,
    shared_prefix,
)
from appliance.domain.kv_index import KvIndex
from appliance.domain.records import TurnId, WorkerId
from appliance.domain.worker import LoadSnapshot
from appliance.perf.latency import LatencyModel
from appliance.policy.routing import RouteRequest, WorkerView, route
from appliance.policy.routing.anchors import ANCHORS, AnchorRequest, AnchorWorker
from appliance.policy.routing.core import default_profile
from appliance.policy.routing.turn_order import turn_priority
from appliance.services.turns.queue_book import QueueBook
from appliance.sim.engine_io import SimRequest, StepResult
from appliance.sim.runtime.clock import VirtualClock
from appliance.sim.runtime.engine_views import EngineView

_NUMBERS = re.compile(r"\d[\d.,]*")
APPLIANCE = "appliance"
MODEL = "replay"
POLICY_NAMES = (APPLIANCE, *ANCHORS)
_USES_INDEX = {APPLIANCE, "llm-d-precise", "dynamo-kv"}
_USES_KEYS = _USES_INDEX | {"sglang-cache-aware"}
_KEYS_KEPT = 4096
"""Sessions whose last prompt's event hashes a router keeps, to convert only what is new."""


def worker_url(i: int) -> str:
    return f"http://127.0.0.1:{8100 + i}"


@dataclass(slots=True)
class _Live:
    worker: int
    fresh_tokens: int
    keys: tuple[int, ...]
    session: str | None
    prefilling: bool = True


class PolicyRouter:
    """`route(request, views) -> engine` for `virtual.replay`, plus `on_step` to watch."""

    def __init__(
        self,
        policy: str,
        *,
        workers: int,
        hasher: BlockHasher,
        latency: LatencyModel,
    ) -> None:
        if policy not in POLICY_NAMES:
            known = ", ".join(POLICY_NAMES)
            raise ValueError(f"unknown routing policy {policy!r}; known: {known}")
        self.name = policy
        self.n = workers
        self.hasher = hasher
        self.bs = hasher.block_size
        self.latency = latency
        self.index = KvIndex() if policy in _USES_INDEX else None
        self.ids = [WorkerId(f"w{i}") for i in range(workers)]
        self.in_flight = [0] * workers
        self.prefill_tokens = [0] * workers
        self.first_tokens = [0] * workers
        self.first_token_prompts = [0] * workers
        self.first_token_fresh = [0] * workers
        """Per engine: requests that had their first token, their prompt tokens and those
        computed, not cached (vLLM's `time_to_first_token_seconds_count`,
        `prompt_tokens_total` and `request_prefill_kv_computed_tokens_sum`)."""
        self.clock = VirtualClock()
        self.queues = QueueBook(latency, self.clock)
        self.active: list[Counter[int]] = [Counter() for _ in range(workers)]
        self.live: dict[str, _Live] = {}
        self.home: dict[str, int] = {}
        self._last_keys: dict[str, tuple[Sequence[BlockHash], tuple[int, ...]]] = {}
        self.reasons: Counter[str] = Counter()
        if policy == APPLIANCE:
            self.profile = default_profile()
        else:
            self.anchor = ANCHORS[policy]()
            self.state = self.anchor.initial_state([worker_url(i) for i in range(workers)])

    # --- routing ---

    def __call__(self, req: SimRequest, views: Sequence[EngineView]) -> int:
        keys = self._keys(req) if self.name in _USES_KEYS else ()
        resident = self._resident(keys)
        n = len(req.prompt_token_ids)
        if self.name == APPLIANCE:
            w, reason, prefill_s = self._appliance(req, views, resident)
            # What the live desk sends the worker; the replay grants every turn priority 0.
            req.priority = turn_priority(0, prefill_s)
        else:
            w, reason = self._anchor(req, views, keys, resident)
        self.reasons[_NUMBERS.sub("N", reason)] += 1
        cached = min(resident[w] * self.bs, cacheable_tokens(n, self.bs))
        fresh = n - cached
        self.in_flight[w] += 1
        self.prefill_tokens[w] += fresh
        if self.name == APPLIANCE:
            self.queues.sent(self.ids[w], TurnId(req.request_id), prefill_s, req.arrival_s)
        full = keys[: n // self.bs]
        if self.name == "dynamo-kv":
            self.active[w].update(full)
        self.live[req.request_id] = _Live(w, fresh, full, req.session_id)
        return w

    def predict(
        self,
        req: SimRequest,
        views: Sequence[EngineView],
        digests: Sequence[BlockHash] | None = None,
    ) -> int | None:
        """Where the session's next turn, starting with `req`'s prompt, would go now,
        changing nothing: the appliance's policy asked as for a turn (`digests`: the
        prompt's salted block hashes, if known); an anchor, which keeps state of its own,
        answers with the worker the session last ran on."""
        if self.name != APPLIANCE:
            return self.home.get(req.session_id) if req.session_id else None
        keys = self._keys(req) if digests is None else tuple(map(event_block_hash, digests))
        return self._appliance(req, views, self._resident(keys))[0]

    def _keys(self, req: SimRequest) -> tuple[int, ...]:
        """Event hashes of the prompt's full blocks (what KV events name: salted with the
        request's tenant, as the engines hash them; SGLang's tree, which sees text, not)."""
        salted = req.cache_salt and self.name in _USES_INDEX
        keys = RequestKeys(cache_salt=req.cache_salt) if salted else NO_KEYS
        digests = req.block_hashes  # salted: a tree over them has the same shape
        if digests is None:
            digests = self.hasher.hash_blocks(req.prompt_token_ids, keys=keys)
        return self._event_keys(req.session_id, digests)

    def _event_keys(self, session: str | None, digests: Sequence[BlockHash]) -> tuple[int, ...]:
        """The digests as KV events name them; what the session's previous prompt shares
        with this one (its leading digests) converted once."""
        keys: tuple[int, ...] = ()
        last = self._last_keys.pop(session, None) if session else None
        if last is not None:
            prev = last[0]  # most often all of it begins this prompt: one comparison
            same = len(prev) if digests[: len(prev)] == prev else shared_prefix(prev, digests)
            keys = last[1][:same]
        keys += tuple(map(event_block_hash, digests[len(keys) :]))
        if session:
            self._last_keys[session] = (digests, keys)
            if len(self._last_keys) > _KEYS_KEPT:
                del self._last_keys[next(iter(self._last_keys))]  # the longest unseen
        return keys

    def _resident(self, keys: tuple[int, ...]) -> list[int]:
        if self.index is None or not keys:
            return [0] * self.n
        found = self.index.lookup(keys)
        return [found.get(wid, 0) for wid in self.ids]

    def _appliance(
        self, req: SimRequest, views: Sequence[EngineView], resident: list[int]
    ) -> tuple[int, str, float]:
        """The worker the appliance's policy picks, why, and the prefill it estimated there."""
        n = len(req.prompt_token_ids)
        cap = cacheable_tokens(n, self.bs)
        self._tick(req.arrival_s)
        queues = [0.0] * self.n
        for v in views:
            queues[v.index] = self.queues.queue_at(self.ids[v.index], self._reading(v, req))
        total = sum(queues)
        home = self.home.get(req.session_id) if req.session_id else None
        workers = [
            WorkerView(
                worker=self.ids[v.index],
                models=frozenset({MODEL}),
                resident_tokens=min(resident[v.index] * self.bs, cap),
                queue_s=queues[v.index],
                queued_share=queues[v.index] / total if total else 0.0,
                kv_usage=v.kv_cache_usage,
                kv_held=_held_share(v),
                kv_pool_tokens=_pool_tokens(v),
            )
            for v in views
        ]
        request = RouteRequest(MODEL, n, self.ids[home] if home is not None else None)
        decision = route(request, workers, self.latency, self.profile)
        chosen = decision.chosen
        if chosen is None:
            raise RuntimeError(f"the appliance's policy placed nothing: {decision.reason}")
        return self.ids.index(chosen.worker), decision.kind, chosen.prefill_s

    def _reading(self, v: EngineView, req: SimRequest) -> LoadSnapshot:
        """The engine's gauges at the arrival, as the book reads a worker's /metrics."""
        return LoadSnapshot(
            time=req.arrival_s,
            running=v.num_running,
            waiting=v.num_waiting,
            kv_cache_usage_perc=v.kv_cache_usage,
            prompt_tokens=self.first_token_prompts[v.index],
            ttft_count=self.first_tokens[v.index],
            prefill_count=self.first_tokens[v.index],
            prefill_fresh_tokens=self.first_token_fresh[v.index],
            prefill_prompt_tokens=self.first_token_prompts[v.index],
        )

    def _anchor(
        self,
        req: SimRequest,
        views: Sequence[EngineView],
        keys: tuple[int, ...],
        resident: list[int],
    ) -> tuple[int, str]:
        n = len(req.prompt_token_ids)
        blocks = keys
        if n % self.bs and self.name == "sglang-cache-aware":
            tail = tuple(req.prompt_token_ids[len(keys) * self.bs :])
            blocks = (*keys, hash((keys[-1] if keys else 0, tail)))
        areq = AnchorRequest(req.request_id, n, req.session_id, blocks, self.bs)
        workers = [
            AnchorWorker(
                index=v.index,
                url=worker_url(v.index),
                in_flight=self.in_flight[v.index],
                waiting=v.num_waiting,
                kv_usage=v.kv_cache_usage,
                cached_blocks=resident[v.index],
                prefill_tokens=self.prefill_tokens[v.index],
                active_blocks=len(self.active[v.index]),
                shared_active_blocks=self._shared(v.index, keys[: n // self.bs]),
            )
            for v in views
        ]
        now = req.arrival_s
        self.anchor.advance(self.state, now)
        decision = self.anchor.route(areq, workers, self.state)
        self.anchor.record(self.state, areq, decision, now)
        return decision.worker, decision.reason

    def _shared(self, w: int, full: tuple[int, ...]) -> int:
        active = self.active[w]
        return sum(1 for k in full if k in active) if active else 0

    # --- watching ---

    def _tick(self, t: float) -> None:
        if t > self.clock.now():  # events of one instant may come in any order
            self.clock.advance_to(t)

    def on_step(self, i: int, now: float, result: StepResult) -> None:
        self._tick(now)
        if self.index is not None:
            for event in result.events:
                self.index.apply(self.ids[i], event)
        for out in result.outputs:
            live = self.live.get(out.request_id)
            if live is None:
                continue
            if out.first_token and live.prefilling:
                live.prefilling = False
                self.first_tokens[live.worker] += 1
                self.first_token_prompts[live.worker] += out.num_prompt_tokens
                self.first_token_fresh[live.worker] += out.num_prompt_tokens - out.num_cached_tokens
                self.prefill_tokens[live.worker] -= live.fresh_tokens
                self.queues.first_byte(self.ids[live.worker], TurnId(out.request_id))
                if live.session is not None:
                    self.home[live.session] = live.worker
            if out.finished:
                del self.live[out.request_id]
                if self.name == APPLIANCE:
                    wid, turn = self.ids[live.worker], TurnId(out.request_id)
                    self.queues.ended(wid, turn, failed=False)
                self.in_flight[live.worker] -= 1
                active = self.active[live.worker]
                for k in live.keys if self.name == "dynamo-kv" else ():
                    if active[k] <= 1:
                        del active[k]
                    else:
                        active[k] -= 1


def _usable_blocks(v: EngineView) -> int:
    """Blocks of the engine's KV pool a request can use: all but vLLM's null block."""
    return v.engine.cache.num_blocks - 1


def _pool_tokens(v: EngineView) -> int:
    """Tokens the engine's usable KV pool holds, as live vLLM's `cache_config_info` gives
    them."""
    return _usable_blocks(v) * v.engine.cache.block_size


def _held_share(v: EngineView) -> float:
    """The share of the engine's usable KV pool its pins hold."""
    return v.engine.cache.num_pinned_blocks / max(_usable_blocks(v), 1)
