"""The ledger rows the live idle reaper leaves: one `residency_events` row per decision (its
action, its sentence, and as JSON its kind, the hold's end, the inputs and the costs it
weighed), one per hold a worker gave back on its own, and one per session whose KV left its
worker's GPU tier, with the cause, which also marks the session's cache receipt evicted.

An eviction's cause is what the appliance last did with the KV, or what the worker did: a
released session's blocks went back to the engine's eviction order, least recently used
first, and another request took the room (`lru`); the reaper put them first to evict
(`reaper_evict`); its hold was given back by the worker (`pressure`, `capped`, `expired`);
it vanished while held, without a give-back (`worker_lost`: a restart or a cache reset); an
operator released it (`operator`); demoted to the host tier, it was evicted there (`host_lru`,
a row of tier "host").
"""

from __future__ import annotations

import dataclasses
import logging
from concurrent.futures import Future
from enum import StrEnum
from typing import Any

import orjson

from appliance.domain.records import (
    CacheEviction,
    CacheTier,
    ResidencyEvent,
    SessionId,
    WorkerId,
)
from appliance.domain.retention import ReturnedKv
from appliance.policy.residency import IdleSession, ResidencyAction, ResidencyDecision
from appliance.services.residency.residency_inputs import LiveInputs, prefix_tokens, retention_key
from appliance.services.residency.tool_waits import UNKNOWN, TurnWait
from appliance.services.sessions.sessions import SessionState

log = logging.getLogger(__name__)
GIVEN_BACK = "given_back"
EVICTED = "evicted"
OPERATOR = "operator"
"""`ended_by` of a session an operator released."""
WORKER_REST = "worker_rest"
"""`ended_by` of a session whose worker the worker reaper put to sleep or stopped."""


class EvictionCause(StrEnum):
    LRU = "lru"
    REAPER_EVICT = "reaper_evict"
    PRESSURE = "pressure"
    CAPPED = "capped"
    EXPIRED = "expired"
    WORKER_LOST = "worker_lost"
    OPERATOR = "operator"
    HOST_LRU = "host_lru"
    WORKER_REST = "worker_rest"


_CAUSE_SAYS = {
    EvictionCause.LRU: "released, then evicted by the engine for room",
    EvictionCause.REAPER_EVICT: "put first to evict by the reaper",
    EvictionCause.PRESSURE: "its hold given back for a request's room, then evicted",
    EvictionCause.CAPPED: "its hold given back under the cap on held blocks, then evicted",
    EvictionCause.EXPIRED: "its hold lapsed before it was decided again, then evicted",
    EvictionCause.WORKER_LOST: "lost while held (the worker restarted or reset its cache)",
    EvictionCause.OPERATOR: "released by an operator, then evicted",
    EvictionCause.HOST_LRU: "demoted to the host tier, then evicted there for room",
    EvictionCause.WORKER_REST: "dropped with its worker, put to sleep or stopped when idle",
}
_RETURN_SAYS = {
    "pressure": "a request needed the room",
    "capped": "a newer hold needed room under the cap on held blocks",
    "expired": "the hold lapsed before it was decided again",
    "not_found": "nothing of its last request was cached when the hold came",
    "reset": "the prefix cache was reset",
}
OWN_DIRECTIVES = frozenset({"released", "evicted", "demoted"})
"""Give-backs the reaper asked for: recorded with its decision, not again."""


def eviction_cause(action: ResidencyAction, ended_by: str | None) -> EvictionCause:
    """Why a waiting session's KV left its worker: `action` the reaper's standing decision,
    `ended_by` what ended its hold otherwise (a worker's give-back reason, or OPERATOR)."""
    if ended_by == OPERATOR:
        return EvictionCause.OPERATOR
    if ended_by in ("pressure", "capped", "expired", WORKER_REST):
        return EvictionCause(ended_by)
    if ended_by == "reset":
        return EvictionCause.WORKER_LOST
    if action is ResidencyAction.EVICT:
        return EvictionCause.REAPER_EVICT
    if action is ResidencyAction.DEMOTE:
        return EvictionCause.HOST_LRU
    if action is ResidencyAction.HOLD and ended_by is None:
        return EvictionCause.WORKER_LOST
    return EvictionCause.LRU


