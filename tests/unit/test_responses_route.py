"""The Responses route's parts: the chat messages a request renders as (vLLM's rules), the
book of stored responses, the learning of a stream's `response.completed` however the socket
cut it, and the Responses usage shape read as chat's."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator

import pytest

from appliance.api.responses_route import ResponseBook, StoredResponse, _learning
from appliance.domain.records import SessionId, TenantId, WorkerId
from appliance.domain.responses_input import ResponsesInputError, input_messages
from appliance.services.forwarder import UsageScanner

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
