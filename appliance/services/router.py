"""The session router: places each agent turn and accounts for every attempt.

Model of the world. A turn arrives already tokenised (the API renders it with the model's
chat template, so the ids are the ones vLLM will see). The router hashes those ids exactly
as vLLM does, under the tenant's salt (so no cache entry is ever shared across tenants),
asks the KV index which workers hold how much of that prefix, estimates each worker's queue
from the prefill work it has itself sent there and not yet seen start, and lets the routing
policy pick (see appliance/policy/routing). The request goes to the worker with the salt and
the namespaced session id set; nothing else of the client's body changes.

A session's next turn that only appends text arrives untokenised (`tokenize` set): what it
shares with the last turn is that turn's prompt, whose chain the router already has, and
the text it appends is resident nowhere yet, so the placement is the same as with the new
ids, with the prompt's length estimated. It is forwarded at once and tokenised and hashed
while the worker prefills, ready for the turn after it; tokenising was most of the time a
turn spent in the router.

Failures: a worker that fails before the first byte (unreachable, 5xx) costs one failed
attempt and the turn is retried once on the next-best worker; a stream that breaks midway
ends with an SSE error event and a failed attempt; a 4xx from the worker goes back to the
client as it is. Every attempt becomes one `turns` row, acknowledged by the ledger.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import deque
from collections.abc import AsyncGenerator, Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import orjson

from appliance.domain.block_hash import cacheable_tokens
from appliance.domain.errors import ApplianceError, EngineRequestError, EngineUnavailable
from appliance.domain.kv_events import Medium
from appliance.domain.records import (
    CacheReceipt,
    CacheTier,
    RouteDecisionRecord,
    SessionId,
    TaskId,
    TenantId,
    TurnId,
    TurnOutcome,
    TurnRecord,
    WorkerId,
)
from appliance.policy.routing import (
    PrefillCost,
    RouteDecision,
    RouteKind,
    RouteRequest,
    RoutingProfile,
    WorkerView,
    route,
)
from appliance.ports import Clock, KvLookup, Ledger, WorkerEndpoint
from appliance.services.histogram import Histogram
from appliance.services.sessions import ChatTokens, SessionState, SessionTable

log = logging.getLogger(__name__)
FAILURE_WINDOW_S = 60.0
SPAN_MEMORY_S = 30.0  # longer than any worker reading can be old


class NoWorker(ApplianceError):
    code = "no_healthy_worker"
    http_status = 503


FORWARD_BUCKETS_S = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
"""Upper bounds (seconds) of `appliance_forward_seconds`, the router's own time per turn."""


@dataclass(frozen=True, slots=True)
class TurnRequest:
    tenant: TenantId
    path: str
    """/v1/chat/completions or /v1/completions."""
    body: dict[str, Any]
    prompt_ids: Sequence[int] | None
    """None when the turn is forwarded before it is tokenised (`tokenize` is then set)."""
    task_id: TaskId
    session_id: SessionId | None = None
    parent_task_id: TaskId | None = None
    client_salt: str | None = None
    tool_class: str | None = None
    expected_wait_s: float | None = None
    chat: ChatTokens | None = None
    """The rendered chat behind `prompt_ids`, kept so the session's next turn tokenises only
    what it appends."""
    messages: list[Any] | None = None
    """A chat's messages, kept with `chat` so the next turn can be forwarded untokenised."""
    tokenize: Callable[[], tuple[Sequence[int], ChatTokens | None]] | None = None
    """For a turn forwarded untokenised: its ids and chat, computed after it was sent."""
    estimated_tokens: int = 0
    """The prompt's likely length while `prompt_ids` is None."""
    received_at: float | None = None
    """When the whole request had arrived (time.monotonic()), if the server says."""

    @property
    def stream(self) -> bool:
        return bool(self.body.get("stream"))

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids) if self.prompt_ids is not None else self.estimated_tokens


@dataclass(eq=False)
class Attempt:
    turn_id: TurnId
    worker: WorkerId
    predicted_cached: int
    started_at: float
    estimated_prefill_s: float
    first_byte_at: float | None = None
    usage: dict[str, Any] = field(default_factory=dict)
    prefix_digest: str | None = None
    """Hex digest of the prompt's last full block: names the cached prefix in a receipt."""
    prefix_tokens: int = 0


