"""The turn desk: one model turn's order, from the API's hand-over to its last record.

    find the session (named, else by its prefix: session_finder.py)  ->  tokenise, or not
    yet  ->  its side (an outside endpoint skips place and admit: services/escalation/)  ->
    place  ->  admit (on the worker placed; a refusal may spill over outside)  ->  open the
    task  ->  its share of the deadline  ->  forward (one retry elsewhere)  ->  record  ->
    release

The API hands over a checked, authenticated turn (`TurnRequest`) and gets a `Reply`; nothing
else of a turn's life is in the HTTP layer. The desk tokenises the turn through its port
(`TurnTokenizer`, the API's adapter). A session's next chat turn that only appends text may
be placed and forwarded before it is tokenised (the port's `estimate` says how long it
likely is): what it shares with the last turn is that turn's prompt, whose chain is
known, and it is tokenised and hashed while the worker prefills, ready for the turn after
it. Placement comes first, so that admission judges the turn's deadline on the worker it
will go to (its first attempt goes there, unless a worker must wake for it first).
Admission decides; the task book opens the task and counts the turn in flight until
the answer is complete, or for a stream until it ends, however it ends (the session's
in-flight count likewise). A turn whose task has a deadline gets its share of it: the
deadline less what its class's history expects the task to need after this turn
(services/tasks/task_paces.py); one that still waits on its worker then (no first byte) is
aborted and answered 504 `deadline_missed` (services/turns/flights.py): a non-streamed answer
after that is of no use to the task.

Failures: a worker that fails before the first byte (unreachable, 5xx) costs one failed
attempt and the turn is placed again, once, without it; a 4xx goes back as the worker wrote
it. A worker silent for `engine.request_timeout_s` costs a failed attempt and a 504
`worker_timeout`, not placed again. A turn whose client hangs up is cancelled there and then
(api/app.py): its attempt ends `cancelled` and nothing of it is tried again.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import replace
from functools import partial

from appliance.domain.errors import (
    ApplianceError,
    EngineRequestError,
    EngineTimedOut,
    EngineUnavailable,
    LedgerUnavailable,
    PromptOverflow,
)
from appliance.domain.records import SessionId, TaskId, TenantId, TurnOutcome, WorkerId
from appliance.ports import Clock, WorkerEndpoint
from appliance.services.escalation.service import Escalation
from appliance.services.sessions.session_finder import find_session, let_go
from appliance.services.sessions.sessions import SessionState, SessionTable, TurnHints
from appliance.services.tasks.admission import AdmissionRefused, resident_hint
from appliance.services.tasks.task_paces import TaskPaces, share_headers
from appliance.services.tasks.task_state import TaskState, TaskTurnBegan, TaskTurnEnded
from appliance.services.tasks.tasks import TaskBook
from appliance.services.turns.desk_aides import TurnDeskAides
from appliance.services.turns.flights import (
    DEADLINE_MISSED,
    Flight,
    Flights,
    loop_alarm,
    stopped_error,
)
from appliance.services.turns.forwarder import Forwarder, error_reply
from appliance.services.turns.placement import Placement, Placer
from appliance.services.turns.queue_book import QueueBook
from appliance.services.turns.sent_tokens import tokenize_sent, with_prompt
from appliance.services.turns.turn import (
    Attempt,
    NoWorker,
    Reply,
    Soon,
    TurnRequest,
    new_turn_id,
)
from appliance.services.turns.turn_records import TurnRecords
from appliance.services.turns.turn_task import known_task
from appliance.services.turns.worker_body import worker_body

log = logging.getLogger(__name__)


class TurnDesk:
    def __init__(
        self,
        *,
        sessions: SessionTable,
        placer: Placer,
        queues: QueueBook,
        records: TurnRecords,
        tasks: TaskBook,
        clock: Clock,
        workers: Callable[[], Sequence[WorkerEndpoint]],
        aides: TurnDeskAides | None = None,
    ) -> None:
        self.sessions = sessions
        self.placer = placer
        self.queues = queues
        self.records = records
        self._tasks = tasks
        self._clock = clock
        self._workers = workers
        aides = aides or TurnDeskAides()
        self._admission = aides.admission
        self._tokenizer = aides.tokenizer
        self._turn_subscribers = (tasks, *aides.subscribers)  # the task book hears first
        self._forwarder = Forwarder(clock, queues, records)
        self.flights = aides.flights or Flights(loop_alarm(clock))
        self.worker_reaper = aides.worker_reaper
        self.paces = aides.paces or TaskPaces(clock)
        self.escalation = aides.escalation or Escalation({})

    async def run(self, t: TurnRequest) -> Reply:
        """The whole turn (the module docstring's order)."""
        failing = self.records.ledger_failing()
        if failing is not None:
            raise LedgerUnavailable(f"the ledger cannot record the turn ({failing}); retry later")
        found = None
        if t.session_id is None and t.client_task_id is None and t.conversation:
            found = find_session(self.sessions, t.tenant, str(t.body.get("model")), t.conversation)
        if found is not None:  # named by none: the prefix chain's
            note = "; ".join(n for n in (found.note, t.route_note) if n)
            t = replace(t, session_id=found.session_id, route_note=note, prompt_tip=found.tip)
        try:
            return await self._run(t)
        finally:
            let_go(self.sessions, found)

    async def _run(self, t: TurnRequest) -> Reply:
        known = known_task(self._tasks, t)
        session = self.known_session(t.tenant, t.session_id, known.key if known else None)
        client_task = t.client_task_id or f"turn-{uuid.uuid4().hex[:16]}"
        t = replace(t, task_id=self._tasks.key(t.tenant, client_task))
        try:
            turn = with_prompt(self._tokenizer, t, session)
        except PromptOverflow:
            if session is not None:  # its harness compacts: its KV is not used again
                session.overflowed_at = self._clock.now()
            raise
        queues = self.queues.estimates(self._workers())  # one estimate: admission, placement
        side = self.escalation.side(turn, t.escalate, known.task_class if known else None)
        placed, priority, need_s = None, 0, 0.0
        if side.endpoint is None:  # admission judges the worker placement chose
            placed = self._preview(turn, queues)
            try:
                priority, need_s = await self._admit(turn, session, queues, placed)
            except AdmissionRefused as refused:  # outside instead, where spill-over allows
                deadline_at = known.deadline_at if known else None
                side, placed = self.escalation.spill(refused, t.deadline_s, deadline_at), None
        streaming = False
        task: TaskState | None = None
        flight: Flight | None = None
        try:
            now = self._clock.now()
            task = self._tasks.ensure(
                t.tenant,
                client_task,
                now,
                parent_id=t.client_parent_id,
                deadline_s=t.deadline_s,
                one_turn=t.client_task_id is None,
            )
            began = TaskTurnBegan(task, now)
            for subscriber in self._turn_subscribers:
                subscriber.turn_began(began)
            reason = side.reason if self.escalation.active else None
            turn = replace(turn, parent_task_id=task.parent, priority=priority, side_reason=reason)
            share = self.paces.share(task, now, t.deadline_s, need_s)
            flight = self.flights.take_off(task.key, share)
            try:
                local = partial(self._local, session, queues, flight, placed)
                reply = await self.escalation.serve(turn, side, local)
                flight.relaying = reply.chunks is not None  # a stream runs on past the deadline
            except asyncio.CancelledError:
                if not flight.stopped:
                    raise
                asyncio.current_task().uncancel()  # type: ignore[union-attr]
                raise stopped_error(client_task, flight) from None
            headers = {**reply.headers, "X-Task-ID": client_task, **share_headers(share)}
            reply = replace(reply, headers=headers, session_id=t.session_id)
            if reply.chunks is not None:  # the turn ends when the stream ends
                streaming = True
                return replace(reply, on_end=partial(self._ended, task, flight))
            return reply
        finally:
            if not streaming:
                self._ended(task, flight)

    async def _local(
        self,
        session: SessionState | None,
        queues: dict[WorkerId, float],
        flight: Flight,
        placed: Placement | None,
        turn: TurnRequest,
        admit: bool,
    ) -> Reply:
        """The turn on the local box; `admit`: it was meant for an outside endpoint that
        could not take it, so the box's admission judges it first (and may refuse it)."""
        if admit:
            placed = self._preview(turn, queues)
            priority, _ = await self._admit(turn, session, queues, placed)
            turn = replace(turn, priority=priority)
        return await self.handle(turn, queues, flight, placed)

    def _ended(self, task: TaskState | None, flight: Flight | None) -> None:
        if task is not None:
            ended = TaskTurnEnded(task, self._clock.now())
            for subscriber in self._turn_subscribers:
                subscriber.turn_ended(ended)
            if flight is not None:
                self.flights.land(task.key, flight)

    def stop(self, task: TaskId, outcome: TurnOutcome = TurnOutcome.CANCELLED) -> int:
        """Ends the task's turns in flight (its cancellation, or its discarding; see
        services/turns/flights.py): how many it ended."""
        return self.flights.stop(task, outcome)

    def known_session(
        self, tenant: TenantId, session_id: SessionId | None, task_id: TaskId | None
    ) -> SessionState | None:
        """The session a turn with these ids continues, when the desk already has it."""
        sid = session_id or (SessionId(f"task:{task_id}") if task_id else None)
        return self.sessions.get(tenant, sid) if sid else None

    def _preview(self, turn: TurnRequest, queues: dict[WorkerId, float]) -> Placement | None:
        """Where the turn would go now, before it is admitted (None: no worker to choose);
        its first attempt goes there, unless a worker had to wake for it first."""
        sid = turn.session_id or SessionId(f"task:{turn.task_id}")
        session = self.sessions.get(turn.tenant, sid)
        if session is None:  # its first turn: placed as on the session `_session` opens
            session = SessionState(turn.tenant, sid, created_at=self._clock.now())
        placement = self.placer.place(turn, session, frozenset(), queues)
        return placement if placement.decision.worker is not None else None

    async def _admit(
        self,
        turn: TurnRequest,
        session: SessionState | None,
        queues: dict[WorkerId, float],
        placed: Placement | None,
    ) -> tuple[int, float]:
        """Admission's decision on this turn, judged on the worker placement chose: the
        turn's priority, clipped to its tenant's ceiling (0 without admission), and its own
        need (its estimated first token there); raises when refused."""
        need_s = placed.decision.candidates[0].ttft_estimate_s if placed is not None else 0.0
        if self._admission is None:
            return 0, need_s
        asked_parent = turn.client_parent_id
        parent = self._tasks.key(turn.tenant, asked_parent) if asked_parent else None
        n_prompt = turn.prompt_len
        resident = placed.resident if placed is not None else resident_hint(session, n_prompt)
        decision = await self._admission.admit_turn(
            turn.tenant,
            turn.task_id,
            parent=parent,
            deadline_s=turn.deadline_s,
            priority=turn.asked_priority,
            prompt_tokens=n_prompt,
            resident_tokens=resident,
            queues=queues,
            placed=placed.decision.worker if placed is not None else None,
        )
        return decision.priority, decision.first_token_s or 0.0

    # --- placement and forwarding ----------------------------------------------------

    async def handle(
        self,
        turn: TurnRequest,
        queues: dict[WorkerId, float] | None = None,
        flight: Flight | None = None,
        placed: Placement | None = None,
    ) -> Reply:
        """Places and forwards one turn of its session; `queues`: this moment's estimates,
        when the caller has them already; `flight`: what its task's cancellation stops;
        `placed`: where admission saw it placed on them (its first attempt goes there)."""
        if self.worker_reaper is not None and await self.worker_reaper.ensure_awake():
            queues = placed = None  # a worker woke for it: this moment's estimates
        now = self._clock.now()
        session = self._session(turn, now)
        self.sessions.began(session, now)
        try:
            reply = await self._forward(turn, session, queues, flight or Flight(None), placed)
        except BaseException:
            self._release(session)
            raise
        if reply.chunks is None:  # a stream releases the session when it ends
            self._release(session)
        return reply

    def _session(self, turn: TurnRequest, now: float) -> SessionState:
        sid = turn.session_id or SessionId(f"task:{turn.task_id}")
        hints = TurnHints(
            turn.tool_class,
            turn.expected_wait_s,
            turn.chat,
            turn.messages,
            incremental=turn.chat is not None or turn.prompt_ids is None,
            prompt_tip=turn.prompt_tip,
        )
        return self.sessions.take_turn(turn.tenant, sid, turn.task_id, now, hints)

    def _release(self, session: SessionState) -> None:
        self.sessions.ended(session, self._clock.now())

    async def _forward(
        self,
        turn: TurnRequest,
        session: SessionState,
        queues: dict[WorkerId, float] | None,
        flight: Flight,
        placed: Placement | None,
    ) -> Reply:
        tried: set[WorkerId] = set()
        last_error: ApplianceError | None = None
        tokenized: Soon | None = None
        for _ in range(2):  # the first choice, then one retry elsewhere
            # A retry comes later: the queues are estimated again.
            placement = placed or self.placer.place(turn, session, frozenset(tried), queues)
            queues = placed = None
            worker_id = placement.decision.worker
            if worker_id is None:
                break
            self.placer.commit(session, placement)
            worker = next(w for w in self._workers() if w.id == worker_id)
            attempt = self._begin(turn, session, placement, worker_id)
            body = worker_body(turn, session, placement.salt, placement.prefill_s)
            if turn.prompt_ids is None and tokenized is None:  # once the request is sent
                salt = self.placer.salt(turn.tenant, turn.client_salt)
                assert self._tokenizer is not None  # its estimate came from it
                prompt = partial(self._tokenizer.tokenize, turn, turn.previous_chat)
                tokenized = Soon(
                    partial(tokenize_sent, self.sessions, salt, prompt, session, attempt)
                )
            if turn.received_at is not None and not tried:
                self.records.forward_s.observe(time.monotonic() - turn.received_at)
            try:
                if turn.stream:
                    on_end = partial(self._stream_ended, session, tokenized, attempt)
                    reply = await self._forwarder.stream(
                        turn, worker, attempt, body, on_end, stopped=flight.stopped_as
                    )
                    flight.relaying = True
                else:
                    on_answer = tokenized.now if tokenized is not None else None
                    reply = await self._forwarder.post(turn, worker, attempt, body, on_answer)
            except asyncio.CancelledError:  # the client left, the task was cancelled, or
                error = DEADLINE_MISSED if flight.missed else None  # its deadline passed
                outcome = flight.outcome if flight.stopped else TurnOutcome.CANCELLED
                self._forwarder.finish(turn, attempt, outcome, error=error)
                raise
            except (EngineUnavailable, EngineRequestError) as exc:
                self._forwarder.finish(turn, attempt, TurnOutcome.FAILED, error=exc.message)
                if isinstance(exc, EngineTimedOut):  # the client has waited enough: no retry
                    raise
                if isinstance(exc, EngineRequestError) and exc.http_status < 500:
                    return error_reply(exc)
                tried.add(worker.id)
                last_error = exc
                continue
            self.sessions.served(session, worker.id, attempt.said)  # a stream's: at its end
            return reply
        if last_error is not None:
            raise NoWorker(f"no worker could serve the request: {last_error.message}")
        raise NoWorker("no healthy worker serves this model")

    def _begin(
        self, turn: TurnRequest, session: SessionState, placement: Placement, worker: WorkerId
    ) -> Attempt:
        predicted = placement.resident.get(worker, 0)
        est = self.queues.prefill_s(worker, turn.prompt_len - predicted, predicted)
        now = self._clock.now()
        attempt = Attempt(new_turn_id(), worker, predicted, now, est)
        if turn.received_at is not None:
            attempt.queue_s = max(0.0, time.monotonic() - turn.received_at)
        attempt.generation = self.placer.generation(worker)
        chain = session.chain
        if chain is not None and chain.hashes:
            # The last full block's hash commits to the whole prefix and the tenant salt.
            attempt.prefix_digest = chain.hashes[-1].hex()
            attempt.prefix_tokens = len(chain.hashes) * chain.block_size
        self.queues.sent(worker, attempt.turn_id, est, now, streamed=turn.stream)
        self.records.placed(attempt, placement.decision, turn.prompt_len)
        return attempt

    def _stream_ended(
        self, session: SessionState, tokenized: Soon | None, attempt: Attempt
    ) -> None:
        if tokenized is not None:
            tokenized.now()
        self.sessions.heard(session, attempt.said)  # how its answer ended, for the turn's end
        self._release(session)
