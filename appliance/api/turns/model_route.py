"""The model routes (`POST /v1/chat/completions`, `/v1/completions`, and the Anthropic
Messages API's `/v1/messages`, made a chat turn: anthropic_messages.py): HTTP in, a checked
`TurnRequest` to the turn desk, its reply out (a stream relayed chunk by chunk). The desk
tokenises the turn through its port (api/turns/turn_prompts.py)."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable, Mapping
from dataclasses import replace
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from appliance.api.context import ApiContext
from appliance.api.errors import RequestRefused
from appliance.api.turns.anthropic_messages import (
    CHAT_PATH,
    MESSAGES_PATH,
    chat_request,
    user_session,
)
from appliance.api.turns.anthropic_reply import MessageEvents, message_body
from appliance.api.turns.requests import (
    agent_headers,
    chat_encoder,
    check_model_request,
    parse_json_body,
    served_model,
)
from appliance.domain.records import SessionId
from appliance.services.turns.turn import TurnRequest

MODEL_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", MESSAGES_PATH})


class ModelRoute:
    def __init__(self, ctx: ApiContext) -> None:
        self._ctx = ctx
        self._incremental = chat_encoder(ctx.tokenizer) is not None  # renders chats itself

    async def __call__(self, request: Request) -> Response | RelayedStream:
        headers = _headers_of(request.scope)
        who = self._ctx.keys.caller(headers)
        body = parse_json_body(await request.body())
        hdr = agent_headers(headers, body)
        path = request.scope["path"]
        messages_api = path == MESSAGES_PATH
        if messages_api:  # a chat turn, answered in the Messages API's shapes
            chat = chat_request(body)
            user = user_session(body) if hdr.session_id is None else None
            if user is not None:
                hdr = replace(hdr, session_id=user, session_note="session from metadata.user_id")
            body, path = chat, CHAT_PATH
        served_model(body, self._ctx.model_aliases)
        max_tokens = check_model_request(path, body, self._ctx.model)
        salt = body.get("cache_salt")
        if salt is not None and not isinstance(salt, str):
            raise RequestRefused(
                400, "'cache_salt' must be a string", "invalid_type", param="cache_salt"
            )
        plain = (
            path.endswith("chat/completions")
            and self._incremental
            and body.get("add_generation_prompt", True) is True
        )
        reply = await self._ctx.desk.run(
            TurnRequest(
                tenant=who.tenant,
                path=path,
                body=body,
                max_tokens=max_tokens,
                messages_api=messages_api,
                messages=body["messages"] if plain else None,
                conversation=body["messages"] if path.endswith("chat/completions") else None,
                client_task_id=hdr.task_id,
                session_id=SessionId(hdr.session_id) if hdr.session_id else None,
                client_parent_id=hdr.parent_task_id,
                deadline_s=hdr.deadline_s,
                asked_priority=hdr.priority,
                tool_class=hdr.tool_class,
                expected_wait_s=hdr.expected_wait_s,
                client_salt=salt,
                received_at=_received_at(request),
                route_note=hdr.session_note,
                escalate=hdr.escalate,
            )
        )
        if reply.chunks is not None:
            chunks = MessageEvents().events(reply.chunks) if messages_api else reply.chunks
            return RelayedStream(chunks, reply.headers, on_end=reply.on_end)
        answer = message_body(reply.body) if messages_api and reply.status == 200 else reply.body
        return Response(answer, reply.status, reply.headers, "application/json")


def _headers_of(scope: Mapping[str, Any]) -> dict[str, str]:
    """A request's headers by lowercase name, the first of repeated ones (as Starlette's
    `Headers.get`), read in one pass: a model turn looks up eight of them."""
    return {
        name.decode("latin-1"): value.decode("latin-1")
        for name, value in reversed(scope["headers"])
    }


def _received_at(request: Request) -> float | None:
    """When the server had the whole request, if it is the appliance's own server."""
    received: float | None = (
        request.scope.get("extensions", {}).get("appliance", {}).get("received_at")
    )
    return received


class RelayedStream:
    """A streamed model answer, relayed chunk by chunk as the worker sends it (an ASGI
    response). However it ends (done, the worker broke off, the client hung up) the
    worker's stream is closed, which ends its request there, and `on_end` runs."""

    def __init__(
        self,
        chunks: AsyncGenerator[bytes, None],
        headers: Mapping[str, str],
        *,
        on_end: Callable[[], None] | None = None,
    ) -> None:
        self._chunks = chunks
        self._head = [
            (b"content-type", b"text/event-stream; charset=utf-8"),
            *((k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()),
        ]
        self._on_end = on_end

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        # The head goes out with the first chunk (the server writes them together anyway):
        # sending can fail only once the stream has started, so closing it runs its cleanup.
        start = {"type": "http.response.start", "status": 200, "headers": self._head}
        started = False
        try:
            async for chunk in self._chunks:
                if not started:
                    await send(start)
                    started = True
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            if not started:
                await send(start)
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            try:
                await self._chunks.aclose()
            finally:
                if self._on_end is not None:
                    self._on_end()
