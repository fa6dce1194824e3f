"""The model list, the operator's routes (state, sessions, costs) and the unauthenticated
ones (`/metrics`, `/health`)."""

from __future__ import annotations

import asyncio

from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from appliance import __version__
from appliance.api.admin import schemas
from appliance.api.admin.state_document import admin_state
from appliance.api.context import ApiContext, Guard


class AdminRoutes:
    def __init__(self, ctx: ApiContext) -> None:
        self._ctx = ctx

    def routes(self, guarded: Guard) -> list[Route]:
        return [
            Route("/v1/models", guarded(self.models), methods=["GET"]),
            Route("/admin/v1/state", guarded(self.admin_state), methods=["GET"]),
            Route("/admin/v1/sessions", guarded(self.admin_sessions), methods=["GET"]),
            Route("/admin/v1/costs", guarded(self.admin_costs), methods=["GET"]),
            Route("/metrics", guarded(self.metrics), methods=["GET"]),
            Route("/health", guarded(self.health), methods=["GET"]),
        ]

    async def models(self, request: Request) -> Response:
        """The served model first, then each alias of it (`*` is none), as vLLM lists each
        of its --served-model-name."""
        self._ctx.keys.caller(request.headers)
        names = [self._ctx.model, *(a for a in self._ctx.model_aliases if a != "*")]
        cards = [
            {
                "id": name,
                "object": "model",
                "owned_by": "appliance",
                "root": self._ctx.model,
                "max_model_len": self._ctx.max_model_len,
            }
            for name in dict.fromkeys(names)
        ]
        return JSONResponse({"object": "list", "data": cards})

    async def admin_state(self, request: Request) -> Response:
        self._ctx.keys.caller(request.headers, admin=True)
        document = admin_state(self._ctx.state())
        return Response(schemas.encode(document), media_type="application/json")

    async def admin_sessions(self, request: Request) -> Response:
        self._ctx.keys.caller(request.headers, admin=True)
        sessions = admin_state(self._ctx.state()).sessions
        return JSONResponse({"sessions": [schemas.plain(s) for s in sessions]})

    async def admin_costs(self, request: Request) -> Response:
        self._ctx.keys.caller(request.headers, admin=True)
        return JSONResponse({"costs": await asyncio.to_thread(self._ctx.costs)})

    async def metrics(self, request: Request) -> Response:
        return PlainTextResponse(self._ctx.metrics(), media_type="text/plain; version=0.0.4")

    async def health(self, request: Request) -> Response:
        failing = self._ctx.ledger_failing()
        if failing is not None:
            return JSONResponse(
                {"status": "degraded", "ledger": failing, "version": __version__}, status_code=503
            )
        healthy = self._ctx.healthy()
        return JSONResponse(
            {"status": "ok" if healthy else "no healthy worker", "version": __version__},
            status_code=200 if healthy else 503,
        )
