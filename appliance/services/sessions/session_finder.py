"""The session of a turn that names none: the prefix chain.

A harness that sends no session id (no `X-Session-ID`, no id of its own, no Responses
chain: api/turns/requests.py `client_session`, the routes) still re-sends its whole conversation
every turn, and its next turn's messages begin with its last turn's. So a chat turn is the
next turn of the session whose last prompt its messages extend, if that session has no
turn in flight; else (no such session, or it is busy: a fork, or a second run of the same
task started at the same moment) it begins a new session, `chain-<hex>`.

How: the messages' rolling hashes, h_0 = sha256(tenant, model) and h_i = sha256(h_{i-1} +
the canonical JSON of message i) (keys sorted, top-level nulls dropped), so h_i names the
first i messages in this tenant's and model's scope. A chain session keeps its last prompt's
h_n, its tip, in the session table (`SessionTable.tip`: one entry per session there, gone
when it goes, so the table's bound is the map's); a new turn looks its hashes up longest
first (`SessionTable.by_tip`). It works on the messages alone, before the turn is tokenised,
and never on how a template renders an answer (the client's own copy of the answer comes
after the last prompt's messages). A session found is claimed (`SessionState.claimed`)
until its turn has begun (it is busy then) or failed first, so two turns never take one
idle session.
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import islice
from typing import Any

import orjson

from appliance.domain.records import SessionId, TenantId
from appliance.services.sessions.sessions import SessionState, SessionTable

MAX_CHAIN_MESSAGES = 100_000
"""A turn with more messages is not chained (a session of its one turn, as a completion that
names none): each turn hashes all its messages."""
BUSY_LOOKS = 64
"""Sessions with the same tip looked at for an idle one (the latest first)."""


@dataclass(frozen=True, slots=True)
class FoundSession:
    session_id: SessionId
    note: str
    """Said first in the turn's route decision: how its session was known."""
    tip: bytes
    """The chain hash of all the turn's messages: its session's tip once it begins."""
    claimed: SessionState | None
    """The idle session it continues, claimed by it until `let_go`."""


def prompt_chain(tenant: TenantId, model: str, messages: Sequence[Any]) -> list[bytes]:
    """The messages' rolling hashes h_1..h_n (module docstring)."""
    h = hashlib.sha256(b"appliance-chain\0%s\0%s" % (tenant.encode(), model.encode())).digest()
    hashes = []
    for message in messages:
        h = hashlib.sha256(h + _canonical(message)).digest()
        hashes.append(h)
    return hashes


def _canonical(message: Any) -> bytes:
    if isinstance(message, dict):
        message = {k: v for k, v in message.items() if v is not None}
    try:
        return orjson.dumps(message, option=orjson.OPT_SORT_KEYS)
    except TypeError:  # an integer past 64 bits: orjson's limit, not JSON's
        return repr(message).encode()


def find_session(
    sessions: SessionTable, tenant: TenantId, model: str, messages: Sequence[Any]
) -> FoundSession | None:
    """The session a turn of these messages continues (claimed), or a new one; None for a
    turn of no messages, or too many."""
    if not messages or len(messages) > MAX_CHAIN_MESSAGES:
        return None
    tips = prompt_chain(tenant, model, messages)
    n, holders = sessions.by_tip(tenant, tips)
    busy: SessionState | None = None
    for state in islice(holders, BUSY_LOOKS):
        if not state.in_flight and state.claimed is None:
            note = f"session from prefix chain (extends its last prompt's {n} messages)"
            found = FoundSession(state.session_id, note, tips[-1], state)
            sessions.claim(state, found)
            return found
        busy = busy or state
    if busy is not None:
        note = f"new session (forks {busy.session_id}, which has a turn in flight)"
    else:
        note = "new session (no id, no prefix match)"
    return FoundSession(SessionId(f"chain-{uuid.uuid4().hex[:16]}"), note, tips[-1], None)


def let_go(sessions: SessionTable, found: FoundSession | None) -> None:
    """The turn that claimed a session has begun (its session is busy), or failed first:
    other turns may find that session again (once it is idle)."""
    if found is not None and found.claimed is not None:
        sessions.unclaim(found.claimed, found)
