"""The appliance's HTTP API: OpenAI-compatible model routes, tasks, admin state, metrics.

Routes only translate HTTP to the services and back: authentication names the tenant,
`requests` checks the body and headers, the router places and forwards the turn, the task
book keeps the lifecycle. Every refusal is OpenAI-style JSON with the right status; nothing
refused ever reaches a worker.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncGenerator, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from appliance.api.admin_sessions import SessionAdmin, session_routes
from appliance.api.errors import ApiError, error_response, from_exception
from appliance.api.requests import (
    Tokenizer,
    agent_headers,
    chat_encoder,
    check_model_request,
    parse_json_body,
    tokenize_checked,
)
from appliance.domain.errors import ApplianceError
from appliance.domain.records import SessionId, TaskEventType, TenantId
from appliance.ports import Clock
from appliance.services.admission import AdmissionService
from appliance.services.sessions import SessionState, resumable
from appliance.services.tasks import TaskBook
from appliance.services.turn_desk import TurnDesk, TurnInput

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Caller:
    tenant: TenantId
    admin: bool


@dataclass
class ApiContext:
    desk: TurnDesk
    """A model turn's whole order, from here to its last record."""
    tasks: TaskBook
    tokenizer: Tokenizer
    keys: Mapping[str, Caller]
    clock: Clock
    model: str
    max_model_len: int
    state: Callable[[], dict[str, Any]]
    metrics: Callable[[], str]
    costs: Callable[[], list[dict[str, Any]]]
    """Cost per successful task by task class and tenant, read from the ledger."""
    admission: AdmissionService | None = None
    """Judges every new task and model turn before anything reaches a worker; None: all pass."""
    sessions_admin: SessionAdmin | None = None
    """One session's detail and its release (`/admin/v1/sessions/{id}`); None: no routes."""


MODEL_PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})


class ApiApp:
    """The API as one ASGI app. A POST to a model route, which every agent turn is, goes
    straight to its handler; everything else (other methods included) through Starlette's
    middleware and route matching, which would add about 0.1 ms to each turn."""

    def __init__(self, model_route: Callable[[Request], Any], rest: Starlette) -> None:
        self._model_route = model_route
        self.rest = rest

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and scope["path"] in MODEL_PATHS:
            response = await self._model_route(Request(scope, receive))
            await response(scope, receive, send)
            return
        await self.rest(scope, receive, send)


