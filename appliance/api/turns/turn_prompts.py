"""The turn desk's tokenizer port (`services.turns.turn.TurnTokenizer`) as the API fills it:
each route's prompt (a chat, a completion, a Messages API turn made a chat, a Responses
turn's rendered input with the special tokens vLLM's Responses route adds) tokenised as vLLM
will, refused in its API's words when too long for the model; and how long a chat turn that
only appends text to its session's last turn likely is, so it may go before it is tokenised."""

from __future__ import annotations

from collections.abc import Sequence
from functools import cached_property
from typing import Any

from appliance.api.turns.context_limit import ContextTooLong
from appliance.api.turns.requests import Tokenizer, chat_encoder, tokenize_checked
from appliance.services.sessions.appended_text import resumable
from appliance.services.sessions.chat_tokens import ChatTokens
from appliance.services.sessions.sessions import SessionState
from appliance.services.turns.turn import TurnRequest

CHAT_PATH = "/v1/chat/completions"
RESPONSES_PATH = "/v1/responses"


class ApiTurnTokenizer:
    """One per app: its chat encoders remember long prompts."""

    def __init__(self, tokenizer: Tokenizer, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self._max_model_len = max_model_len
        self._chat_encoder = chat_encoder(tokenizer)
        self._responses_encoder = chat_encoder(tokenizer)

    @cached_property
    def lead(self) -> list[int] | None:
        """The ids the tokenizer's special tokens put before a text (vLLM's Responses route
        adds them), or None when they put any elsewhere too. Asked on the first turn."""
        return special_lead(self.tokenizer)

    def tokenize(
        self, turn: TurnRequest, previous: ChatTokens | None
    ) -> tuple[Sequence[int], ChatTokens | None]:
        """The prompt's ids (`tokenize_checked`); too long for the model: refused in the
        words of the turn's API."""
        if turn.path == RESPONSES_PATH:
            return self._responses_ids(turn, previous)
        try:
            return tokenize_checked(
                turn.path,
                turn.body,
                self.tokenizer,
                max_tokens=turn.max_tokens,
                max_model_len=self._max_model_len,
                previous=previous,
                encoder=self._chat_encoder,
                answer_counts=turn.messages_api,
            )
        except ContextTooLong as exc:
            if turn.messages_api:
                raise exc.in_anthropic_words() from None
            raise

    def estimate(self, turn: TurnRequest, session: SessionState | None) -> int | None:
        """The likely prompt length of a plain chat turn (`turn.messages` set) that may be
        forwarded before it is tokenised (it only appends text to its session's last turn,
        and cannot exceed the model's length with `max_tokens`, or one token when None, or
        for any but a Messages API turn); None: tokenise it first."""
        if turn.messages is None:
            return None
        max_tokens = turn.max_tokens if turn.messages_api else None
        appended = resumable(session, turn.body["messages"])
        if appended is None or session is None or session.chat is None:
            return None
        bound = appended.token_bound(len(session.token_ids)) + (max_tokens or 1)
        return appended.token_estimate(session.chat) if bound <= self._max_model_len else None

    def _responses_ids(
        self, turn: TurnRequest, last: ChatTokens | None
    ) -> tuple[Sequence[int], ChatTokens | None]:
        """The prompt's ids as vLLM's Responses route makes them: the rendered chat (with the
        function tools, in chat's shape, as its template renders them) tokenised with the
        tokenizer's special tokens (chat's route adds none), so a template that writes its
        own BOS gets a second one there too."""
        messages, tools, max_tokens = list(turn.conversation or ()), turn.tools, turn.max_tokens
        chat: dict[str, Any] = {"messages": messages}
        if tools:
            chat["tools"] = tools
        lead, tok, limit = self.lead, self.tokenizer, self._max_model_len
        if lead is None:  # the specials are not only leading: the whole chat tokenised again
            tokenize_checked(CHAT_PATH, chat, tok, max_tokens=max_tokens, max_model_len=limit)
            kw: dict[str, Any] = {"tools": tools} if tools else {}
            return tok.encode_chat(
                messages, add_generation_prompt=True, add_special_tokens=True, **kw
            ), None
        try:
            ids, rendered = tokenize_checked(
                CHAT_PATH,
                chat,
                tok,
                max_tokens=max_tokens,
                max_model_len=limit - len(lead),
                previous=last,
                encoder=self._responses_encoder,
            )
        except ContextTooLong as exc:  # counted with the lead, as vLLM counts the prompt
            raise exc.shifted(len(lead)) from None
        return [*lead, *ids], rendered


def special_lead(tokenizer: Tokenizer) -> list[int] | None:
    """The ids `tokenizer`'s special tokens put before a text, or None when they put any
    elsewhere too."""
    plain = tokenizer.encode("hello", add_special_tokens=False)
    full = tokenizer.encode("hello", add_special_tokens=True)
    n = len(full) - len(plain)
    return list(full[:n]) if n >= 0 and list(full[n:]) == list(plain) else None
