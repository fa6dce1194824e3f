"""The idle reaper, live: a residency policy (`appliance.policy.residency`: the reaper,
`appliance.policy.reaper`, by default; `residency.policy` names it) run on the appliance's
sessions, its decisions sent to the workers and recorded. The loop drives it through the
protocol, by the residency driver the replay drives it with too (`residency_driver.py`).

Model of the world: a session's turn ends on its worker, and its prompt's KV stays there,
cached, until something needs the room. At every turn's end (`turn_ended`, once a session
has no turn in flight) the loop asks the reaper about the session as the live inputs show
it (`residency_inputs.py`) and sends the decision through the retention port: HOLD until
the reaper's revisit plus `HOLD_GRACE_S` (the revisit's extension arrives first), with the
reaper's priority (value per byte-second: under pressure the lowest goes first); RELEASE
(LRU from here); EVICT (its blocks go first); DEMOTE (where the worker reports a host tier:
copied there, then evicted first on the GPU; its host copy is watched from then on). Each
decision is a `residency_events` row with its reason and figures.

`tick` decides again on each hold as it comes due (the pool as it is then), ends the idle
periods that end without a return (the session's task closed: its KV goes first; past the
maximum residency: the reaper evicts it) and tells the reaper (`observe_abandoned`), re-sends
each worker's priorities every `ORDER_S`, and watches each waiting session's prefix in the
KV index: fewer of its tokens on its worker than were (the worker's `BlockRemoved` events)
means its KV was evicted: recorded with its cause, and its cache receipt marked. The next
turn (`turn_began`) ends its idle period in a return (`observe_return`). Holds the workers
give back on their own (pressure, the cap, a lapse) are recorded.

The driver keeps each waiting session's standing decision (`WaitingSession.standing`), and
the loop tells it how each idle period ends, a session it stops following included (the
oldest, past `MAX_WAITING`: an abandonment, its wait censored there).

Directives go out in order (`retention_outbox.py`); with a retention that controls nothing
(`NoRetention`) none is sent, and decisions are recorded all the same. An operator's
`release` reaches every worker holding the session, which is not held again until its next
turn. A demoted session whose client announces its tool's end is restored (`lead_time.py`).
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

from appliance.domain.records import (
    CacheEviction,
    CacheTier,
    ResidencyEvent,
    TaskId,
    WorkerId,
)
from appliance.domain.retention import ReturnedKv
from appliance.policy.residency import (
    ResidencyAction,
    ResidencyDecision,
    ResidencyKind,
    ResidencyPolicy,
)
from appliance.ports import Clock, KvRetention, Ledger
from appliance.services.residency import residency_records as rows
from appliance.services.residency.branch_kv import BranchEnds
from appliance.services.residency.lead_time import LeadTime
from appliance.services.residency.live_holds import LiveHolds
from appliance.services.residency.prefix_watch import PrefixWatch, WaitingSession
from appliance.services.residency.residency_driver import ResidencyDriver, StandingDecision
from appliance.services.residency.residency_inputs import (
    LiveInputs,
    idle_session,
    kept_blocks,
    measured,
    prefix_tokens,
    resident_tokens,
    retention_key,
)
from appliance.services.residency.retention_outbox import RetentionOutbox
from appliance.services.residency.tool_waits import ToolWaits
from appliance.services.sessions.sessions import SessionState, TurnBegan, TurnEnded, one_turn

log = logging.getLogger(__name__)
TICK_S = 0.5
"""How often holds coming due are decided again (the reaper's shortest revisit: 1 s)."""
HOLD_GRACE_S = 5.0  # a hold outlives its revisit by this much: the revisit's lands first
WATCH_S = 1.0  # how often the waiting sessions' prefixes are looked up in the KV index
ORDER_S = 5.0
"""How often each worker's holds get their priorities now (they fall as waits go on)."""
MAX_WAITING = 100_000
"""Waiting sessions followed (a few hundred bytes each); the oldest is dropped first (an
abandonment)."""
FOLLOW_S = 1800.0
"""Seconds a session is followed idle under a policy with no maximum residency of its own
(`residency.max_residency_s`'s default)."""
OPERATOR_REASON = "released by operator"
LAPSED = "its hold lapsed"


class ReaperLoop:
    def __init__(
        self,
        policy: ResidencyPolicy,
        retention: KvRetention,
        inputs: LiveInputs,
        *,
        ledger: Ledger,
        clock: Clock,
        note: str | None = None,
        defer: Callable[[Callable[[], None]], None] | None = None,
        lead_time: Callable[[ReaperLoop], LeadTime] | None = None,
    ) -> None:
        """`lead_time`: builds the loop's restore on lead time from it (None: none)."""
        self.policy = policy
        self.driver = ResidencyDriver(policy)
        self.max_idle_s = self.driver.max_idle_s or FOLLOW_S
        """How long a waiting session is followed: the policy's maximum residency, if any."""
        self.retention = retention
        self.note = note or "holds are sent to the workers' retention connectors"
        """What the reaper's decisions do (the log, `/admin/v1/state`)."""
        self._inputs = inputs
        self._ledger = ledger
        self.clock = clock
        self.tick_s = TICK_S  # how often `reaper_runner` ticks it
        self._defer = defer or _on_the_next_loop_turn
        self._waiting: OrderedDict[str, WaitingSession] = OrderedDict()
        self._holds = LiveHolds(self.driver, self._waiting)
        self._held = self._holds.on  # key -> the worker last asked to hold it
        self._tooled = ToolWaits(MAX_WAITING)  # what each session waits on, from its answer
        self.outbox = RetentionOutbox(retention)
        self._watched_at = self._ordered_at = -math.inf
        self._prefixes = PrefixWatch(inputs.index)
        self.decisions: Counter[str] = Counter()  # by action since start
        self.branch_ends = BranchEnds()  # what each ended task's sessions reclaimed
        self.lead_time = lead_time(self) if lead_time is not None else None

    # --- the session table's turn events (the loop subscribes when the table is built) ---

    def turn_began(self, event: TurnBegan) -> None:
        """The session's next turn: its idle period ends in a return."""
        key, now = retention_key(event.session), event.at
        if self.lead_time is not None:
            self.lead_time.turn_began(key, now)
        if self._waiting.pop(key, None) is not None:  # the wait model learns after the send
            self._defer(partial(self.driver.returned, key, now))

    def turn_ended(self, event: TurnEnded) -> None:
        """The session has no turn in flight any more: where its KV waits is decided once
        its answer is out (`defer`: the event loop's next turn), unless its next turn has
        begun by then; no answer waits for the decision's few tenths of a millisecond."""
        self._defer(partial(self._decide_ended, event.session, event.at))

    def _decide_ended(self, session: SessionState, now: float) -> None:
        if session.in_flight:
            return
        try:
            self._turn_ended(session, now)
        except Exception:  # never into the turn desk: the turn itself went well
            log.exception("idle reaper: no decision on session %s", session.session_id)

    def _turn_ended(self, session: SessionState, now: float) -> None:
        worker = session.home
        if worker is None or not prefix_tokens(session) or one_turn(session):
            return
        key = retention_key(session)
        wait = self._tooled.wait_of(session, key)
        moved_from = self._held.get(key)
        if moved_from is not None and moved_from != worker:
            self.outbox.release(moved_from, key)
            del self._held[key]
        seen = resident_tokens(self._inputs.index, session, worker)
        # Just computed there, whatever the index has heard so far.
        tokens = max(seen, prefix_tokens(session))
        idle = idle_session(
            self._inputs, self.retention, session, worker, tokens, finished_at_s=now, wait=wait
        )
        idle = self._holds.seen_from(worker, key, idle, now)
        standing = StandingDecision(idle, _NONE)
        waiting = WaitingSession(session, worker, standing, math.inf, seen, wait=wait)
        self._waiting[key] = waiting
        self._waiting.move_to_end(key)
        if len(self._waiting) > MAX_WAITING:
            self._stop_following(*self._waiting.popitem(last=False), now)
        self._decide(key, waiting, now)

    def _stop_following(self, key: str, w: WaitingSession, now: float) -> None:
        """The oldest waiting session, past `MAX_WAITING`: an idle period still open ends
        unreturned for the policy (it waited this long at least)."""
        self._held.pop(key, None)
        self.driver.abandoned(key, now)

    def tool_started(
        self, task: TaskId, tool_class: str | None, expected_s: float | None, now: float
    ) -> None:
        """The task's waiting sessions wait on the tool its client says has started; those
        held or released (not yet moved or dropped) are decided again on it."""
        for key, w in list(self._waiting.items()):
            if w.session.task_id != task or w.due_s == math.inf:
                continue
            w.wait = self._tooled.started(w.session, key, w.wait, tool_class, expected_s)
            w.idle = w.wait.applied_to(w.idle)
            if w.decision.action in (ResidencyAction.HOLD, ResidencyAction.RELEASE):
                self._decide(key, w, now)

    # --- deciding and sending ---------------------------------------------------------

    def _decide(self, key: str, w: WaitingSession, now: float) -> None:
        w.standing = self.driver.decide(w.idle, now)
        decision = w.decision
        priority = None
        if decision.action is ResidencyAction.HOLD:
            assert decision.until_s is not None
            idle = w.idle
            held = self.driver.held(key, idle.resident_tokens, idle.finished_at_s, decision.until_s)
            priority = self.driver.priority(held, now)
            # A revisit's extension lands first; a pin that is not revisited ends on time.
            until_s = decision.until_s + (HOLD_GRACE_S if self.driver.revisits else 0.0)
            self.outbox.hold(w.worker, key, until_s, priority)
            self._held[key] = w.worker
            w.due_s, w.ended_by = decision.until_s, None
        else:
            if decision.action is ResidencyAction.DEMOTE:
                self.outbox.demote(w.worker, key)
                w.seen_tokens, w.evicted = 0, False  # its host copy is watched from here
            elif decision.action is ResidencyAction.EVICT and not w.evicted:
                self.outbox.evict_first(w.worker, key, keep_blocks=self._kept(w)[0])
            elif key in self._held:
                self.outbox.release(w.worker, key)
            self._held.pop(key, None)
            w.due_s = w.idle.finished_at_s + self.max_idle_s
        self.decisions[decision.action.value] += 1
        log.debug("idle reaper: %s %s on %s: %s", decision.action, key, w.worker, decision.reason)
        self._write(rows.decision_row(w.idle, w.worker, decision, now, priority, w.wait))
        if decision.kind is ResidencyKind.MAX_RESIDENCY:
            self._abandoned(key, w, now)

    def _abandoned(self, key: str, w: WaitingSession, now: float) -> None:
        """Ended unreturned: a censored wait; the session is watched until its KV is gone."""
        self.driver.abandoned(key, now)
        w.due_s = math.inf
        if w.evicted:
            del self._waiting[key]

    def _kept(self, w: WaitingSession) -> tuple[int, int]:
        return kept_blocks(self._inputs.task_parent, w, self._waiting.values())

    def _write(self, row: ResidencyEvent) -> None:
        self._ledger.record_residency_event(row).add_done_callback(rows.log_refusal)

    def _mark(self, eviction: CacheEviction) -> None:
        self._ledger.record_cache_eviction(eviction).add_done_callback(rows.log_refusal)

    # --- the periodic tick ------------------------------------------------------------

    def tick(self, now: float) -> None:
        """Closed tasks' sessions end, due holds are decided again, prefixes are watched
        (every `WATCH_S`) and priorities re-sent (every `ORDER_S`)."""
        for key, w in list(self._waiting.items()):
            if (why := w.ended_why(self._inputs.task_closed)) is not None:
                self._session_ended(key, w, why, now)
            elif w.due_s <= now and (w.evicted or w.decision.action is ResidencyAction.EVICT):
                self._expire(key, w, now)
            elif w.due_s <= now:
                self._revisit(key, w, now)
        if now - self._watched_at >= WATCH_S:
            self._watched_at = now
            self._watch(now)
        if now - self._ordered_at >= ORDER_S:
            self._ordered_at = now
            self._send_order(now)
        if self.lead_time is not None:
            self.lead_time.tick(now)

    def _revisit(self, key: str, w: WaitingSession, now: float) -> None:
        if w.decision.action is ResidencyAction.HOLD and not self.driver.revisits:
            self._held.pop(key, None)  # its pin lapsed on the worker: the engine's LRU now
            w.decision = ResidencyDecision(ResidencyAction.RELEASE, LAPSED, kind=w.decision.kind)
            w.due_s = w.idle.finished_at_s + self.max_idle_s
            return
        own_max_idle = self.driver.max_idle_s is not None  # else the loop ends it unasked
        if not own_max_idle and now >= w.idle.finished_at_s + self.max_idle_s:
            if self._held.pop(key, None) is not None:  # followed long enough: unreturned
                self.outbox.release(w.worker, key)
            self._abandoned(key, w, now)
            return
        tokens = w.idle.resident_tokens
        if w.seen_tokens:  # the index has heard of its blocks: it says what is left
            tokens = resident_tokens(self._inputs.index, w.session, w.worker)
        idle = measured(self._inputs, self.retention, w.idle, w.session, w.worker, tokens)
        w.idle = self._holds.seen_from(w.worker, key, idle, now)
        self._decide(key, w, now)

    def _expire(self, key: str, w: WaitingSession, now: float) -> None:
        """A session whose KV is gone (or first to go) ends unreturned at the max residency."""
        end_s = w.idle.finished_at_s + self.max_idle_s
        if now < end_s:
            w.due_s = end_s
        else:
            self._abandoned(key, w, now)

    def _session_ended(self, key: str, w: WaitingSession, why: str, now: float) -> None:
        keep, inherited = self._kept(w)
        if w.kv_left(self.retention.host_tier(w.worker) is not None):  # its own: every tier
            self.outbox.evict_first(w.worker, key, keep_blocks=keep, drop_host=True)
        self._held.pop(key, None)
        w.decision = ResidencyDecision(ResidencyAction.EVICT, f"{why}: not coming back")
        self.decisions[ResidencyAction.EVICT.value] += 1
        block = w.session.chain.block_size if w.session.chain is not None else 0
        shared = min(inherited * block, w.idle.resident_tokens)
        if w.session.task_id is not None:
            self.branch_ends.ended(w.session.task_id, now, w.idle.resident_tokens - shared, shared)
        self._write(rows.closed_row(w.idle, w.worker, why, now, inherited_tokens=shared))
        self._abandoned(key, w, now)

    def _watch(self, now: float) -> None:
        """Records each waiting session whose prefix lost blocks on its worker (on the host
        tier, once demoted)."""
        for key, n in self._prefixes.shrunk(list(self._waiting.items())):
            w = self._waiting[key]
            w.evicted = True
            cause = rows.eviction_cause(w.decision.action, w.ended_by)
            tier = CacheTier.HOST if w.decision.action is ResidencyAction.DEMOTE else CacheTier.GPU
            w.decision = ResidencyDecision(ResidencyAction.EVICT, f"evicted ({cause})")
            self._held.pop(key, None)
            row, mark = rows.eviction_records(
                self._inputs, w.session, w.worker, cause, tokens_left=n, now=now, tier=tier
            )
            self._write(row)
            if mark is not None:
                self._mark(mark)
            if w.due_s == math.inf:
                del self._waiting[key]

    def _send_order(self, now: float) -> None:
        for worker, priorities in self._holds.priorities(now).items():
            if len(priorities) > 1:
                self.outbox.order(worker, priorities)

    # --- what the workers and the operators do ----------------------------------------

    def returned(self, r: ReturnedKv, now: float) -> None:
        """A worker gave a hold back: recorded, unless the reaper asked for it."""
        if r.reason in rows.OWN_DIRECTIVES:
            return
        if self._held.get(r.key) == r.worker:
            del self._held[r.key]
        w = self._waiting.get(r.key)
        block = w.session.chain.block_size if w is not None and w.session.chain else 0
        if w is not None and w.worker == r.worker and w.decision.action is ResidencyAction.HOLD:
            w.ended_by = r.reason
        self._write(rows.returned_row(r, r.blocks * block, now))

    def release(self, session: SessionState) -> list[WorkerId]:
        """An operator's release: every worker holding the session lets it go, and the reaper
        holds it no more until its next turn. Returns those workers."""
        key = retention_key(session)
        holders = {w.id for w in self._inputs.workers() if key in self.retention.retained(w.id)}
        held = self._held.pop(key, None)
        if held is not None:
            holders.add(held)
        for worker in sorted(holders):
            self.outbox.release(worker, key)
        w = self._waiting.get(key)
        if w is not None:
            w.decision = ResidencyDecision(ResidencyAction.RELEASE, OPERATOR_REASON)
            w.ended_by = rows.OPERATOR
            if w.due_s < math.inf:  # no hold again before the maximum residency
                w.due_s = w.idle.finished_at_s + self.max_idle_s
        return sorted(holders)

    def worker_rests(self, worker: WorkerId) -> None:
        """The worker sleeps or stops: the KV of the sessions waiting there goes with it."""
        for key, w in self._waiting.items():
            if w.worker == worker:
                w.ended_by = rows.WORKER_REST
                self._held.pop(key, None)

    def waiting_sessions(self) -> Mapping[str, WaitingSession]:  # by key (read only)
        return self._waiting

    def decision_of(self, session: SessionState) -> ResidencyDecision | None:
        """The reaper's standing decision on a waiting session (None: in flight, or none)."""
        w = self._waiting.get(retention_key(session))
        return w.decision if w is not None and w.decision is not _NONE else None

    def status(self) -> dict[str, Any]:  # the loop at a glance (the state's "residency")
        return {
            "reaper": True,
            "policy": self.policy.name,
            "retention": self.retention.controls,
            "note": self.note,
            "waiting": len(self._waiting),
            "held": len(self._held),
            "decisions": dict(self.decisions),
            "unsent": self.outbox.unsent,
        }


_NONE = ResidencyDecision(ResidencyAction.RELEASE, "not decided yet")


def _on_the_next_loop_turn(call: Callable[[], None]) -> None:
    asyncio.get_running_loop().call_soon(call)
