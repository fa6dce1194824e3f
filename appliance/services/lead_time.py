"""Restore on lead time, live: a demoted session's KV brought back into HBM when its client
announces that the tool it waits on has finished (`tool_finished`), before its next turn.

Model of the world: the reaper loop demoted the session while its tool ran (its prefix is
in its worker's host tier, not in HBM). The client's `tool_finished` event comes some time
before the session's next turn (its lead). On it, for each waiting session of the task whose
standing decision is DEMOTE, the prefetch policy (`appliance.policy.prefetch`: per-tenant
budgets, paused while the worker has requests waiting, switched off for keys whose leads are
too short or whose restores go unused) is asked; a PROMOTE sends the worker a restore (the
host part copied back to HBM, kept there until the turn is likely past) and is a
`residency_events` row (action `restore`, with its trigger, tokens and bytes). The session's
next turn settles it: used when its worker's HBM then holds at least what was restored (a
`restore_used` row, with the lead), else unused (`restore_unused`); the policy learns both.
A restore whose session never comes back is settled unused at its hold's end.

Live restores only promote (`prefill` off): computing a prefix nothing caches would take a
request of its own, which the replay models (`appliance replay --residency reaper+lead-time`)
and the live appliance does not send yet.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import orjson

from appliance.domain.kv_index import Medium
from appliance.domain.records import ResidencyEvent, SessionId, TaskId, WorkerId
from appliance.policy.prefetch import (
    DEFAULT_HOLD_S,
    PrefetchAction,
    PrefetchAsk,
    PrefetchDecision,
    PrefetchKey,
    PrefetchNeed,
    PrefetchPolicy,
    PrefetchTrigger,
    WorkerLoad,
)
from appliance.policy.residency import ResidencyAction
from appliance.ports import Ledger
from appliance.services import residency_records as rows
from appliance.services.prefix_watch import WaitingSession
from appliance.services.residency_inputs import LiveInputs, resident_tokens
from appliance.services.retention_outbox import RetentionOutbox

log = logging.getLogger(__name__)
RESTORE_HOLD_S = DEFAULT_HOLD_S
"""How long restored KV is kept for its turn (the policy's, as in the replay)."""


@dataclass(slots=True)
class _Restore:
    decision: PrefetchDecision
    worker: WorkerId
    tokens: int
    """HBM tokens the session's prefix should have once restored."""
    signalled_at: float
    until_s: float


class LeadTime:
    def __init__(
        self,
        policy: PrefetchPolicy,
        inputs: LiveInputs,
        outbox: RetentionOutbox,
        *,
        ledger: Ledger,
        waiting: Callable[[], Mapping[str, WaitingSession]],
    ) -> None:
        self.policy = policy
        self._inputs = inputs
        self._outbox = outbox
        self._ledger = ledger
        self._waiting = waiting
        self._restores: dict[str, _Restore] = {}
        self._signals: dict[str, tuple[PrefetchKey, float]] = {}
        """Each waiting session's latest announcement, restored or not: its lead is
        measured at the turn (so a key switched off for short leads can come back on)."""

    def tool_finished(self, task: TaskId, tool_class: str | None, now: float) -> None:
        """The task's client says its tool has finished: its demoted sessions come back."""
        for key, w in list(self._waiting().items()):
            if w.session.task_id != task:
                continue
            signal = PrefetchKey(w.session.tenant, tool_class, PrefetchTrigger.TOOL_FINISHED)
            self._signals[key] = (signal, now)
            if key in self._restores:
                continue
            try:
                self._ask(key, w, signal, now)
            except Exception:  # never into the task route: the event itself is recorded
                log.exception("lead time: no restore for %s", key)

    def turn_began(self, key: str, now: float) -> None:
        """The session's next turn: the announcement's lead is measured, and its restore,
        if any, settled."""
        signal = self._signals.pop(key, None)
        if signal is not None:
            self.policy.observe_lead(signal[0], now - signal[1])
        restore = self._restores.pop(key, None)
        w = self._waiting().get(key)
        if restore is None or w is None:
            return
        on_gpu = resident_tokens(self._inputs.index, w.session, restore.worker)
        self._settle(key, restore, on_gpu >= restore.tokens, now)

    def tick(self, now: float) -> None:
        """Restores whose hold ended without their turn are settled unused (and their
        announcements forgotten)."""
        for key, restore in list(self._restores.items()):
            if restore.until_s <= now:
                del self._restores[key]
                self._signals.pop(key, None)
                self._settle(key, restore, False, now)
        for key, (_, at) in list(self._signals.items()):
            if at + RESTORE_HOLD_S <= now:
                del self._signals[key]

    def _ask(self, key: str, w: WaitingSession, trigger: PrefetchKey, now: float) -> None:
        if w.decision.action is not ResidencyAction.DEMOTE or w.evicted:
            return
        need = self._need(w)
        decision = self.policy.decide(PrefetchAsk(trigger, need, self._load(w.worker)), now)
        if decision.action is not PrefetchAction.PROMOTE:
            log.debug("lead time: %s not restored: %s", key, decision.reason)
            return
        until_s = now + RESTORE_HOLD_S
        self._outbox.restore(w.worker, key, until_s, decision.value)
        tokens = need.gpu_tokens + need.host_tokens
        self._restores[key] = _Restore(decision, w.worker, tokens, now, until_s)
        figures = {"trigger": trigger.trigger.value, "host_tokens": need.host_tokens,
                   "kv_bytes": need.kv_bytes, "copy_s": round(need.copy_s, 6),
                   "until_s": until_s}  # fmt: skip
        self._write(w, "restore", decision.reason, need.host_tokens, now, figures)

    def _need(self, w: WaitingSession) -> PrefetchNeed:
        chain, index = w.session.chain, self._inputs.index
        tokens = len(chain.hashes) * chain.block_size if chain is not None else 0
        gpu = resident_tokens(index, w.session, w.worker)
        host = max(0, resident_tokens(index, w.session, w.worker, Medium.CPU) - gpu)
        nbytes = host * self._inputs.kv_bytes_per_token
        return PrefetchNeed(tokens, gpu, host, nbytes, copy_s=self._inputs.copy_in_s(host))

    def _load(self, worker: WorkerId) -> WorkerLoad:
        endpoint = next((x for x in self._inputs.workers() if x.id == worker), None)
        load = endpoint.load if endpoint is not None else None
        return WorkerLoad(load.waiting, load.running) if load is not None else WorkerLoad(0, 0)

    def _settle(self, key: str, restore: _Restore, used: bool, now: float) -> None:
        self.policy.settle(restore.decision, used=used)
        lead = now - restore.signalled_at
        w = self._waiting().get(key)
        if w is None:
            return
        action = "restore_used" if used else "restore_unused"
        why = (
            f"its next turn came {lead:.2f} s after the announcement"
            if used
            else (
                "its next turn did not find it in HBM" if lead < RESTORE_HOLD_S else "no turn came"
            )
        )
        self._write(w, action, why, restore.tokens, now, {"lead_s": round(lead, 3)})

    def _write(self, w: WaitingSession, action: str, reason: str, tokens: int, now: float,
               figures: dict[str, object]) -> None:  # fmt: skip
        row = ResidencyEvent(now, SessionId(w.idle.session_id), w.worker, action, reason,
                             tokens, figures_json=orjson.dumps(figures).decode())  # fmt: skip
        self._ledger.record_residency_event(row).add_done_callback(rows.log_refusal)
