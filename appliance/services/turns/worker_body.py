"""The body a turn goes to its worker with: the client's, with the fields the appliance sets
on every turn (the tenant's cache salt, the session's retention key, the priority, and for
a stream the usage the ledger needs)."""

from __future__ import annotations

from typing import Any

from appliance.policy.routing.turn_order import turn_priority
from appliance.services.sessions.sessions import SessionState
from appliance.services.turns.turn import TurnRequest


def worker_body(
    turn: TurnRequest, session: SessionState, salt: str, prefill_s: float
) -> dict[str, Any]:
    """`prefill_s`: the router's estimate of the turn's prefill on its worker."""
    body = dict(turn.body)
    body["cache_salt"] = salt
    body["session_id"] = f"{turn.tenant}/{session.session_id}"
    # vLLM's priority scheduling runs the lowest value first: the granted priority, then
    # the shortest prefill. The client's own field is overwritten, so a tenant's ceiling binds.
    body["priority"] = turn_priority(turn.priority, prefill_s)
    if turn.stream:
        opts = dict(body.get("stream_options") or {})
        opts["include_usage"] = True  # the ledger needs the worker's own counts
        body["stream_options"] = opts
    return body
