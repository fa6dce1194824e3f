"""Operators' routes for one session: its detail and its release (operator key).

`GET /admin/v1/sessions/{id}?tenant=T[&turns=N]`: the session as the state shows it, its
residency per worker and tier (`gpu_held` until T, `gpu` not held, `host`, `gone`: the KV
index's view of its prefix there now and the worker's retention connector's holds,
appliance/services/residency/session_kv.py) and its newest N turns (default 50, at most 500), oldest
first, read from the ledger in a thread so the event loop never waits on the disk.
`POST /admin/v1/sessions/{id}/release?tenant=T`: releases the session's KV in every worker
that holds it (appliance/services/operator/session_admin.py); answered once its ledger row has
committed, with the tokens it had on a GPU: the state's `resident_tokens.gpu` of it.

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

from appliance.api.admin import schemas
from appliance.api.admin.state_document import session_document
from appliance.api.errors import RequestRefused
from appliance.ports import Clock
from appliance.services.operator.session_admin import RELEASE_REASON, RELEASED, SessionReleases
from appliance.services.operator.state import session_view
from appliance.services.residency.session_kv import SessionKv, SessionKvNow

DEFAULT_TURNS = 50
MAX_TURNS = 500
Handler = Callable[[Request], Any]


@dataclass
class SessionAdmin:
    releases: SessionReleases
    session_turns: Callable[[str, str, int], list[dict[str, Any]]]
    """(tenant, session id, limit) -> the session's newest turns from the ledger, oldest
    first; blocking (it reads the file)."""
    kv: SessionKv
    """Where the session's KV is now, and what was decided."""


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
        kv = admin.kv.now(session)
        view = session_view(session, clock.now(), per_token, kv)
        row = schemas.plain(session_document(view))
        residency = residency_rows(kv, per_token)
        return JSONResponse({"session": row, "residency": residency, "turns": turns})

    async def release(request: Request) -> Response:
        session = _find(request)
        on_gpu = admin.kv.now(session).most()["gpu"]  # what the state and the detail show
        done, written = releases.release(session, clock.now(), on_gpu)
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


def residency_rows(kv: SessionKvNow, per_token: int) -> list[dict[str, Any]]:
    """Per tier (`gpu_held`, `gpu` not held, `host`, `gone`), each worker with any of it."""
    rows = []
    for tier in ("gpu_held", "gpu", "host", "gone"):
        for w in kv.workers:
            n = {"gpu_held": w.held, "gpu": w.gpu - w.held, "host": w.host, "gone": w.gone}[tier]
            if n > 0:
                row: dict[str, Any] = {"worker": w.worker, "tier": tier, "tokens": n}
                row["bytes"] = n * per_token
                if tier == "gpu_held":
                    row["held_until"] = w.held_until
                rows.append(row)
    return rows


def _turns_param(raw: str | None) -> int:
    if raw is None:
        return DEFAULT_TURNS
    if not raw.isdigit() or not 1 <= int(raw) <= MAX_TURNS:
        raise RequestRefused(
            400, f"'turns' must be a whole number from 1 to {MAX_TURNS}", "invalid_value"
        )
    return int(raw)
