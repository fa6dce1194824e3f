"""The Responses route's parts: the chat messages a request renders as (vLLM's rules) and
its tokens (with its function tools, as the worker's template renders them), the book of
stored responses, the learning of a stream's `response.completed` however the socket
cut it, and the Responses usage shape read as chat's."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import pytest

from appliance.api.errors import RequestRefused
from appliance.api.turns.responses_route import (
    ResponseBook,
    ResponsesRoute,
    StoredResponse,
    _learning,
)
from appliance.api.turns.turn_prompts import RESPONSES_PATH, ApiTurnTokenizer, special_lead
from appliance.domain.records import SessionId, TenantId, WorkerId
from appliance.domain.responses_input import ResponsesInputError, input_messages
from appliance.domain.responses_tools import chat_tools
from appliance.services.turns.forwarder import UsageScanner
from appliance.services.turns.turn import TurnRequest

USAGE = {
    "input_tokens": 30,
    "input_tokens_details": {"cached_tokens": 16},
    "output_tokens": 4,
    "output_tokens_details": {"reasoning_tokens": 0},
    "total_tokens": 34,
}
RESPONSE = {
    "id": "resp_1",
    "output": [{"type": "message", "content": [{"text": "ok"}]}],
    "usage": USAGE,
}
STREAM = (
    b'event: response.created\ndata: {"type":"response.created","response":{"usage":null}}\n\n'
    + b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta"}\n\n'
    + b"event: response.completed\ndata: "
    + json.dumps({"type": "response.completed", "response": RESPONSE}).encode()
    + b"\n\n"
)


def test_a_chained_request_renders_as_vllm_renders_it() -> None:
    stored = ([{"role": "system", "content": "old"}, {"role": "user", "content": "a"}], ["b"])
    body = {
        "instructions": "new",
        "input": [{"role": "user", "content": [{"type": "input_text", "text": "c"}]}],
    }
    assert input_messages(body, stored) == [
        {"role": "system", "content": "new"},
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": [{"type": "text", "text": "c"}]},
    ]
    with pytest.raises(ResponsesInputError):
        input_messages({"input": [{"type": "function_call"}]})
    with pytest.raises(ResponsesInputError):
        input_messages({"input": []})


def test_the_book_forgets_the_oldest_and_keeps_tenants_apart() -> None:
    book = ResponseBook(limit=2)
    entry = StoredResponse(WorkerId("w0"), 0, [], [], SessionId("s"))
    for rid in ("r1", "r2", "r3"):
        book.learn(TenantId("alice"), rid, entry)
    assert book.get(TenantId("alice"), "r1") is None
    assert book.get(TenantId("alice"), "r3") == entry
    assert book.get(TenantId("bob"), "r3") is None


@pytest.mark.parametrize("piece", [1, 5, 64, len(STREAM)])
def test_a_streams_completed_response_is_learnt_whatever_the_cut(piece: int) -> None:
    learnt: list[dict[str, object]] = []

    async def source() -> AsyncGenerator[bytes, None]:
        for i in range(0, len(STREAM), piece):
            yield STREAM[i : i + piece]

    async def relay() -> bytes:
        return b"".join([data async for data in _learning(source(), learnt.append)])

    assert asyncio.run(relay()) == STREAM
    assert learnt == [RESPONSE]


def test_the_responses_usage_is_read_as_chats() -> None:
    scanner = UsageScanner()
    scanner.feed(STREAM)
    assert scanner.last is not None
    assert scanner.last["prompt_tokens"] == 30 and scanner.last["completion_tokens"] == 4
    assert scanner.last["prompt_tokens_details"] == {"cached_tokens": 16}


@dataclass
class _Worker:
    id: str
    healthy: bool = True
    restarts: int = 0


class _Tokenizer:
    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return [1] * add_special_tokens + [ord(c) for c in text]


def _route(workers: list[_Worker]) -> ResponsesRoute:
    ctx: Any = SimpleNamespace(tokenizer=_Tokenizer(), workers=lambda: workers)
    route = ResponsesRoute(ctx)
    entry = StoredResponse(WorkerId("w0"), 2, [], ["hi"], SessionId("chain"))
    route.book.learn(TenantId("alice"), "resp_1", entry)
    return route


@pytest.mark.parametrize(
    ("worker", "status", "code"),
    [
        (_Worker("w0", restarts=3), 404, "previous_response_lost"),
        (_Worker("w1", restarts=2), 404, "previous_response_lost"),
        (_Worker("w0", healthy=False, restarts=2), 503, "previous_response_unavailable"),
        (None, 404, "response_not_found"),
    ],
)
def test_a_chain_whose_worker_lost_it_is_refused(
    worker: _Worker | None, status: int, code: str
) -> None:
    route = _route([worker] if worker else [_Worker("w0", restarts=2)])
    pid = "resp_1" if worker else "resp_unknown"
    with pytest.raises(RequestRefused) as refused:
        route._chained(TenantId("alice"), {"previous_response_id": pid}, None, None)
    assert (refused.value.http_status, refused.value.code) == (status, code)


def test_a_chain_is_pinned_to_its_worker_and_keeps_its_session() -> None:
    route = _route([_Worker("w0", restarts=2), _Worker("w1")])
    alice, chain = TenantId("alice"), {"previous_response_id": "resp_1"}
    chained = route._chained(alice, chain, None, None)
    assert chained.previous is not None and chained.previous.worker == "w0"
    assert chained.session == "chain" and "pinned to w0" in (chained.note or "")
    assert chained.note.startswith("session from previous_response_id resp_1")  # type: ignore[union-attr]
    assert special_lead(_Tokenizer()) == [1]  # its BOS, which vLLM's Responses route adds
    # A session the turn names wins over the chain's; the turn stays pinned.
    named = route._chained(alice, chain, "hdr", "session from X-Session-ID")
    assert (named.session, named.previous) == ("hdr", chained.previous)
    assert named.note == (
        "session from X-Session-ID; pinned to w0, which stores previous_response_id resp_1"
    )


@pytest.mark.parametrize(
    ("conversation", "session"),
    [("conv_1", "conv_1"), ({"id": "conv_2"}, "conv_2"), (None, None)],
)
def test_a_conversation_names_the_session_else_the_desk_finds_it(
    conversation: object, session: str | None
) -> None:
    chained = _route([])._chained(TenantId("alice"), {"conversation": conversation}, None, None)
    assert chained.session == session and chained.previous is None
    assert chained.note == ("session from conversation" if session else None)


@pytest.mark.parametrize("conversation", [{"name": "x"}, 7, "x" * 257, {"id": ""}])
def test_a_bad_conversation_is_refused(conversation: object) -> None:
    with pytest.raises(RequestRefused) as refused:
        _route([])._chained(TenantId("alice"), {"conversation": conversation}, None, None)
    assert (refused.value.http_status, refused.value.param) == (400, "conversation")


class _ChatTokenizer(_Tokenizer):
    """Renders a chat as one id per message, and one per tool it was given."""

    def __init__(self) -> None:
        self.tools: list[Any] = []

    def encode_chat(self, messages: list[Any], **kw: Any) -> list[int]:
        self.tools.append(kw.get("tools"))
        return [7] * len(messages) + [9] * len(kw.get("tools") or [])


def test_the_prompt_is_tokenised_with_the_function_tools_as_the_worker_renders_it() -> None:
    tok = _ChatTokenizer()
    grep = {"type": "function", "name": "grep", "parameters": {"type": "object"}}
    body = {
        "input": [
            {"role": "user", "content": "grep"},
            {"type": "function_call", "call_id": "c1", "name": "grep", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "3 matches"},
        ],
        "tools": [grep, {"type": "web_search"}],
    }
    messages = input_messages(body)
    turn = TurnRequest(
        TenantId("alice"), RESPONSES_PATH, body, conversation=messages, tools=chat_tools(body)
    )
    ids, _ = ApiTurnTokenizer(tok, 100).tokenize(turn, None)
    assert list(ids) == [1, 7, 7, 7, 9]  # the lead (BOS), three messages, one function tool
    function = {"name": "grep", "description": None, "parameters": {"type": "object"}}
    assert tok.tools == [[{"type": "function", "function": function}]]