def create_app(ctx: ApiContext) -> ApiApp:
    encoder = chat_encoder(ctx.tokenizer)  # one per app: it remembers long prompt pieces

    def caller(request: Request, *, admin: bool = False) -> Caller:
        return caller_of(request.headers, admin=admin)

    def caller_of(headers: Mapping[str, str], *, admin: bool = False) -> Caller:
        auth = headers.get("authorization", "")
        scheme, _, key = auth.partition(" ")
        who = ctx.keys.get(key.strip()) if scheme.lower() == "bearer" else None
        if who is None:
            raise ApiError(
                401,
                "missing or unknown API key: send 'Authorization: Bearer <key>'",
                "invalid_api_key",
            )
        if admin and not who.admin:
            raise ApiError(403, "this route needs an operator key", "not_admin")
        return who

    async def model_request(request: Request) -> Response | RelayedStream:
        headers = _headers_of(request.scope)
        who = caller_of(headers)
        body = parse_json_body(await request.body())
        hdr = agent_headers(headers, body)
        path = request.scope["path"]
        max_tokens = check_model_request(path, body, ctx.model)
        salt = body.get("cache_salt")
        if salt is not None and not isinstance(salt, str):
            raise ApiError(400, "'cache_salt' must be a string", "invalid_type", param="cache_salt")
        plain = (
            path.endswith("chat/completions")
            and encoder is not None
            and body.get("add_generation_prompt", True) is True
        )
        reply = await ctx.desk.run(
            TurnInput(
                tenant=who.tenant,
                path=path,
                body=body,
                tokenize=lambda previous: tokenize_checked(
                    path,
                    body,
                    ctx.tokenizer,
                    max_tokens=max_tokens,
                    max_model_len=ctx.max_model_len,
                    previous=previous,
                    encoder=encoder,
                ),
                estimate=lambda session: (
                    untokenised_estimate(session, body, max_tokens) if plain else None
                ),
                messages=body["messages"] if plain else None,
                task_id=hdr.task_id,
                session_id=SessionId(hdr.session_id) if hdr.session_id else None,
                parent_task_id=hdr.parent_task_id,
                deadline_s=hdr.deadline_s,
                priority=hdr.priority,
                tool_class=hdr.tool_class,
                expected_wait_s=hdr.expected_wait_s,
                client_salt=salt,
                received_at=_received_at(request),
            )
        )
        if reply.chunks is not None:
            return RelayedStream(reply.chunks, reply.headers, on_end=reply.on_end)
        return Response(reply.body, reply.status, reply.headers, "application/json")

    def untokenised_estimate(
        session: SessionState | None, body: dict[str, Any], max_tokens: int | None
    ) -> int | None:
        """The likely prompt length of a turn that may be forwarded before it is tokenised
        (it only appends text to its session's last turn, and cannot exceed the model's
        length); None: tokenise it first."""
        appended = resumable(session, body["messages"])
        if appended is None or session is None or session.chat is None:
            return None
        bound = appended.token_bound(len(session.token_ids)) + (max_tokens or 1)
        return appended.token_estimate(session.chat) if bound <= ctx.max_model_len else None

    async def models(request: Request) -> Response:
        caller(request)
        card = {
            "id": ctx.model,
            "object": "model",
            "owned_by": "appliance",
            "max_model_len": ctx.max_model_len,
        }
        return JSONResponse({"object": "list", "data": [card]})

    async def create_task(request: Request) -> Response:
        who = caller(request)
        body = parse_json_body(await request.body()) if await request.body() else {}
        client_id = body.get("task_id") or f"task-{uuid.uuid4().hex[:16]}"
        for name, kind in (("task_id", str), ("parent_task_id", str), ("task_class", str)):
            if body.get(name) is not None and not isinstance(body[name], kind):
                raise ApiError(400, f"'{name}' must be a string", "invalid_type", param=name)
        deadline = body.get("deadline_s")
        if deadline is not None and (not isinstance(deadline, int | float) or deadline <= 0):
            raise ApiError(
                400, "'deadline_s' must be a number > 0", "invalid_value", param="deadline_s"
            )
        max_children = body.get("max_children")
        if max_children is not None and (
            not isinstance(max_children, int) or isinstance(max_children, bool) or max_children < 0
        ):
            raise ApiError(
                400, "'max_children' must be an integer >= 0", "invalid_value", param="max_children"
            )
        parent_id = body.get("parent_task_id")
        if ctx.admission is not None:
            await ctx.admission.admit_task(
                who.tenant,
                ctx.tasks.key(who.tenant, client_id),
                parent=ctx.tasks.key(who.tenant, parent_id) if parent_id else None,
                max_children=max_children,
                deadline_s=deadline,
                priority=agent_headers(request.headers, {}).priority,
            )
        task = ctx.tasks.create(
            who.tenant,
            client_id,
            ctx.clock.now(),
            parent_id=parent_id,
            task_class=body.get("task_class"),
            deadline_s=deadline,
            budget=body.get("budget"),
            max_children=max_children,
        )
        await _written(task.written)
        return JSONResponse(
            {"task_id": client_id, "deadline_at": task.deadline_at, "status": task.status.value},
            status_code=201,
        )

    async def task_event(request: Request) -> Response:
        who = caller(request)
        body = parse_json_body(await request.body())
        try:
            kind = TaskEventType(body.get("type"))
        except ValueError:
            allowed = ", ".join(t.value for t in TaskEventType)
            raise ApiError(
                400, f"'type' must be one of {allowed}", "invalid_value", param="type"
            ) from None
        verified = body.get("verified")
        if verified is not None and not isinstance(verified, bool):
            raise ApiError(
                400, "'verified' must be true or false", "invalid_type", param="verified"
            )
        task = ctx.tasks.event(
            who.tenant,
            request.path_params["task_id"],
            kind,
            ctx.clock.now(),
            verified=verified,
            evidence=body.get("evidence"),
            tool_class=body.get("tool_class"),
            expected_s=body.get("expected_s"),
        )
        if ctx.admission is not None and kind.terminal_status is not None:
            ctx.admission.task_closed(task.key)
        await _written(task.written)
        return JSONResponse({"task_id": task.client_id, "status": task.status.value})

    async def cancel_task(request: Request) -> Response:
        who = caller(request)
        cancelled = ctx.tasks.cancel(who.tenant, request.path_params["task_id"], ctx.clock.now())
        for task in cancelled:
            if ctx.admission is not None:
                ctx.admission.task_closed(task.key)
            await _written(task.written)
        return JSONResponse({"cancelled": [t.client_id for t in cancelled]})

    async def get_task(request: Request) -> Response:
        who = caller(request)
        task = ctx.tasks.get(who.tenant, request.path_params["task_id"])
        if task is None:
            raise ApiError(
                404, f"task {request.path_params['task_id']} not found", "task_not_found"
            )
        return JSONResponse(ctx.tasks.tree(task))

    async def admin_state(request: Request) -> Response:
        caller(request, admin=True)
        return JSONResponse(ctx.state())

    async def admin_sessions(request: Request) -> Response:
        caller(request, admin=True)
        return JSONResponse({"sessions": ctx.state()["sessions"]})

    async def admin_costs(request: Request) -> Response:
        caller(request, admin=True)
        return JSONResponse({"costs": await asyncio.to_thread(ctx.costs)})

    async def metrics(request: Request) -> Response:
        return PlainTextResponse(ctx.metrics(), media_type="text/plain; version=0.0.4")

    async def health(request: Request) -> Response:
        healthy = any(w["healthy"] for w in ctx.state()["workers"])
        return JSONResponse(
            {"status": "ok" if healthy else "no healthy worker"},
            status_code=200 if healthy else 503,
        )

    def guarded(handler: Callable[[Request], Any]) -> Callable[[Request], Any]:
        async def run(request: Request) -> Response:
            try:
                response: Response = await handler(request)
                return response
            except ApplianceError as exc:
                return from_exception(exc)
            except Exception:
                log.exception("unexpected error on %s", request.url.path)
                return error_response(500, "internal error; see the appliance log", "internal")

        return run

    routes = [
        *(Route(path, guarded(model_request), methods=["POST"]) for path in sorted(MODEL_PATHS)),
        Route("/v1/models", guarded(models), methods=["GET"]),
        Route("/v1/tasks", guarded(create_task), methods=["POST"]),
        Route("/v1/tasks/{task_id}", guarded(get_task), methods=["GET"]),
        Route("/v1/tasks/{task_id}/events", guarded(task_event), methods=["POST"]),
        Route("/v1/tasks/{task_id}/cancel", guarded(cancel_task), methods=["POST"]),
        Route("/admin/v1/state", guarded(admin_state), methods=["GET"]),
        Route("/admin/v1/sessions", guarded(admin_sessions), methods=["GET"]),
        Route("/admin/v1/costs", guarded(admin_costs), methods=["GET"]),
        *(
            session_routes(ctx.sessions_admin, ctx.clock, lambda r: caller(r, admin=True), guarded)
            if ctx.sessions_admin is not None
            else []
        ),
        Route("/metrics", guarded(metrics), methods=["GET"]),
        Route("/health", guarded(health), methods=["GET"]),
    ]
    return ApiApp(guarded(model_request), Starlette(routes=routes))


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


async def _written(fut: Any) -> None:
    """Waits for the ledger to acknowledge a change before the client hears it is done."""
    if fut is not None:
        await asyncio.wrap_future(fut)