@dataclass(frozen=True, slots=True)
class Reply:
    """A finished non-streaming answer, or the head of a stream (`chunks` then yields it)."""

    status: int
    headers: dict[str, str]
    body: bytes = b""
    """A finished answer's JSON, relayed as the worker wrote it."""
    chunks: AsyncGenerator[bytes, None] | None = None


class Router:
    def __init__(
        self,
        *,
        workers: Callable[[], Sequence[WorkerEndpoint]],
        index: KvLookup,
        sessions: SessionTable,
        cost: PrefillCost,
        profile: RoutingProfile,
        ledger: Ledger,
        clock: Clock,
        tenant_salt: Callable[[TenantId, str | None], str],
        model: str,
        runtime_identity: str = "",
        on_turn: Callable[[TurnRecord, Future[float | None]], None] | None = None,
        slowdown: Callable[[WorkerId], float] | None = None,
    ) -> None:
        self._workers = workers
        self._index = index
        self.sessions = sessions
        self._cost = cost
        self._profile = profile
        self._ledger = ledger
        self._clock = clock
        self._salt = tenant_salt
        self.model = model
        self._runtime = runtime_identity
        self._on_turn = on_turn
        self.slowdown = slowdown or (lambda worker: 1.0)
        """Each worker's prefill seconds per second of the cost model's (WorkerSpeeds)."""
        # Failed attempts per worker in the last FAILURE_WINDOW_S, oldest first.
        self._failures: dict[WorkerId, deque[float]] = {}
        # When each attempt in flight at each worker started, and (start, end) of the ones
        # that ended in the last SPAN_MEMORY_S, oldest end first.
        self._running: dict[WorkerId, dict[TurnId, float]] = {}
        self._ended: dict[WorkerId, deque[tuple[float, float]]] = {}
        # Prefill work sent to each worker whose first byte has not come back yet: its
        # estimated seconds and when the worker should be done with it.
        self._pending: dict[WorkerId, dict[TurnId, tuple[float, float]]] = {}
        self.routed_by_reason: dict[RouteKind, int] = {}
        """Turns placed, by the kind of the policy's reason (a fixed set)."""
        self._mean_prefill_s = 0.0
        """Moving average of the prefill seconds of recent turns."""
        self.predicted_cached_total = 0
        self.actual_cached_total = 0
        self.first_byte_s_total = 0.0
        self.forward_s = Histogram(FORWARD_BUCKETS_S)
        """The router's own time per turn, from the whole request to its forwarding."""

    # --- placement -------------------------------------------------------------------

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

    def known_session(
        self, tenant: TenantId, session_id: SessionId | None, task_id: TaskId | None
    ) -> SessionState | None:
        """The session a turn with these ids continues, when the router already has it."""
        sid = session_id or (SessionId(f"task:{task_id}") if task_id else None)
        return self.sessions.get(tenant, sid) if sid else None

    def _session(self, turn: TurnRequest, now: float) -> SessionState:
        sid = turn.session_id or SessionId(f"task:{turn.task_id}")
        state = self.sessions.open(turn.tenant, sid, now)
        state.task_id = turn.task_id
        state.tool_class = turn.tool_class
        state.expected_wait_s = turn.expected_wait_s
        # Kept only from a chat tokenised incrementally (or about to be): anything else makes
        # the next turn tokenise before it is placed.
        incremental = turn.chat is not None or turn.tokenize is not None
        state.chat = turn.chat if incremental else None
        state.messages = turn.messages if incremental else None
        return state

    def queue_estimates(
        self, workers: Sequence[WorkerEndpoint] | None = None
    ) -> dict[WorkerId, float]:
        """`queue_s` of every worker: computed once per turn, for admission and placement."""
        return {w.id: self.queue_s(w) for w in (self._workers() if workers is None else workers)}

    def place(
        self,
        turn: TurnRequest,
        session: SessionState,
        exclude: frozenset[WorkerId] = frozenset(),
        queues: dict[WorkerId, float] | None = None,
    ) -> tuple[RouteDecision, dict[WorkerId, int]]:
        if turn.prompt_ids is not None:
            salt = self._salt(turn.tenant, turn.client_salt)
            chain = self.sessions.hash_prompt(session, turn.prompt_ids, salt)
        else:  # untokenised: the last turn's prompt is the prefix this one shares
            assert session.chain is not None
            chain = session.chain
        resident_blocks = self._index.lookup(chain.event_hashes) if chain.hashes else {}
        bs = chain.block_size
        cap = cacheable_tokens(turn.prompt_len, bs)
        resident = {w: min(n * bs, cap) for w, n in resident_blocks.items()}
        session.resident_tokens = dict(resident)
        workers = self._workers()
        if queues is None:
            queues = self.queue_estimates(workers)
        total_queue = sum(queues.values())
        views = [
            WorkerView(
                worker=w.id,
                models=frozenset({self.model}),
                healthy=w.healthy and w.id not in exclude,
                draining=w.draining,
                resident_tokens=resident.get(w.id, 0),
                queue_s=queues.get(w.id, 0.0),
                queued_share=queues.get(w.id, 0.0) / total_queue if total_queue else 0.0,
                kv_usage=w.load.kv_cache_usage_perc if w.load else 0.0,
                recent_failures=self._recent_failures(w.id),
                slowdown=self.slowdown(w.id),
            )
            for w in workers
        ]
        request = RouteRequest(self.model, turn.prompt_len, session.home)
        return route(request, views, self._cost, self._profile), resident

    def _recent_failures(self, worker: WorkerId) -> int:
        seen = self._failures.get(worker)
        if not seen:
            return 0
        horizon = self._clock.now() - FAILURE_WINDOW_S
        while seen and seen[0] < horizon:
            seen.popleft()
        return len(seen)

    def queue_s(self, worker: WorkerEndpoint) -> float:
        """Prefill work ahead of a new request there: what the router sent and has not seen
        start, or, when the worker reports waiting requests that are not the router's own
        (other clients, a restarted router), those requests at the worker's mean prompt.

        What the router sent counts only for the part the worker cannot have done yet, taking
        the requests one after the other at the cost model's speed: a non-streamed answer
        shows no first token, and counting its prefill until the whole answer is back would
        count its decode as queue.

        The reading is up to a refresh old, so the router's own requests are counted as they
        were when it was taken; a stale reading of its own queue must never look like load.
        """
        load = worker.load
        routed = self._routed_s(worker.id, self._clock.now())
        foreign = load.waiting - self._own_at(worker.id, load.time) if load else 0
        if load is None or foreign <= 0:
            return routed
        mean_prompt = load.prompt_tokens / load.ttft_count if load.ttft_count else 0
        per_request = self._prefill_s(worker.id, int(mean_prompt), 0) if mean_prompt else 0.0
        return max(routed, foreign * max(per_request, self._mean_prefill_s))

    def _prefill_s(self, worker: WorkerId, fresh: int, reused: int) -> float:
        """The cost model's prefill seconds at this worker's measured speed."""
        return self._cost.prefill_s(fresh, reused) * self.slowdown(worker)

    def _routed_s(self, worker: WorkerId, now: float) -> float:
        """The prefill seconds the router sent to `worker` that it may still have to do."""
        pending = self._pending.get(worker)
        if not pending:
            return 0.0
        return sum(min(est, done_by - now) for est, done_by in pending.values() if done_by > now)

    def _own_at(self, worker: WorkerId, t: float) -> int:
        """The router's attempts in flight at `worker` at time `t` (recent ones are kept)."""
        running = sum(1 for start in self._running.get(worker, {}).values() if start <= t)
        ended = self._ended.get(worker)
        if not ended:
            return running
        horizon = self._clock.now() - SPAN_MEMORY_S
        while ended and ended[0][1] < horizon:
            ended.popleft()
        for start, end in reversed(ended):  # only the ends after `t`: a reading's age
            if end <= t:
                break
            running += start <= t
        return running

    # --- forwarding ------------------------------------------------------------------

    async def handle(self, turn: TurnRequest, queues: dict[WorkerId, float] | None = None) -> Reply:
        """Places and forwards one turn; `queues`: this moment's `queue_estimates()`, when
        the caller has them already."""
        now = self._clock.now()
        session = self._session(turn, now)
        session.in_flight += 1
        session.turns += 1
        session.last_active_at = now
        try:
            reply = await self._handle(turn, session, queues)
        except BaseException:
            self._release(session)
            raise
        if reply.chunks is None:  # a stream releases the session when it ends
            self._release(session)
        return reply

    def _release(self, session: SessionState) -> None:
        session.in_flight -= 1
        session.last_active_at = self._clock.now()

    async def _handle(
        self, turn: TurnRequest, session: SessionState, queues: dict[WorkerId, float] | None
    ) -> Reply:
        tried: set[WorkerId] = set()
        last_error: ApplianceError | None = None
        tokenized: _Soon | None = None
        for _ in range(2):  # the first choice, then one retry elsewhere
            # A retry comes later: the queues are estimated again.
            decision, resident = self.place(turn, session, frozenset(tried), queues)
            queues = None
            if decision.worker is None:
                break
            worker = next(w for w in self._workers() if w.id == decision.worker)
            attempt = self._begin(turn, worker.id, decision, resident)
            chain = session.chain
            if chain is not None and chain.hashes:
                # The last full block's hash commits to the whole prefix and the tenant salt.
                attempt.prefix_digest = chain.hashes[-1].hex()
                attempt.prefix_tokens = len(chain.hashes) * chain.block_size
            body = self._worker_body(turn, session)
            if turn.tokenize is not None and tokenized is None:  # once the request is sent
                tokenized = _Soon(partial(self._tokenize_sent, turn, session, attempt))
            if turn.received_at is not None and not tried:
                self.forward_s.observe(time.monotonic() - turn.received_at)
            try:
                if turn.stream:
                    return await self._open_stream(turn, session, worker, attempt, body, tokenized)
                answer = await worker.client.post(turn.path, body)
                if tokenized is not None:
                    tokenized.now()
            except EngineUnavailable as exc:
                self._finish(turn, attempt, TurnOutcome.FAILED, error=exc.message)
                tried.add(worker.id)
                last_error = exc
                continue
            except EngineRequestError as exc:
                self._finish(turn, attempt, TurnOutcome.FAILED, error=exc.message)
                if exc.http_status >= 500:
                    tried.add(worker.id)
                    last_error = exc
                    continue
                return Reply(exc.http_status, {}, orjson.dumps(_error_body(exc)))
            attempt.first_byte_at = self._clock.now()
            attempt.usage = _usage_of(answer) or {}
            self._finish(turn, attempt, TurnOutcome.OK)
            session.home = worker.id
            return Reply(200, self._headers(turn, attempt), answer)
        if last_error is not None:
            raise NoWorker(f"no worker could serve the request: {last_error.message}")
        raise NoWorker("no healthy worker serves this model")

    def _tokenize_sent(self, turn: TurnRequest, session: SessionState, attempt: Attempt) -> None:
        """Tokenises and hashes a turn forwarded untokenised, for the session's next turn."""
        assert turn.tokenize is not None
        try:
            ids, chat = turn.tokenize()
        except Exception as exc:  # the worker judges the request itself; the next turn
            log.info("turn of session %s not tokenised: %s", session.session_id, exc)
            session.chat = session.messages = None  # ... is tokenised before it is placed
            return
        session.chat = chat
        chain = self.sessions.hash_prompt(session, ids, self._salt(turn.tenant, turn.client_salt))
        if chain.hashes and attempt.first_byte_at is None:
            attempt.prefix_digest = chain.hashes[-1].hex()
            attempt.prefix_tokens = len(chain.hashes) * chain.block_size

    def _begin(
        self,
        turn: TurnRequest,
        worker: WorkerId,
        decision: RouteDecision,
        resident: dict[WorkerId, int],
    ) -> Attempt:
        predicted = resident.get(worker, 0)
        fresh = turn.prompt_len - predicted
        est = self._prefill_s(worker, fresh, predicted)
        now = self._clock.now()
        attempt = Attempt(TurnId(uuid.uuid4().hex), worker, predicted, now, est)
        done_by = now + self._routed_s(worker, now) + est  # after what is ahead of it
        self._pending.setdefault(worker, {})[attempt.turn_id] = (est, done_by)
        self._running.setdefault(worker, {})[attempt.turn_id] = attempt.started_at
        self._mean_prefill_s += 0.1 * (est - self._mean_prefill_s)
        self.routed_by_reason[decision.kind] = self.routed_by_reason.get(decision.kind, 0) + 1
        # Written once the request is on its way: the turn never waits on its own records.
        asyncio.get_running_loop().call_soon(self._record_decision, attempt, decision)
        return attempt

    def _record_decision(self, attempt: Attempt, decision: RouteDecision) -> None:
        record = RouteDecisionRecord(
            attempt.turn_id,
            attempt.started_at,
            attempt.worker,
            f"{decision.kind}: {decision.reason}",
            _candidates_json(decision),
        )
        _log_failure(self._ledger.record_route_decision(record), "route decision")

    def _worker_body(self, turn: TurnRequest, session: SessionState) -> dict[str, Any]:
        body = dict(turn.body)
        body["cache_salt"] = self._salt(turn.tenant, turn.client_salt)
        body["session_id"] = f"{turn.tenant}/{session.session_id}"
        if turn.stream:
            opts = dict(body.get("stream_options") or {})
            opts["include_usage"] = True  # the ledger needs the worker's own counts
            body["stream_options"] = opts
        return body

    async def _open_stream(
        self,
        turn: TurnRequest,
        session: SessionState,
        worker: WorkerEndpoint,
        attempt: Attempt,
        body: dict[str, Any],
        tokenized: _Soon | None,
    ) -> Reply:
        stream = worker.client.open_stream(turn.path, body)
        response = await stream.__aenter__()  # raises before the first byte: caller retries
        session.home = worker.id

        async def chunks() -> AsyncGenerator[bytes, None]:
            outcome, error = TurnOutcome.OK, None
            usage = UsageScanner()
            try:
                async for data in response.chunks():  # relayed as they come, unparsed
                    if attempt.first_byte_at is None:
                        attempt.first_byte_at = self._clock.now()
                        self._pending.get(worker.id, {}).pop(attempt.turn_id, None)
                    usage.feed(data)
                    yield data
                if usage.last:
                    attempt.usage = usage.last
            except GeneratorExit:  # closed before its end: the client left midway
                outcome = TurnOutcome.CANCELLED
                raise
            except Exception as exc:  # the worker broke off midway
                outcome, error = TurnOutcome.FAILED, f"stream broke: {exc or type(exc).__name__}"
                event = {"error": {"message": error, "type": "stream_error", "code": 502}}
                yield b"data: " + orjson.dumps(event) + b"\n\n"
            finally:
                if tokenized is not None:
                    tokenized.now()
                self._release(session)
                await stream.__aexit__(None, None, None)
                self._finish(turn, attempt, outcome, error=error)

        return Reply(200, self._headers(turn, attempt), chunks=chunks())

    def _headers(self, turn: TurnRequest, attempt: Attempt) -> dict[str, str]:
        headers = {"X-Appliance-Worker": attempt.worker, "X-Task-ID": turn.task_id}
        cached = _cached_tokens(attempt.usage)
        headers["X-Appliance-Cached-Tokens"] = str(
            cached if cached is not None else attempt.predicted_cached
        )
        return headers

    def _finish(
        self, turn: TurnRequest, attempt: Attempt, outcome: TurnOutcome, *, error: str | None = None
    ) -> None:
        self._pending.get(attempt.worker, {}).pop(attempt.turn_id, None)
        end = self._clock.now()
        self._running.get(attempt.worker, {}).pop(attempt.turn_id, None)
        self._ended.setdefault(attempt.worker, deque()).append((attempt.started_at, end))
        if outcome == TurnOutcome.FAILED:
            self._failures.setdefault(attempt.worker, deque()).append(end)
        # Recorded after the answer went out (the next loop turn), in the order they ended.
        asyncio.get_running_loop().call_soon(self._record_turn, turn, attempt, outcome, error, end)

    def _record_turn(
        self,
        turn: TurnRequest,
        attempt: Attempt,
        outcome: TurnOutcome,
        error: str | None,
        end: float,
    ) -> None:
        usage = attempt.usage
        prompt = int(usage.get("prompt_tokens") or turn.prompt_len)
        cached = min(_cached_tokens(usage) or 0, prompt)
        record = TurnRecord(
            turn_id=attempt.turn_id,
            tenant=turn.tenant,
            task_id=turn.task_id,
            session_id=turn.session_id,
            worker=attempt.worker,
            model=self.model,
            prompt_tokens=prompt,
            cached_tokens=cached,
            output_tokens=int(usage.get("completion_tokens") or 0),
            outcome=outcome,
            started_at=attempt.started_at,
            finished_at=max(end, attempt.started_at),
            parent_task_id=turn.parent_task_id,
            ttft_s=(attempt.first_byte_at - attempt.started_at) if attempt.first_byte_at else None,
            e2e_s=max(0.0, end - attempt.started_at),
            predicted_cached_tokens=attempt.predicted_cached,
            error=error,
        )
        # Not awaited: the client's answer never waits on the disk. The writer commits it
        # within milliseconds and shutdown flushes the ledger before it exits.
        written = self._ledger.record_turn(record)
        _log_failure(written, f"turn {record.turn_id}")
        if self._on_turn is not None:
            self._on_turn(record, written)
        if outcome == TurnOutcome.OK and attempt.prefix_digest is not None:
            receipt = CacheReceipt(
                prefix_digest=attempt.prefix_digest,
                token_count=attempt.prefix_tokens,
                model=self.model,
                runtime_identity=self._runtime,
                tenant_domain=turn.tenant,
                worker=attempt.worker,
                tier=CacheTier.GPU,
                created_at=end,
                last_used_at=end,
            )
            _log_failure(self._ledger.record_cache_receipt(receipt), "cache receipt")
        self.predicted_cached_total += attempt.predicted_cached
        self.actual_cached_total += cached
        if record.ttft_s is not None:
            self.first_byte_s_total += record.ttft_s


