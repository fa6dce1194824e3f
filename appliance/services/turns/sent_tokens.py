"""A turn forwarded before it was tokenised (services/turns/turn_desk.py) is tokenised and hashed
while its worker prefills, so that the session's next turn finds its chat and chain."""

from __future__ import annotations

import logging

from appliance.services.sessions.sessions import SessionState, SessionTable
from appliance.services.turns.turn import Attempt, TurnRequest

log = logging.getLogger(__name__)


def tokenize_sent(
    sessions: SessionTable, salt: str, turn: TurnRequest, session: SessionState, attempt: Attempt
) -> None:
    """Tokenises and hashes a turn forwarded untokenised (`salt`: its tenant's cache salt),
    for the session's next turn."""
    assert turn.tokenize is not None
    try:
        ids, chat = turn.tokenize()
    except Exception as exc:  # the worker judges the request itself; the next turn
        log.info("turn of session %s not tokenised: %s", session.session_id, exc)
        sessions.untokenised(session)  # ... is tokenised before it is placed
        return
    sessions.keep_chat(session, chat)
    chain = sessions.hash_prompt(session, ids, salt)
    if chain.hashes and attempt.first_byte_at is None:
        attempt.prefix_digest = chain.hashes[-1].hex()
        attempt.prefix_tokens = len(chain.hashes) * chain.block_size
