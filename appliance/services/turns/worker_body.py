"""The body a turn goes to its worker with: the client's, with the fields the appliance sets
on every turn (the tenant's cache salt, the session's retention key, the priority, and for
a stream the usage the ledger needs)."""

from __future__ import annotations

from typing import Any

from appliance.services.sessions.sessions import SessionState
from appliance.services.turns.turn import TurnRequest


def worker_body(turn: TurnRequest, session: SessionState, salt: str) -> dict[str, Any]:
    body = dict(turn.body)
    body["cache_salt"] = salt
    body["session_id"] = f"{turn.tenant}/{session.session_id}"
    # vLLM's priority scheduling runs the lowest value first; the client's own field
    # is overwritten, so a tenant's ceiling binds.
    body["priority"] = -turn.priority
    if turn.stream:
        opts = dict(body.get("stream_options") or {})
        opts["include_usage"] = True  # the ledger needs the worker's own counts
        body["stream_options"] = opts
    return body