def decision_row(
    idle: IdleSession,
    worker: WorkerId,
    decision: ResidencyDecision,
    now: float,
    priority: float | None = None,
    wait: TurnWait = UNKNOWN,
) -> ResidencyEvent:
    """The decision's row: its reason ends with what the session waits on, in words (the
    tool its answer called, the person, the client's hint), and its figures hold both the
    answer's tools and the header's class (`TurnWait.figures`)."""
    kind = decision.kind.value if decision.kind is not None else None
    reason = f"{kind}: {decision.reason}" if kind else decision.reason
    says = wait.says()
    figures: dict[str, Any] = {
        "kind": kind,
        "until_s": decision.until_s,
        "priority": priority,
        "idle_s": round(now - idle.finished_at_s, 3),
        "kv_usage": round(idle.kv_usage, 4),
        "recompute_s": idle.recompute_s,
        "kv_bytes": idle.kv_bytes,  # the bytes the costs priced: tokens x the model's per token
        "tool_class": idle.tool_class,
        "expected_wait_s": idle.expected_wait_s,
        "turns": idle.turns,
        **wait.figures(),
    }
    if decision.figures is not None:
        figures |= dataclasses.asdict(decision.figures)
    return ResidencyEvent(
        at=now,
        session_id=SessionId(idle.session_id),
        worker=worker,
        action=decision.action.value,
        reason=f"{reason}; {says}" if says else reason,
        tokens=idle.resident_tokens,
        tier=CacheTier.GPU,
        figures_json=orjson.dumps(figures).decode(),
    )


def closed_row(
    idle: IdleSession, worker: WorkerId, why: str, now: float, *, inherited_tokens: int = 0
) -> ResidencyEvent:
    """The session ended without a next turn (its task closed): its own KV goes first, on
    every tier; what it shares with its parent task (`inherited_tokens`) stays."""
    inherited = min(inherited_tokens, idle.resident_tokens)
    return ResidencyEvent(
        at=now,
        session_id=SessionId(idle.session_id),
        worker=worker,
        action=ResidencyAction.EVICT.value,
        reason=f"session_ended: {why}: not coming back",
        tokens=idle.resident_tokens,
        tier=CacheTier.GPU,
        figures_json=orjson.dumps(
            {
                "kind": "session_ended",
                "idle_s": now - idle.finished_at_s,
                "inherited_tokens": inherited,
                "own_tokens": idle.resident_tokens - inherited,
            }
        ).decode(),
    )


def returned_row(returned: ReturnedKv, tokens: int, now: float) -> ResidencyEvent:
    says = _RETURN_SAYS.get(returned.reason, returned.reason)
    return ResidencyEvent(
        at=now,
        session_id=SessionId(returned.key),
        worker=returned.worker,
        action=GIVEN_BACK,
        reason=f"{returned.reason}: given back by its worker: {says}",
        tokens=tokens,
        tier=CacheTier.GPU,
        figures_json=orjson.dumps({"kind": returned.reason, "blocks": returned.blocks}).decode(),
    )


def eviction_records(
    inputs: LiveInputs,
    session: SessionState,
    worker: WorkerId,
    cause: EvictionCause,
    *,
    tokens_left: int,
    now: float,
    tier: CacheTier = CacheTier.GPU,
) -> tuple[ResidencyEvent, CacheEviction | None]:
    """The row saying the session's prefix is no longer whole on the worker's `tier`, and
    the mark on its cache receipt (None: it has no full block, so no receipt)."""
    whole = prefix_tokens(session)
    row = ResidencyEvent(
        at=now,
        session_id=SessionId(retention_key(session)),
        worker=worker,
        action=EVICTED,
        reason=f"{cause}: {_CAUSE_SAYS[cause]}; {tokens_left} of {whole} tokens left",
        tokens=tokens_left,
        tier=tier,
        figures_json=orjson.dumps({"kind": cause.value, "prefix_tokens": whole}).decode(),
    )
    chain = session.chain
    if chain is None or not chain.hashes:
        return row, None
    receipt = CacheEviction(
        prefix_digest=chain.hashes[-1].hex(),
        model=inputs.model,
        runtime_identity=inputs.runtime_identity,
        tenant_domain=session.tenant,
        worker=worker,
        at=now,
        cause=cause.value,
    )
    return row, receipt


def log_refusal(written: Future[None]) -> None:
    """A done-callback of a residency row's write: a refused write is logged."""
    exc = written.exception()
    if exc is not None:
        log.error("ledger refused a residency record: %s", exc)
