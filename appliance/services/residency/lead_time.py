"""Restore on lead time, live: a demoted session's KV brought back into HBM before its next
turn, when its client announces that the tool it waits on has finished (`tool_finished`),
or when the wait model says the turn is likely (restore ahead of the predicted return).

Model of the world: the reaper loop demoted the session while its tool ran (its prefix is in
its worker's host tier, not in HBM), or the worker gave its hold back. Two signals come some
time before the session's next turn (their lead): the client's `tool_finished` event, and
the wait model's due times (`return_due.RESTORE_AHEAD`, asked of the reaper's survival model
of waits, learned per tenant, tool class and depth, with the client's expected wait as
`TOOL_DUE` and without it as `HAZARD`): a timer at the first idle time from which the turn
is likely (0.6) within the next 5 s, set when the session starts waiting (`tick` finds it),
asked again a recheck later while nothing was restored and the turn stays that likely, and
dropped when the turn arrives (`residency.restore_ahead`: off by default, when the policy's
triggers are the announcements only). On a signal, for each waiting session it concerns that
the reaper has not given up on (its standing decision is not EVICT), the prefetch policy
(`appliance.policy.prefetch`: resident prefixes skipped, per-tenant budgets, paused while
the worker has requests waiting, switched off for keys whose leads are too short or whose
restores go unused) is asked with what the KV index shows of the prefix on its worker, in
HBM and on the host tier; a PROMOTE sends the worker a restore (the host part copied back to
HBM, kept there until the turn is likely past) and is a `residency_events` row (action
`restore`, with its trigger, tokens and bytes). The agent-session replay runs the same
policy and due times (`appliance.replay.sessions.session_replay`, stack `appliance-restore`). The
session's next turn settles it: used when its worker's HBM then holds at least what was
restored (a `restore_used` row, with the lead), else unused (`restore_unused`); the policy
learns both. A restore whose session never comes back is settled unused at its hold's end.

Live restores only promote (`prefill` off): computing a prefix nothing caches would take a
request of its own, which the replay models (`appliance replay --residency reaper+lead-time`)
and the live appliance does not send yet.
"""

from __future__ import annotations

