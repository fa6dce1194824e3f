"""What a chat turn appends to its session's last turn, when it only appends plain text: the
turn may then be placed and forwarded before it is tokenised (services/turns/turn_desk.py),
on a bound and an estimate of its length."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from appliance.services.sessions.chat_tokens import ChatTokens
from appliance.services.sessions.sessions import SessionState

TEMPLATE_MARGIN_TOKENS = 64
"""Tokens a chat template may add around one message (role markers, separators, special
tokens) or at the end (the generation prompt): a generous bound, not a measurement."""


@dataclass(frozen=True, slots=True)
class Appended:
    """What a chat turn adds to its session's last turn: `messages` messages of plain text,
    `text_bytes` bytes of it (UTF-8)."""

    messages: int
    text_bytes: int

    def token_bound(self, previous_tokens: int) -> int:
        """At most this many tokens in the new turn, after a last turn of `previous_tokens`.

        Why it bounds: a token covers at least one byte of text (byte-level BPE,
        SentencePiece with byte fallback, the simulator's words), so the appended text adds
        at most its UTF-8 length, and the template at most a margin per message and one for
        the generation prompt."""
        return previous_tokens + self.text_bytes + TEMPLATE_MARGIN_TOKENS * (self.messages + 1)

    def token_estimate(self, previous: ChatTokens) -> int:
        """The likely token count: the appended text at the last turn's tokens per byte."""
        per_byte = len(previous.ids) / max(1, len(previous.text))  # ASCII-heavy: chars ~ bytes
        return len(previous.ids) + round(self.text_bytes * per_byte) + 4 * self.messages


def resumable(session: SessionState | None, messages: Sequence[Any]) -> Appended | None:
    """What a chat turn appends to its session's last turn, when the turn may be placed and
    forwarded before it is tokenised: the session has no turn in flight, its last turn was
    tokenised incrementally (so it has `chat`, `messages` and a chain) and this turn only
    appends plain text to it. None: tokenise first."""
    if session is None or session.in_flight or session.chain is None:
        return None
    if session.chat is None or session.messages is None:
        return None
    return appended(session.messages, messages)


def appended(previous: Sequence[Any], messages: Sequence[Any]) -> Appended | None:
    """What `messages` append to `previous`, when they repeat it and append only messages
    of plain text fields; None otherwise (a rewritten history, parts, tool calls), and the
    turn must be tokenised before anything is decided."""
    n = len(previous)
    if len(messages) <= n or messages[:n] != previous:
        return None
    text_bytes = 0
    for message in messages[n:]:
        if not isinstance(message, dict):
            return None
        for value in message.values():
            if value is None:
                continue
            if not isinstance(value, str):
                return None  # parts, tool calls: rendered in ways a byte count cannot bound
            text_bytes += len(value.encode())
    return Appended(len(messages) - n, text_bytes)
