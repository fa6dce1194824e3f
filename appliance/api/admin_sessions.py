"""Operators' routes for one session: its detail and its release (operator key).

`GET /admin/v1/sessions/{id}?tenant=T[&turns=N]`: the session as the state shows it, its
residency per worker and tier (the tokens of its prefix the KV index sees there now) and its
newest N turns (default 50, at most 500), oldest first, read from the ledger in a thread so
the event loop never waits on the disk.
`POST /admin/v1/sessions/{id}/release?tenant=T`: drops the appliance's hold on the session's
KV (appliance/services/session_admin.py); answered once its ledger row has committed.

Session ids are chosen by each tenant, so `tenant` names whose session it is; it may be left
out when only one tenant has a session of that id. The id is the rest of the path and may
hold "/" (percent-encoded or not). 404: no such session; 409: a request of the session is in
flight; 400: an id several tenants use without `tenant`, or a bad `turns`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from appliance.api.errors import RequestRefused
from appliance.api.state_document import session_document
from appliance.domain.records import WorkerId
from appliance.ports import Clock
from appliance.services.session_admin import RELEASE_REASON, RELEASED, SessionReleases
from appliance.services.sessions import SessionState
from appliance.services.state import session_view

DEFAULT_TURNS = 50
MAX_TURNS = 500
Handler = Callable[[Request], Any]


@dataclass
class SessionAdmin:
    releases: SessionReleases
    session_turns: Callable[[str, str, int], list[dict[str, Any]]]
    """(tenant, session id, limit) -> the session's newest turns from the ledger, oldest
    first; blocking (it reads the file)."""
    residency: Callable[[SessionState], dict[str, dict[WorkerId, int]]]
    """The session's prefix as the KV index holds it now (`Router.residency`)."""


def session_routes(
    admin: SessionAdmin,
    clock: Clock,
    operator: Callable[[Request], object],
    guarded: Callable[[Handler], Handler],
) -> list[Route]:
    """The two routes; `operator` refuses a caller without an operator key."""
    releases = admin.releases

    def _find(request: Request) -> Any:
        operator(request)
        return releases.find(
            request.path_params["session_id"], request.query_params.get("tenant") or None
        )

    async def detail(request: Request) -> Response:
        session = _find(request)
        limit = _turns_param(request.query_params.get("turns"))
        turns = await asyncio.to_thread(
            admin.session_turns, session.tenant, session.session_id, limit
        )
        per_token = releases.kv_bytes_per_token
        held = admin.residency(session)
        view = session_view(session, clock.now(), per_token, held, releases.in_effect(session))
        row = session_document(view).model_dump(mode="json")
        residency = [
            {"worker": w, "tier": tier, "tokens": n, "bytes": n * per_token}
            for tier, workers in held.items()
            for w, n in sorted(workers.items())
            if n > 0
        ]
        return JSONResponse({"session": row, "residency": residency, "turns": turns})

    async def release(request: Request) -> Response:
        session = _find(request)
        done, written = releases.release(session, clock.now())
        if written is not None:
            await asyncio.wrap_future(written)
        return JSONResponse(
            {
                "session_id": session.session_id,
                "tenant": session.tenant,
                "released_tokens": done.tokens,
                "released_bytes": done.bytes,
                "decision": RELEASED,
                "reason": RELEASE_REASON,
            }
        )

    return [
        Route("/admin/v1/sessions/{session_id:path}/release", guarded(release), methods=["POST"]),
        Route("/admin/v1/sessions/{session_id:path}", guarded(detail), methods=["GET"]),
    ]


def _turns_param(raw: str | None) -> int:
    if raw is None:
        return DEFAULT_TURNS
    if not raw.isdigit() or not 1 <= int(raw) <= MAX_TURNS:
        raise RequestRefused(
            400, f"'turns' must be a whole number from 1 to {MAX_TURNS}", "invalid_value"
        )
    return int(raw)