import heapq
import logging
import math
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
from appliance.policy.return_due import RESTORE_AHEAD, DueRule, ReturnModel, signal_due_s
from appliance.ports import Ledger
from appliance.services.residency import residency_records as rows
from appliance.services.residency.prefix_watch import WaitingSession
from appliance.services.residency.residency_inputs import LiveInputs, resident_tokens
from appliance.services.residency.retention_outbox import RetentionOutbox

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
        survival: ReturnModel | None = None,
        horizon_s: float = 1800.0,
        due: DueRule = RESTORE_AHEAD,
    ) -> None:
        self.policy = policy
        self._inputs = inputs
        self._outbox = outbox
        self._ledger = ledger
        self._waiting = waiting
        self.survival = survival
        """The reaper's wait model (None: announcements only)."""
        self.horizon_s = horizon_s
        self._rule = due
        self._restores: dict[str, _Restore] = {}
        self._signals: dict[tuple[str, PrefetchTrigger], tuple[PrefetchKey, float]] = {}
        """Each waiting session's signal of each trigger (the latest announcement, the
        first due time), restored or not: its lead is measured at the turn (so a key
        switched off for short leads can come back on)."""
        self._timed: dict[str, float] = {}
        """Waiting session -> the idle period (its start) whose due times are set."""
        self._due: list[tuple[float, str, float, PrefetchTrigger]] = []
        """(due at, session, idle period, trigger): the wait model's timers, a heap."""

    def tool_finished(self, task: TaskId, tool_class: str | None, now: float) -> None:
        """The task's client says its tool has finished: its demoted sessions come back."""
        for key, w in list(self._waiting().items()):
            if w.session.task_id != task:
                continue
            signal = PrefetchKey(w.session.tenant, tool_class, PrefetchTrigger.TOOL_FINISHED)
            self._signals[(key, signal.trigger)] = (signal, now)
            self._signal(key, w, signal, now)

    def _signal(self, key: str, w: WaitingSession, signal: PrefetchKey, now: float) -> None:
        """A signal that the session's turn is near: the policy is asked, unless a restore
        of this idle period is out already."""
        if key in self._restores:
            return
        try:
            self._ask(key, w, signal, now)
        except Exception:  # never into the caller: the turn, the event, the tick
            log.exception("lead time: no restore for %s", key)

    def turn_began(self, key: str, now: float) -> None:
        """The session's next turn: its signals' leads are measured, its timers dropped,
        and its restore, if any, settled."""
        self._timed.pop(key, None)  # its timers are dropped as they come due
        for trigger in PrefetchTrigger:
            signal = self._signals.pop((key, trigger), None)
            if signal is not None:
                self.policy.observe_lead(signal[0], now - signal[1])
        restore = self._restores.pop(key, None)
        w = self._waiting().get(key)
        if restore is None or w is None:
            return
        on_gpu = resident_tokens(self._inputs.index, w.session, restore.worker)
        self._settle(key, restore, on_gpu >= restore.tokens, now)

    def tick(self, now: float) -> None:
        """The wait model's timers that are due fire (those of sessions just begun waiting
        are set first); restores whose hold ended without their turn are settled unused
        (and their signals forgotten)."""
        self._time_waits()
        self._fire_due(now)
        for key, restore in list(self._restores.items()):
            if restore.until_s <= now:
                del self._restores[key]
                for trigger in PrefetchTrigger:
                    self._signals.pop((key, trigger), None)
                self._settle(key, restore, False, now)
        for signal, (_, at) in list(self._signals.items()):
            if at + RESTORE_HOLD_S <= now:
                del self._signals[signal]

    # --- the wait model's timers ---

    def _time_waits(self) -> None:
        """Each session that began waiting since the last tick gets its due times."""
        if self.survival is None or not self.policy.tuning.triggers & _TIMED:
            return
        timed: dict[str, float] = {}
        for key, w in self._waiting().items():
            period = timed[key] = w.idle.finished_at_s
            if self._timed.get(key) == period or not w.idle.ends_in_tool_call:
                continue  # timed already, or not coming back (or not known to)
            for trigger in (PrefetchTrigger.HAZARD, PrefetchTrigger.TOOL_DUE):
                idle_s = self._due_s(w, trigger, None)
                if idle_s is not None:
                    heapq.heappush(self._due, (period + idle_s, key, period, trigger))
        self._timed = timed

    def _fire_due(self, now: float) -> None:
        """Due timers fire; one that restored nothing is set again while the turn stays
        likely (`DueRule.next_s`); one whose session is back (or gone) is dropped."""
        while self._due and self._due[0][0] <= now:
            _, key, period, trigger = heapq.heappop(self._due)
            w = self._waiting().get(key)
            if w is None or w.idle.finished_at_s != period or self._timed.get(key) != period:
                continue
            signal = PrefetchKey(w.session.tenant, w.idle.tool_class, trigger)
            self._signals.setdefault((key, trigger), (signal, now))
            self._signal(key, w, signal, now)
            again = None if key in self._restores else self._due_s(w, trigger, now - period)
            if again is not None:
                heapq.heappush(self._due, (period + again, key, period, trigger))

    def _due_s(
        self, w: WaitingSession, trigger: PrefetchTrigger, after_s: float | None
    ) -> float | None:
        """When the wait model's `trigger` is due (`signal_due_s`), if the policy uses it."""
        if self.survival is None or trigger not in self.policy.tuning.triggers:
            return None
        model, horizon_s = self.survival, self.horizon_s
        return signal_due_s(
            self._rule, model, w.idle, trigger, horizon_s=horizon_s, after_s=after_s
        )

    # --- asking the policy ---

    def _ask(self, key: str, w: WaitingSession, trigger: PrefetchKey, now: float) -> None:
        if not _restorable(w):
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
        figures = {
            "trigger": trigger.trigger.value,
            "host_tokens": need.host_tokens,
            "kv_bytes": need.kv_bytes,
            "copy_s": round(need.copy_s, 6),
            "until_s": until_s,
        }
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

    def _write(
        self,
        w: WaitingSession,
        action: str,
        reason: str,
        tokens: int,
        now: float,
        figures: dict[str, object],
    ) -> None:
        row = ResidencyEvent(
            now,
            SessionId(w.idle.session_id),
            w.worker,
            action,
            reason,
            tokens,
            figures_json=orjson.dumps(figures).decode(),
        )
        self._ledger.record_residency_event(row).add_done_callback(rows.log_refusal)


_TIMED = frozenset({PrefetchTrigger.HAZARD, PrefetchTrigger.TOOL_DUE})
"""The signals the wait model times."""
_GIVEN_BACK = frozenset({"pressure", "capped", "expired"})
"""A worker's reasons for giving a hold back (`ReturnedKv.reason`): not the reaper's."""


def _restorable(w: WaitingSession) -> bool:
    """Whether a waiting session may be restored: not ended unreturned, not released by an
    operator or with its worker, and not judged gone by the reaper (an EVICT; one recorded
    because a worker gave its hold back still may: its copy may be on the host tier). What
    of its prefix is where is the policy's to weigh (`PrefetchNeed`)."""
    if w.due_s == math.inf:
        return False
    if w.ended_by in _GIVEN_BACK:
        return True
    return w.ended_by is None and w.decision.action is not ResidencyAction.EVICT
