"""`POST /v1/responses` (the OpenAI Responses API), routed as a chat turn.

A Responses request is a chat turn in other clothes: vLLM renders its instructions, its
chained history and its input (function calls and their outputs too) as chat messages
(domain/responses_input.py) and templates them with its function tools in chat's shape
(domain/responses_tools.py), so the router tokenises (the desk, through api/turns/turn_prompts.py)
and hashes the same messages and tools, and hands the turn to the desk like any chat
(tenant, session and task headers, the tenant's salt, admission, placement by the KV index,
the ledger, receipts). The body goes to the worker unchanged but for the fields the desk
sets; the answer, streamed or not, goes back in the API's own shape.

Chaining: vLLM keeps a stored response (and the messages behind it) in the memory of the
worker that produced it. The route learns each answer (the body, or the stream's
`response.completed` event) into `ResponseBook`: per tenant, its id -> the worker, that
worker's restart count then, the messages and output text, the session. A request naming
`previous_response_id` is tokenised with that history and pinned to that worker: never
another, which would not know the id (or worse, one day, answer without the history). A
worker restarted since, or gone, has lost it: the request is refused 404
`previous_response_lost`, naming the restart. An id the router never saw is vLLM's 404.

The turn's session: the one it names (X-Session-ID or the body's `session_id`, the
harness's own id, `prompt_cache_key`: api/turns/requests.py `client_session`), else the previous
response's (a chain is one session), else its `conversation`'s id, else the one whose last
prompt its messages extend (the desk's prefix chain: services/sessions/session_finder.py); the
route decision's reason says which.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import AsyncGenerator, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response

from appliance.api.context import ApiContext
from appliance.api.errors import RequestRefused
from appliance.api.turns.model_route import RelayedStream
from appliance.api.turns.requests import (
    agent_headers,
    check_model_request,
    identifier,
    parse_json_body,
    served_model,
)
from appliance.api.turns.turn_prompts import RESPONSES_PATH
from appliance.domain.records import SessionId, TenantId, WorkerId
from appliance.domain.responses_input import ResponsesInputError, input_messages, output_texts
from appliance.domain.responses_tools import chat_tools
from appliance.services.turns.turn import TurnRequest

_CHAT_PATH = "/v1/chat/completions"
BOOK_LIMIT = 50_000
"""Responses the router remembers (all tenants); the oldest are forgotten first."""


@dataclass(frozen=True, slots=True)
class StoredResponse:
    worker: WorkerId
    restarts: int
    """The worker's restart count when it answered: another count, another process."""
    messages: list[dict[str, Any]]
    """The chat messages the response answered (its own system message included)."""
    texts: list[str]
    session: SessionId | None


class ResponseBook:
    """What the router knows of the responses its workers store (module docstring)."""

    def __init__(self, limit: int = BOOK_LIMIT) -> None:
        self._limit = limit
        self._entries: OrderedDict[tuple[TenantId, str], StoredResponse] = OrderedDict()

    def get(self, tenant: TenantId, response_id: str) -> StoredResponse | None:
        return self._entries.get((tenant, response_id))

    def learn(self, tenant: TenantId, response_id: str, entry: StoredResponse) -> None:
        self._entries[(tenant, response_id)] = entry
        while len(self._entries) > self._limit:
            self._entries.popitem(last=False)


@dataclass(frozen=True, slots=True)
class _Chained:
    """Where a turn's history and session come from."""

    previous: StoredResponse | None
    session: SessionId | None
    """None: the desk finds it by the prefix chain."""
    note: str | None


