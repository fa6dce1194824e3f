"""Placement: where a turn should go, as a value; the caller commits it.

The turn's ids are hashed exactly as vLLM hashes blocks, under the tenant's salt (so no
cache entry is ever shared across tenants), reusing what the session's last prompt shares
with it; the KV index says which workers hold how much of that prefix; the queue book says
how much prefill waits at each; the routing policy (appliance/policy/routing) picks. A turn
forwarded before it is tokenised shares its session's last prompt, whose chain is already
known, and appends text resident nowhere yet, so it is placed on that chain. `place` changes
nothing: `commit` makes the placement the session's (its chain, its predicted residency).
The idle sessions' holds on a worker (its retention connector's reports) are room the
worker gives back on demand: the policy reads them beside the pool's usage.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from appliance.domain.block_hash import BlockHashChain, cacheable_tokens
from appliance.domain.kv_events import Medium
from appliance.domain.records import TenantId, WorkerId
from appliance.policy.routing import (
    PrefillCost,
    RouteDecision,
    RouteRequest,
    RoutingProfile,
    WorkerView,
    route,
)
from appliance.ports import KvLookup, KvRetention, WorkerEndpoint
from appliance.services.sessions.chat_tokens import TokenIds, token_ids
from appliance.services.sessions.sessions import SessionState, SessionTable
from appliance.services.turns.queue_book import QueueBook
from appliance.services.turns.turn import TurnRequest

Salt = Callable[[TenantId, str | None], str]
"""(tenant, the client's cache_salt) -> the salt the workers get."""


@dataclass(frozen=True, slots=True)
class Placement:
    decision: RouteDecision
    resident: dict[WorkerId, int]
    """Leading prompt tokens each worker holds (whole blocks, never the last token)."""
    chain: BlockHashChain
    ids: TokenIds | None
    """The ids `chain` hashes; None when the turn was placed on its session's last chain."""
    salt: str

    @property
    def prefill_s(self) -> float:
        """The router's estimate of the turn's prefill on the chosen worker (0: none)."""
        chosen = self.decision.chosen
        return chosen.prefill_s if chosen is not None else 0.0


@dataclass(frozen=True, slots=True)
class RoutingRule:
    """How turns are placed: the policy's scorers and weights, the prefill cost they weigh,
    the model the workers serve."""

    profile: RoutingProfile
    cost: PrefillCost
    model: str


class Placer:
    def __init__(
        self,
        *,
        workers: Callable[[], Sequence[WorkerEndpoint]],
        index: KvLookup,
        sessions: SessionTable,
        queues: QueueBook,
        rule: RoutingRule,
        salt: Salt,
        retention: KvRetention | None = None,
    ) -> None:
        """`retention`: the workers' retention connectors, whose reports say what the idle
        sessions' holds keep (None: the workers have none)."""
        self._workers = workers
        self._index = index
        self._sessions = sessions
        self._queues = queues
        self._cost = rule.cost
        self._profile = rule.profile
        self._model = rule.model
        self.salt = salt
        self._retention = retention

    def place(
        self,
        turn: TurnRequest,
        session: SessionState,
        exclude: frozenset[WorkerId] = frozenset(),
        queues: dict[WorkerId, float] | None = None,
    ) -> Placement:
        salt = self.salt(turn.tenant, turn.client_salt)
        ids = token_ids(turn.prompt_ids) if turn.prompt_ids is not None else None
        if ids is not None:
            chain = self._sessions.chain_for(session, ids, salt)
        else:  # untokenised: the last turn's prompt is the prefix this one shares
            assert session.chain is not None
            chain = session.chain
        blocks = self._index.lookup(chain.event_hashes) if chain.hashes else {}
        cap = cacheable_tokens(turn.prompt_len, chain.block_size)
        resident = {w: min(n * chain.block_size, cap) for w, n in blocks.items()}
        workers = self._workers()
        if queues is None:
            queues = self._queues.estimates(workers)
        total = sum(queues.values())
        views = [
            WorkerView(
                worker=w.id,
                models=frozenset({self._model}),
                healthy=w.healthy,
                excluded=w.id in exclude or turn.pinned not in (None, w.id),
                draining=w.draining,
                resident_tokens=resident.get(w.id, 0),
                queue_s=queues.get(w.id, 0.0),
                queued_share=queues.get(w.id, 0.0) / total if total else 0.0,
                kv_usage=w.load.kv_cache_usage_perc if w.load else 0.0,
                kv_held=self._held_share(w),
                kv_pool_tokens=(w.load.kv_capacity_tokens or 0) if w.load else 0,
                recent_failures=self._queues.recent_failures(w.id),
                slowdown=self._queues.slowdown(w.id),
            )
            for w in workers
        ]
        request = RouteRequest(self._model, turn.prompt_len, session.home)
        decision = route(request, views, self._cost, self._profile)
        if turn.route_note:
            decision = replace(decision, reason=f"{turn.route_note}; {decision.reason}")
        return Placement(decision, resident, chain, ids, salt)

    def _held_share(self, w: WorkerEndpoint) -> float:
        """The share of the worker's KV pool its holds keep (0 while its size is unknown)."""
        pool = w.load.kv_capacity_tokens if w.load else None
        if not pool or self._retention is None:
            return 0.0
        return sum(h.tokens for h in self._retention.retained(w.id).values()) / pool

    def generation(self, worker: WorkerId) -> int:
        """The worker's cache generation as the KV index knows it now."""
        return self._index.generation(worker)

    def commit(self, session: SessionState, placement: Placement) -> None:
        """Makes the placement the session's (the session table changes it)."""
        ids = placement.ids
        prompt = (ids, placement.chain, placement.salt) if ids is not None else None
        self._sessions.placed(session, prompt, placement.resident)

    def residency(self, session: SessionState) -> dict[str, dict[WorkerId, int]]:
        """The session's last prompt as the KV index holds it now (not as predicted at its
        last placement): leading tokens per worker, by tier ("gpu", "host")."""
        chain = session.chain
        if chain is None or not chain.hashes:
            return {"gpu": {}, "host": {}}
        bs = chain.block_size
        return {
            tier: {w: n * bs for w, n in self._index.lookup(chain.event_hashes, medium=m).items()}
            for tier, m in (("gpu", Medium.GPU), ("host", Medium.CPU))
        }
