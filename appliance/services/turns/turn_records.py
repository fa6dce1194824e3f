"""The records a model turn leaves: one `route_decisions` row per placement, one `turns` row
per attempt (the worker's own token counts, predicted beside actual cached tokens), a cache
receipt for the prefix a successful attempt left cached (with its worker's cache generation
at placement), and the appliance's own counters behind `/metrics`.

An attempt's rows are submitted as it ends, and the forwarder answers the client only once
its turn row is committed (`ended` returns that write): an answer a client has is one a
SIGKILL cannot take from the ledger. The writer batches commits, so under load one commit
acknowledges many turns. An attempt's rows (its route decision, its turn, the receipt, its
session's row) go to the ledger together when the attempt ends, so they share one
transaction: written apart, the decision (sent as the request left) cost a commit of its
own, and the ledger's thread then used about as much CPU per turn as the whole http-relay. A
row the ledger refuses is logged.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import orjson

from appliance.domain.records import (
    CacheReceipt,
    CacheTier,
    RouteDecisionRecord,
    SessionId,
    SessionRecord,
    TurnId,
    TurnOutcome,
    TurnRecord,
)
from appliance.policy.routing import RouteDecision, RouteKind
from appliance.ports import Ledger
from appliance.services.operator.histogram import PromHistogram
from appliance.services.turns.turn import Attempt, TurnRequest, cached_tokens, reasoning_tokens
from appliance.services.workers.gpu_meter import GpuMeter

log = logging.getLogger(__name__)
FORWARD_BUCKETS_S = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
"""Upper bounds (seconds) of `appliance_forward_seconds`, the router's own time per turn."""