class ResponsesRoute:
    def __init__(self, ctx: ApiContext, book: ResponseBook | None = None) -> None:
        self._ctx = ctx
        self.book = book or ResponseBook()

    async def __call__(self, request: Request) -> Response | RelayedStream:
        ctx = self._ctx
        who = ctx.keys.caller(request.headers)
        body = parse_json_body(await request.body())
        hdr = agent_headers(request.headers, body)
        served_model(body, ctx.model_aliases)
        check_model_request(RESPONSES_PATH, body, ctx.model)
        max_tokens = _max_output_tokens(body)
        chained = self._chained(who.tenant, body, hdr.session_id, hdr.session_note)
        previous = chained.previous
        try:
            history = (previous.messages, previous.texts) if previous else None
            messages = input_messages(body, history)
            tools = chat_tools(body)
        except ResponsesInputError as exc:
            raise RequestRefused(400, str(exc), "invalid_value", param=exc.param) from None
        check_model_request(_CHAT_PATH, {"model": ctx.model, "messages": messages}, ctx.model)
        reply = await ctx.desk.run(
            TurnRequest(
                tenant=who.tenant,
                path=RESPONSES_PATH,
                body=body,
                max_tokens=max_tokens,
                tools=tools,
                client_task_id=hdr.task_id,
                session_id=chained.session,
                client_parent_id=hdr.parent_task_id,
                deadline_s=hdr.deadline_s,
                asked_priority=hdr.priority,
                tool_class=hdr.tool_class,
                expected_wait_s=hdr.expected_wait_s,
                client_salt=_salt(body),
                received_at=request.scope.get("extensions", {})
                .get("appliance", {})
                .get("received_at"),
                pinned=previous.worker if previous else None,
                route_note=chained.note,
                conversation=messages,
            )
        )
        session = reply.session_id or chained.session
        learn = self._learner(who.tenant, body, messages, session, reply.headers)
        if reply.chunks is not None:
            chunks = _learning(reply.chunks, learn)
            return RelayedStream(chunks, reply.headers, on_end=reply.on_end)
        if reply.status == 200:
            learn(reply.body)
        return Response(reply.body, reply.status, reply.headers, "application/json")

    def _chained(
        self, tenant: TenantId, body: dict[str, Any], named: str | None, note: str | None
    ) -> _Chained:
        """The turn's history and session (module docstring; `named`: the session the turn
        names, `note` saying how); raises for a lost history."""
        pid = body.get("previous_response_id")
        if pid is None:
            if named is not None:
                return _Chained(None, SessionId(named), note)
            conversation = _conversation(body.get("conversation"))
            if conversation is not None:
                return _Chained(None, SessionId(conversation), "session from conversation")
            return _Chained(None, None, None)
        if not isinstance(pid, str):
            raise RequestRefused(
                400,
                "'previous_response_id' must be a string",
                "invalid_type",
                param="previous_response_id",
            )
        entry = self.book.get(tenant, pid)
        if entry is None:
            raise RequestRefused(
                404,
                f"Response with id '{pid}' not found.",
                "response_not_found",
                param="previous_response_id",
            )
        lost = self._lost(entry)
        if lost == "":
            raise RequestRefused(
                503,
                f"Response with id '{pid}' is stored on worker {entry.worker}, which is not "
                "serving now; retry later (if it restarts, the response is lost)",
                "previous_response_unavailable",
                param="previous_response_id",
            )
        if lost is not None:
            raise RequestRefused(
                404,
                f"Response with id '{pid}' is lost: it was stored in the memory of worker "
                f"{entry.worker}, which {lost}. Start a new chain: send the whole "
                "conversation as input, without previous_response_id.",
                "previous_response_lost",
                param="previous_response_id",
            )
        pin = f"pinned to {entry.worker}, which stores previous_response_id {pid}"
        if named is not None:
            return _Chained(entry, SessionId(named), f"{note}; {pin}")
        if entry.session is None:  # the desk finds it by the prefix chain
            return _Chained(entry, None, pin)
        return _Chained(entry, entry.session, f"session from previous_response_id {pid}; {pin}")

    def _lost(self, entry: StoredResponse) -> str | None:
        """Why the worker that stored the response no longer has it; "" when it is down for
        now (its process, and the response, may live on); None when it serves."""
        worker = next((w for w in self._ctx.workers() if w.id == entry.worker), None)
        if worker is None:
            return "is gone"
        restarts = _restarts(worker)
        if restarts != entry.restarts:
            return f"restarted since (restart count {entry.restarts} then, {restarts} now)"
        if not worker.healthy:
            return ""  # down for now: its process, and what it stores, may live on
        return None

    def _learner(
        self,
        tenant: TenantId,
        body: dict[str, Any],
        messages: list[dict[str, Any]],
        session: SessionId | None,
        headers: Mapping[str, str],
    ) -> Callable[[bytes | dict[str, Any]], None]:
        """What remembers the worker's answer (if it was stored) for the next turn."""
        worker = WorkerId(headers.get("X-Appliance-Worker", ""))
        handle = next((w for w in self._ctx.workers() if w.id == worker), None)
        restarts = _restarts(handle) if handle is not None else -1

        def learn(answer: bytes | dict[str, Any]) -> None:
            try:
                response = orjson.loads(answer) if isinstance(answer, bytes) else answer
            except ValueError:
                return
            rid = response.get("id") if isinstance(response, dict) else None
            if not isinstance(rid, str) or body.get("store", True) is False or not worker:
                return
            entry = StoredResponse(worker, restarts, messages, output_texts(response), session)
            self.book.learn(tenant, rid, entry)

        return learn


async def _learning(
    chunks: AsyncGenerator[bytes, None], learn: Callable[[dict[str, Any]], None]
) -> AsyncGenerator[bytes, None]:
    """The relayed stream, unchanged; its `response.completed` event is learnt in passing."""
    tail = b""
    try:
        async for data in chunks:
            buffer = tail + data
            end = buffer.rfind(b"\n") + 1
            complete, tail = buffer[:end], buffer[end:]
            if b'"response.completed"' in complete:
                for line in complete.split(b"\n"):
                    if line.startswith(b"data:") and b'"response.completed"' in line:
                        _learn_event(line[5:], learn)
            yield data
    finally:
        await chunks.aclose()


def _learn_event(data: bytes, learn: Callable[[dict[str, Any]], None]) -> None:
    try:
        event = orjson.loads(data)
    except ValueError:
        return
    if isinstance(event, dict) and isinstance(event.get("response"), dict):
        learn(event["response"])


def _restarts(worker: Any) -> int:
    return int(getattr(worker, "restarts", 0))


def _conversation(value: Any) -> str | None:
    """The id of the request's `conversation` (a string, or an object with an `id`)."""
    if isinstance(value, dict):
        value = value.get("id")
        if value is None:
            raise RequestRefused(
                400,
                "'conversation' must be a string or an object with an 'id'",
                "invalid_value",
                param="conversation",
            )
    return identifier(value, "conversation") if value is not None else None


def _max_output_tokens(body: dict[str, Any]) -> int | None:
    value = body.get("max_output_tokens")
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise RequestRefused(
            400,
            "'max_output_tokens' must be an integer of at least 1",
            "invalid_value",
            param="max_output_tokens",
        )
    return value


def _salt(body: dict[str, Any]) -> str | None:
    salt = body.get("cache_salt")
    if salt is not None and not isinstance(salt, str):
        raise RequestRefused(
            400, "'cache_salt' must be a string", "invalid_type", param="cache_salt"
        )
    return salt
