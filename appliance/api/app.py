"""The appliance's HTTP API: OpenAI-compatible model routes, tasks, admin state, metrics.

Routes only translate HTTP to the services and back: `auth` names the tenant, `requests`
checks the body and headers, the turn desk runs a model turn's whole order, the task book
keeps the lifecycle. Every refusal is OpenAI-style JSON with the right status; nothing
refused ever reaches a worker. The routes live by group: `model_route`, `task_routes`,
`admin_routes`, `admin_sessions`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from appliance.api.admin.admin_routes import AdminRoutes
from appliance.api.admin.admin_sessions import session_routes
from appliance.api.context import ApiContext, Handler
from appliance.api.errors import error_response, from_exception
from appliance.api.tasks.task_routes import TaskRoutes
from appliance.api.turns.anthropic_messages import MESSAGES_PATH
from appliance.api.turns.anthropic_reply import anthropic_error
from appliance.api.turns.model_route import MODEL_PATHS, ModelRoute
from appliance.api.turns.responses_route import RESPONSES_PATH, ResponsesRoute
from appliance.domain.errors import ApplianceError

log = logging.getLogger(__name__)
ROUTED = MODEL_PATHS | {RESPONSES_PATH}


class ApiApp:
    """The API as one ASGI app. A POST to a model route, which every agent turn is, goes
    straight to its handler; everything else (other methods included) through Starlette's
    middleware and route matching, which would add about 0.1 ms to each turn."""

    def __init__(self, model_route: Callable[[Request], Any], rest: Starlette) -> None:
        self._model_route = model_route
        self.rest = rest

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and scope["path"] in ROUTED:
            with cancelled_when_gone(scope):
                response = await self._model_route(Request(scope, receive))
                await response(scope, receive, send)
            return
        await self.rest(scope, receive, send)


@contextmanager
def cancelled_when_gone(scope: dict[str, Any]) -> Iterator[None]:
    """Cancels the running model turn as soon as its client hangs up (the appliance's
    server says so by its `gone` future): the turn's attempt ends `cancelled`, its worker
    request is closed (the worker aborts it), and a failed attempt is never retried for a
    client that has gone. Other routes run to their end: they are short, and a task change
    half made is worse than one made for nobody."""
    closed: asyncio.Future[None] | None = (
        scope.get("extensions", {}).get("appliance", {}).get("gone")
    )
    task = asyncio.current_task()
    if closed is None or task is None:
        yield
        return
    watching = True

    def gone(_: asyncio.Future[None]) -> None:
        if watching:
            task.cancel()

    closed.add_done_callback(gone)
    try:
        yield
    finally:
        watching = False
        closed.remove_done_callback(gone)


def create_api_app(ctx: ApiContext) -> ApiApp:
    chat_route = messages_errors(guarded(ModelRoute(ctx)))
    responses_route = guarded(ResponsesRoute(ctx))

    def model_route(request: Request) -> Any:
        is_responses = request.scope["path"] == RESPONSES_PATH
        return (responses_route if is_responses else chat_route)(request)

    routes: list[Route] = [
        *(Route(path, model_route, methods=["POST"]) for path in sorted(ROUTED)),
        *TaskRoutes(ctx).routes(guarded),
        *AdminRoutes(ctx).routes(guarded),
    ]
    if ctx.sessions_admin is not None:

        def operator(request: Request) -> object:
            return ctx.keys.caller(request.headers, admin=True)

        routes += session_routes(ctx.sessions_admin, ctx.clock, operator, guarded)
    handlers = {HTTPException: _routing_refusal}
    return ApiApp(model_route, Starlette(routes=routes, exception_handlers=handlers))


_ROUTING_CODES = {404: "not_found", 405: "method_not_allowed"}


async def _routing_refusal(request: Request, exc: Exception) -> Response:
    """Starlette's own refusals (no such route: 404; a route without this method: 405), as
    the error JSON every other refusal is, not its plain text."""
    assert isinstance(exc, HTTPException)
    message = f"{request.method} {request.url.path}: {exc.detail}"
    response = error_response(
        exc.status_code, message, _ROUTING_CODES.get(exc.status_code, "http_error")
    )
    response.headers.update(exc.headers or {})
    return response


def messages_errors(handler: Handler) -> Handler:
    """The Anthropic Messages route's refusals in that API's error shape (its clients'
    SDKs read `{"type": "error", "error": {"type", "message"}}`); other routes' as they are."""

    async def run(request: Request) -> Response:
        response: Response = await handler(request)
        status = getattr(response, "status_code", 200)  # a relayed stream has begun: 200
        if request.scope["path"] != MESSAGES_PATH or status < 400:
            return response
        body = anthropic_error(response.status_code, bytes(response.body))
        headers = {k: v for k, v in response.headers.items() if k.lower() == "retry-after"}
        return Response(body, response.status_code, headers, "application/json")

    return run


def guarded(handler: Handler) -> Handler:
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
