"""A turn's prompt, through the desk's tokenizer port: tokenised before it is placed, or,
when it may go first (services/turns/turn_desk.py), tokenised and hashed while its worker
prefills, so that the session's next turn finds its chat and chain."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import replace

from appliance.services.sessions.chat_tokens import ChatTokens
from appliance.services.sessions.sessions import SessionState, SessionTable
from appliance.services.turns.turn import Attempt, TurnRequest, TurnTokenizer

log = logging.getLogger(__name__)


def tokenize_sent(
    sessions: SessionTable,
    salt: str,
    prompt: Callable[[], tuple[Sequence[int], ChatTokens | None]],
    session: SessionState,
    attempt: Attempt,
) -> None:
    """Tokenises (`prompt`: the desk's tokenizer on the turn) and hashes a turn forwarded
    untokenised (`salt`: its tenant's cache salt), for the session's next turn."""
    try:
        ids, chat = prompt()
    except Exception as exc:  # the worker judges the request itself; the next turn
        log.info("turn of session %s not tokenised: %s", session.session_id, exc)
        sessions.untokenised(session)  # ... is tokenised before it is placed
        return
    sessions.keep_chat(session, chat)
    chain = sessions.hash_prompt(session, ids, salt)
    if chain.hashes and attempt.first_byte_at is None:
        attempt.prefix_digest = chain.hashes[-1].hex()
        attempt.prefix_tokens = len(chain.hashes) * chain.block_size


def with_prompt(
    tokenizer: TurnTokenizer | None, turn: TurnRequest, session: SessionState | None
) -> TurnRequest:
    """The turn with its prompt's ids, or with their estimate when it may go before it is
    tokenised (`tokenize_sent` then, after `previous_chat`); None: it came tokenised."""
    if tokenizer is None:
        return turn
    previous = session.chat if session else None
    estimate = tokenizer.estimate(turn, session)
    if estimate is not None:
        return replace(turn, previous_chat=previous, estimated_tokens=estimate)
    ids, chat = tokenizer.tokenize(turn, previous)
    return replace(turn, prompt_ids=ids, chat=chat, estimated_tokens=len(ids))
