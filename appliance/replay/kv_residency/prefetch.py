"""Restore on lead time in the replay: the signals of `appliance.policy.prefetch` raised from
the closed loop and the wait model, the policy asked, the engines' prefetch lanes driven,
and every prefetch written down with whether its turn used it.

Model of the world:
- At a turn's end (`turn_ended`, through the residency adapter) the session's stable prefix
  (that turn's prompt) is kept, and the wait model (the reaper's) is asked from when on the
  next turn is likely (`due`, a `DueRule`): with the client's expected duration
  (`TOOL_DUE`, the hint, weighed by the trust its record earned) and from history alone
  (`HAZARD`). Each answer is a timer, handed to the replay when the turn's record finishes
  (`on_finish`). A rule with a `recheck_s` asks again when a signal started nothing (the
  prefix in HBM still, say): a timer at the next likely time, while there is one.
- A `tool_finished` announcement comes from the closed loop (`tool_finished`).
- On a signal, the worker is the one the router would place the turn on (`predict`), whose
  prefetch lane says how much of the prefix is in HBM and, past that, on its host tier;
  the policy decides with the worker's load; a PROMOTE or PREFILL starts there. One
  prefetch per idle period. A prefix whose last block is still in HBM on the worker the
  session last ran on is taken as resident there without asking the router (the router
  places a turn where its prefix is; a prefix loses its tail first).
- At the session's next arrival each of its signals' lead (arrival - signal) goes to the
  policy; at the turn's first token the prefetch is settled: used when the turn ran on
  the prefetch's worker and found more of its prompt in HBM than was there before. A
  prefetch whose turn never came is settled unused when its hold is over.

Figures (`summary`): prefetches by trigger and action, accuracy (share used), bytes and
prefill seconds restored and how much of each went unused, TTFT saved on used ones (the
copy seconds done before the turn came, or the prefill seconds of the tokens it found
computed), and the signals skipped, by kind (`lead_too_short` and `low_accuracy`: the
optimisation switched off).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from appliance.domain.block_hash import BlockHash
from appliance.perf.latency import CopyDirection, LatencyModel
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
from appliance.policy.residency import IdleSession
from appliance.policy.return_due import ONCE, DueRule, ReturnModel, signal_due_s
from appliance.replay.kv_residency.residency import TurnHint
from appliance.sim.core.engine import SimEngine
from appliance.sim.engine_io import RequestOutput, SimRequest, StepResult
from appliance.sim.kv.prefetch_lane import PrefetchDone, PrefetchStart
from appliance.sim.kv.residency_hook import TurnEnd
from appliance.sim.runtime.engine_views import EngineView, engine_views
from appliance.sim.runtime.virtual import RequestRecord, Timer

Predict = Callable[[SimRequest, Sequence[EngineView], Sequence[BlockHash]], int | None]
"""(the session's stable prefix, the engines, its block hashes) -> the worker its next turn
would go to."""


@dataclass(frozen=True, slots=True)
class TurnUse:
    """What the prefetch's next turn found."""

    turn_s: float
    worker: int | None
    """Where the turn ran (None: not known yet)."""
    used_tokens: int
    """Tokens of its prompt in HBM thanks to the prefetch."""
    saved_s: float


@dataclass(slots=True)
class PrefetchRow:
    """One prefetch: its signal, what it did, and whether its turn used it."""

    session_id: str
    key: PrefetchKey
    action: PrefetchAction
    worker: int
    at_s: float
    start: PrefetchStart
    done: PrefetchDone | None = None
    use: TurnUse | None = None

    def to_json(self) -> dict[str, object]:
        done, use = self.done, self.use
        return {
            "session": self.session_id,
            "tool_class": self.key.tool_class,
            "trigger": self.key.trigger.value,
            "action": self.action.value,
            "worker": self.worker,
            "at_s": round(self.at_s, 4),
            "restored_tokens": done.restored_tokens if done else 0,
            "prefill_s": round(done.prefill_s, 4) if done else 0.0,
            "end": done.end if done else None,
            "lead_s": round(use.turn_s - self.at_s, 4) if use else None,
            "turn_worker": use.worker if use else None,
            "used": bool(use and use.used_tokens),
            "saved_s": round(use.saved_s, 4) if use else 0.0,
        }


@dataclass(slots=True)
class _Idle:
    req: SimRequest
    session: IdleSession
    signals: list[tuple[PrefetchTrigger, float]] = field(default_factory=list)
    row: int | None = None
    hashes: list[BlockHash] | None = None
    """Its prompt's block hashes, once a signal needed them."""
    worker: int | None = None
    """Where its last turn ran."""


class PrefetchDriver:
    """The replay's side of restore on lead time; see the module. `bind` it to the engines
    and the router once they exist."""

    def __init__(
        self,
        policy: PrefetchPolicy,
        *,
        latency: LatencyModel,
        survival: ReturnModel | None = None,
        horizon_s: float = 1800.0,
        due: DueRule = ONCE,
    ) -> None:
        self.policy = policy
        self.latency = latency
        self.survival = survival
        self.horizon_s = horizon_s
        self.due = due
        self.rows: list[PrefetchRow] = []
        self.skipped: Counter[str] = Counter()
        """Signals not acted on, by kind."""
        self.engines: Sequence[SimEngine] = ()
        self._predict: Predict | None = None
        self._idle: dict[str, _Idle] = {}
        self._timers: dict[str, tuple[str, list[tuple[PrefetchTrigger, float]]]] = {}
        """Request id -> (its session, the signals due after it)."""
        self._decisions: dict[int, PrefetchDecision] = {}  # row -> decision, until settled
        self._awaiting: dict[str, int] = {}  # next request id -> row
        self._running: dict[str, int] = {}  # session -> row whose prefetch has not ended

    def bind(self, engines: Sequence[SimEngine], predict: Predict) -> None:
        self.engines, self._predict = engines, predict

    # --- the residency adapter's watch ---

    def turn_ended(self, end: TurnEnd, hint: TurnHint | None, session: IdleSession) -> None:
        req = end.request
        sid = session.session_id
        idle = self._idle[sid] = _Idle(req, session)
        if hint is None or not hint.ends_in_tool_call:
            return
        due: list[tuple[PrefetchTrigger, float]] = []
        for trigger in (PrefetchTrigger.HAZARD, PrefetchTrigger.TOOL_DUE):
            idle_s = self._due_s(idle, trigger)
            if idle_s is not None:
                due.append((trigger, end.now_s + idle_s))
        if due:
            self._timers[req.request_id] = (sid, due)

    def _due_s(
        self, idle: _Idle, trigger: PrefetchTrigger, after_s: float | None = None
    ) -> float | None:
        """When the wait model's `trigger` is due (`signal_due_s`), if the policy uses it."""
        if self.survival is None or trigger not in self.policy.tuning.triggers:
            return None
        model, session, horizon_s = self.survival, idle.session, self.horizon_s
        return signal_due_s(self.due, model, session, trigger, horizon_s=horizon_s, after_s=after_s)

    def held_value(self, session_id: str) -> float | None:
        """The value a waiting session's prefetch was decided at (None: none this wait)."""
        idle = self._idle.get(session_id)
        if idle is None or idle.row is None:
            return None
        decision = self._decisions.get(idle.row)
        return decision.value if decision is not None else None

    def turn_arrived(self, req: SimRequest, now: float) -> None:
        sid = req.session_id or req.request_id
        idle = self._idle.pop(sid, None)
        if idle is None:
            return
        for trigger, at_s in idle.signals:
            self.policy.observe_lead(self._key(idle, trigger), now - at_s)
        if idle.row is not None:
            self._awaiting[req.request_id] = idle.row
            row = self.rows[idle.row]
            row.use = TurnUse(now, None, 0, 0.0)

    # --- the replay's hooks ---

    def on_finish(self, rec: RequestRecord) -> list[Timer]:
        """The signals the wait model scheduled at this turn's end, as timers."""
        sid, due = self._timers.pop(rec.request_id, ("", []))
        idle = self._idle.get(sid)
        if idle is None:
            return []
        idle.worker = rec.worker
        finish = rec.finish_s if rec.finish_s is not None else rec.arrival_s
        period = idle.session.finished_at_s
        return [
            Timer(max(at_s, finish), self._signal_at(sid, trigger, period)) for trigger, at_s in due
        ]

    def tool_finished(self, session_id: str, now: float) -> list[Timer]:
        self.signal(session_id, PrefetchTrigger.TOOL_FINISHED, now)
        return []

    def on_step(self, i: int, now: float, result: StepResult) -> None:
        """Lanes' finished prefetches join their rows; first tokens settle them."""
        if self._running:  # else no prefetch is in flight anywhere
            for done in self.engines[i].prefetches.take_done():
                index = self._running.pop(done.session_id, None)
                if index is not None:
                    self.rows[index].done = done
        if self._awaiting:
            for out in result.outputs:
                if out.first_token and out.request_id in self._awaiting:
                    self._settle_turn(self._awaiting.pop(out.request_id), i, out)
        if self._decisions:
            self._sweep(now)

    # --- signals ---

    def signal(self, session_id: str, trigger: PrefetchTrigger, now: float) -> None:
        """A signal that the session's turn is near: ask the policy, start what it says."""
        idle = self._idle.get(session_id)
        if idle is None or self._predict is None:
            return  # back already, or not bound
        if all(t is not trigger for t, _ in idle.signals):  # a recheck's lead is not its own
            idle.signals.append((trigger, now))
        key = self._key(idle, trigger)
        gated = self.policy.gate(key)
        if gated is not None:
            self.skipped[gated.kind.value] += 1
            return
        if idle.hashes is None:
            idle.hashes = self.engines[0].prefetches.block_hashes(idle.req)
        w = home = self._resident_on(idle, idle.hashes)
        if w is None:
            w = self._predict(idle.req, engine_views(self.engines), idle.hashes)
        if w is None:
            self.skipped["no_worker"] += 1
            return
        engine = self.engines[w]
        ask = PrefetchAsk(
            key,
            self._need(engine, idle.req, idle.hashes, resident=home is not None),
            _load(engine) if home is None else _UNREAD,  # a prefix in HBM: load not read
            in_flight=idle.row is not None or engine.prefetches.in_flight(session_id),
        )
        decision = self.policy.choose(ask, now)
        if decision.action is PrefetchAction.SKIP:
            self.skipped[decision.kind.value] += 1
            return
        prefill = decision.action is PrefetchAction.PREFILL
        start = engine.prefetches.start(idle.req, now, prefill=prefill, hold_s=DEFAULT_HOLD_S)
        if start is None:
            self.policy.refund(decision, now)
            self.skipped["no_room"] += 1
            return
        idle.row = self._running[session_id] = len(self.rows)
        self._decisions[idle.row] = decision
        self.rows.append(PrefetchRow(session_id, decision.key, decision.action, w, now, start))

    def _signal_at(
        self, session_id: str, trigger: PrefetchTrigger, period: float
    ) -> Callable[[float], list[Timer]]:
        """A scheduled signal, for this idle period only (`period`: when it began); set
        again while nothing started and the rule rechecks."""

        def fire(now: float) -> list[Timer]:
            idle = self._idle.get(session_id)
            if idle is None or idle.session.finished_at_s != period:
                return []
            self.signal(session_id, trigger, now)
            if idle.row is not None:
                return []  # one prefetch per idle period
            again = self._due_s(idle, trigger, after_s=now - period)
            return [] if again is None else [Timer(period + again, fire)]

        return fire

    def _resident_on(self, idle: _Idle, hashes: list[BlockHash]) -> int | None:
        """The worker the session last ran on, when its prefix's last block is in HBM
        there (see the module), else None."""
        w = idle.worker
        if w is None:
            return None
        lane = self.engines[w].prefetches
        n = len(idle.req.prompt_token_ids) // lane.hasher.block_size
        if n == 0 or n > len(hashes) or lane.cache.pool.get_cached_block(hashes[n - 1]) is None:
            return None
        return w

    def _need(
        self, engine: SimEngine, req: SimRequest, hashes: list[BlockHash], *, resident: bool
    ) -> PrefetchNeed:
        """What restoring the prefix on `engine` takes (`resident`: all in HBM there)."""
        bs = engine.block_size
        tokens = len(req.prompt_token_ids) // bs * bs
        if resident:
            return PrefetchNeed(tokens, tokens, 0, 0)
        gpu, host = engine.prefetches.probe(req, hashes)
        missing = max(0, tokens - gpu)
        return PrefetchNeed(
            tokens,
            gpu,
            host,
            self.latency.kv_bytes(host or missing),
            copy_s=self.latency.kv_copy_s(host, CopyDirection.H2D) if host else 0.0,
            prefill_s=self.latency.prefill_s(missing, gpu) if missing else 0.0,
        )

    @staticmethod
    def _key(idle: _Idle, trigger: PrefetchTrigger) -> PrefetchKey:
        return PrefetchKey(idle.session.tenant, idle.session.tool_class, trigger)

    # --- settling ---

    def _settle_turn(self, index: int, worker: int, out: RequestOutput) -> None:
        row = self.rows[index]
        gpu_hit = out.num_cached_tokens - out.num_host_cached_tokens
        restored = row.done.restored_tokens if row.done is not None else 0
        used = 0
        if worker == row.worker:
            used = max(0, min(gpu_hit, row.start.gpu_tokens + restored) - row.start.gpu_tokens)
        turn_s = row.use.turn_s if row.use is not None else row.at_s
        saved = 0.0
        if used and row.action is PrefetchAction.PROMOTE and row.done is not None:
            saved = min(row.done.copy_s, max(0.0, turn_s - row.at_s))
        elif used:
            saved = self.latency.prefill_s(used, row.start.gpu_tokens)
        row.use = TurnUse(turn_s, worker, used, saved)
        decision = self._decisions.pop(index, None)
        if decision is not None:  # else settled unused already: the turn came too late
            self.policy.settle(decision, used=used > 0)

    def _sweep(self, now: float) -> None:
        """Settle, unused, the prefetches whose turn has not come within their hold."""
        for index in list(self._decisions):
            row = self.rows[index]
            if row.use is None and now > row.at_s + DEFAULT_HOLD_S + _GRACE_S:
                self.policy.settle(self._decisions.pop(index), used=False)

    def finish(self) -> None:
        """The replay is over: what is still open was not used."""
        for index in list(self._decisions):
            self.policy.settle(self._decisions.pop(index), used=False)

    def summary(self) -> dict[str, object]:
        """The figures of the module's docstring, and every prefetch as a row."""
        rows = self.rows
        used = [r for r in rows if r.use is not None and r.use.used_tokens]
        unused = [r for r in rows if r.use is None or not r.use.used_tokens]
        done = [r.done for r in rows if r.done is not None]
        restored = self.latency.kv_bytes(sum(d.restored_tokens for d in done))
        wasted = self.latency.kv_bytes(sum(r.done.restored_tokens for r in unused if r.done))
        by_trigger: dict[str, dict[str, int]] = {}
        for r in rows:
            counts = by_trigger.setdefault(r.key.trigger.value, Counter())
            counts[r.action.value] += 1
            counts["used"] += int(r in used)
        return {
            "prefetches": len(rows),
            "used": len(used),
            "accuracy": round(len(used) / len(rows), 4) if rows else None,
            "restored_bytes": restored,
            "unused_bytes": wasted,
            "unused_bytes_share": round(wasted / restored, 4) if restored else None,
            "prefill_s": round(sum(d.prefill_s for d in done), 4),
            "unused_prefill_s": round(sum(r.done.prefill_s for r in unused if r.done), 4),
            "copy_s": round(sum(d.copy_s for d in done), 4),
            "ttft_saved_s": round(sum(r.use.saved_s for r in used if r.use), 4),
            "by_trigger": {k: dict(v) for k, v in sorted(by_trigger.items())},
            "skipped": dict(self.skipped.most_common()),
            "rows": [r.to_json() for r in rows],
        }


_GRACE_S = 60.0
"""A prefetch still unsettled this long after its hold is over has lost its turn."""


_UNREAD = WorkerLoad(0, 0)


def _load(engine: SimEngine) -> WorkerLoad:
    s = engine.stats
    return WorkerLoad(s.num_waiting, s.num_running)