class _Soon:
    """A call made on the event loop's next turn (after the current task's sends went out),
    or by `now()` when its result is needed first; once either way."""

    def __init__(self, call: Callable[[], None]) -> None:
        self._call: Callable[[], None] | None = call
        self._handle = asyncio.get_running_loop().call_soon(self.now)

    def now(self) -> None:
        call, self._call = self._call, None
        if call is not None:
            self._handle.cancel()
            call()


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


def _cached_tokens(usage: dict[str, Any]) -> int | None:
    details = usage.get("prompt_tokens_details") or {}
    value = details.get("cached_tokens") if isinstance(details, dict) else None
    return int(value) if value is not None else None


class UsageScanner:
    """Finds the `usage` of an SSE stream in the bytes relayed to the client, parsing only
    the complete `data:` lines that mention it (the last such line wins)."""

    def __init__(self) -> None:
        self._tail = b""
        self.last: dict[str, Any] | None = None

    def feed(self, data: bytes) -> None:
        buffer = self._tail + data
        end = buffer.rfind(b"\n") + 1
        complete, self._tail = buffer[:end], buffer[end:]
        if b'"usage"' not in complete:
            return
        for line in complete.split(b"\n"):
            if line.startswith(b"data:") and b'"usage"' in line:
                usage = _usage_of(line[5:])
                if usage:
                    self.last = usage


def _usage_of(data: bytes) -> dict[str, Any] | None:
    try:
        chunk = orjson.loads(data)
    except ValueError:
        return None
    usage = chunk.get("usage") if isinstance(chunk, dict) else None
    return usage if isinstance(usage, dict) else None


def _error_body(exc: EngineRequestError) -> dict[str, Any]:
    try:
        body = orjson.loads(exc.body)
        if isinstance(body, dict) and "error" in body:
            return body
    except (TypeError, ValueError):
        pass
    return {"error": {"message": exc.message, "type": "BadRequestError", "code": exc.http_status}}