class TurnRecords:
    def __init__(
        self,
        ledger: Ledger,
        *,
        model: str,
        runtime_identity: str = "",
        on_turn: Callable[[TurnRecord, Future[float | None]], None] | None = None,
        meter: GpuMeter | None = None,
    ) -> None:
        self._ledger = ledger
        self.meter = meter
        """Divides each worker's busy GPU-seconds among its attempts (None: none counted)."""
        self._model = model
        self._runtime = runtime_identity
        self._on_turn = on_turn
        self.routed_by_reason: dict[RouteKind, int] = {}
        """Turns placed, by the kind of the policy's reason (a fixed set)."""
        self.predicted_cached_total = 0
        self.actual_cached_total = 0
        self.first_byte_s_total = 0.0
        self.forward_s = PromHistogram(FORWARD_BUCKETS_S)
        """The router's own time per turn, from the whole request to its forwarding."""
        self._decisions: dict[TurnId, RouteDecision] = {}
        """Each attempt in flight's placement, written with its turn row."""

    def ledger_failing(self) -> str | None:
        """Why the ledger cannot write now, if it cannot."""
        return self._ledger.failing

    def placed(self, attempt: Attempt, decision: RouteDecision, prompt_tokens: int) -> None:
        if self.meter is not None:
            self.meter.began(attempt, prompt_tokens)
        self.routed_by_reason[decision.kind] = self.routed_by_reason.get(decision.kind, 0) + 1
        self._decisions[attempt.turn_id] = decision  # written when the attempt ends

    def ended(
        self,
        turn: TurnRequest,
        attempt: Attempt,
        outcome: TurnOutcome,
        error: str | None,
        end: float,
    ) -> Future[float | None]:
        """Records the attempt; the turn row's write (resolves once committed)."""
        if self.meter is not None:
            attempt.gpu_s = self.meter.ended(attempt)
        return self._record_turn(turn, attempt, outcome, error, end)

    def outside(self, record: TurnRecord) -> Future[float | None]:
        """Records an attempt at an outside endpoint (services/escalation/relay.py): its turn
        row alone (no worker: no route decision, cache receipt or session worker)."""
        written = self._ledger.record_turn(record)
        _log_failure(written, f"turn {record.turn_id}")
        if self._on_turn is not None:
            self._on_turn(record, written)
        return written

    def _record_decision(self, attempt: Attempt) -> None:
        decision = self._decisions.pop(attempt.turn_id, None)
        if decision is None:
            return
        record = RouteDecisionRecord(
            attempt.turn_id,
            attempt.started_at,
            attempt.worker,
            f"{decision.kind}: {decision.reason}",
            _candidates_json(decision),
        )
        _log_failure(self._ledger.record_route_decision(record), "route decision")

    def _record_turn(
        self,
        turn: TurnRequest,
        attempt: Attempt,
        outcome: TurnOutcome,
        error: str | None,
        end: float,
    ) -> Future[float | None]:
        self._record_decision(attempt)
        usage = attempt.usage
        prompt = int(usage.get("prompt_tokens") or turn.prompt_len)
        cached = min(cached_tokens(usage) or 0, prompt)
        output = int(usage.get("completion_tokens") or 0)  # reasoning tokens included
        record = TurnRecord(
            turn_id=attempt.turn_id,
            tenant=turn.tenant,
            task_id=turn.task_id,
            session_id=turn.session_id,
            worker=attempt.worker,
            model=self._model,
            prompt_tokens=prompt,
            cached_tokens=cached,
            output_tokens=output,
            reasoning_tokens=min(reasoning_tokens(usage), output),
            outcome=outcome,
            started_at=attempt.started_at,
            finished_at=max(end, attempt.started_at),
            parent_task_id=turn.parent_task_id,
            ttft_s=(attempt.first_byte_at - attempt.started_at) if attempt.first_byte_at else None,
            e2e_s=max(0.0, end - attempt.started_at),
            queue_s=attempt.queue_s,
            gpu_s=attempt.gpu_s,
            predicted_cached_tokens=attempt.predicted_cached,
            error=error,
            route_reason=turn.side_reason,
        )
        written = self._ledger.record_turn(record)
        _log_failure(written, f"turn {record.turn_id}")
        if self._on_turn is not None:
            self._on_turn(record, written)
        if outcome == TurnOutcome.OK and attempt.prefix_digest is not None:
            receipt = self._receipt(turn, attempt, attempt.prefix_digest, end)
            _log_failure(self._ledger.record_cache_receipt(receipt), "cache receipt")
        session = _session_record(turn, attempt, outcome, end)
        if session is not None:
            _log_failure(self._ledger.record_session(session), "session")
        self.predicted_cached_total += attempt.predicted_cached
        self.actual_cached_total += cached
        if record.ttft_s is not None:
            self.first_byte_s_total += record.ttft_s
        return written

    def _receipt(
        self, turn: TurnRequest, attempt: Attempt, digest: str, end: float
    ) -> CacheReceipt:
        """The GPU-tier receipt of the prefix a successful attempt left on its worker."""
        return CacheReceipt(
            prefix_digest=digest,
            token_count=attempt.prefix_tokens,
            model=self._model,
            runtime_identity=self._runtime,
            tenant_domain=turn.tenant,
            worker=attempt.worker,
            tier=CacheTier.GPU,
            created_at=end,
            last_used_at=end,
            generation=attempt.generation,
        )


def _session_record(
    turn: TurnRequest, attempt: Attempt, outcome: TurnOutcome, end: float
) -> SessionRecord | None:
    """The session's row (tenant/id), so a restarted appliance knows where it ran last; none
    for a task of one turn (`turn-...`: nothing comes back to it)."""
    sid = turn.session_id or f"task:{turn.task_id}"
    if turn.session_id is None and turn.task_id.split("/", 1)[-1].startswith("turn-"):
        return None
    return SessionRecord(
        SessionId(f"{turn.tenant}/{sid}"),
        turn.tenant,
        attempt.started_at,
        task_id=turn.task_id,
        worker=attempt.worker if outcome == TurnOutcome.OK else None,
        last_active_at=end,
    )


def _log_failure(fut: Future[Any], what: str) -> None:
    def check(f: Future[Any]) -> None:
        if f.exception() is not None:
            log.error("ledger refused %s: %s", what, f.exception())

    fut.add_done_callback(check)


def _candidates_json(decision: RouteDecision) -> str:
    return orjson.dumps(
        [
            {
                "worker": c.worker,
                "score": round(c.score, 6),
                "scores": {k: round(v, 6) for k, v in c.scores.items()},
                "resident_tokens": c.resident_tokens,
                "ttft_estimate_s": round(c.ttft_estimate_s, 6),
            }
            for c in decision.candidates
        ]
        + [{"worker": w, "excluded_by": f} for w, f in decision.excluded.items()]
    ).decode()
