"""The Messages API as a chat turn: the chat request vLLM makes of a Messages request, and a
chat answer (whole, or its stream split anywhere) in the Messages API's shapes."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator

import orjson
import pytest

from appliance.api.errors import RequestRefused
from appliance.api.turns.anthropic_messages import chat_request, user_session
from appliance.api.turns.anthropic_reply import MessageEvents, message_body, usage


def test_system_blocks_tools_and_their_results_become_the_chat_vllm_makes() -> None:
    body = {
        "model": "m",
        "max_tokens": 64,
        "stop_sequences": ["END"],
        "temperature": 0.0,
        "system": [
            {"type": "text", "text": "x-anthropic-billing-header: cc=1;"},
            {"type": "text", "text": "You are terse."},
        ],
        "tools": [{"name": "grep", "description": "search", "input_schema": {"type": "object"}}],
        "tool_choice": {"type": "any"},
        "messages": [
            {"role": "user", "content": "find it"},
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": "looking"},
                    {"type": "tool_use", "id": "t1", "name": "grep", "input": {"q": "it"}},
                ],
            },
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "line 3"}],
            },
        ],
    }
    chat = chat_request(body)
    assert chat["messages"] == [
        {"role": "system", "content": "You are terse."},  # the per-request header dropped
        {"role": "user", "content": "find it"},
        {
            "role": "assistant",
            "content": "looking",
            "tool_calls": [
                {
                    "id": "t1",
                    "type": "function",
                    "function": {"name": "grep", "arguments": '{"q":"it"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "t1", "content": "line 3"},
    ]
    assert (chat["max_tokens"], chat["stop"], chat["temperature"]) == (64, ["END"], 0.0)
    assert chat["tool_choice"] == "required" and chat["parallel_tool_calls"] is True
    assert chat["tools"][0]["function"]["parameters"] == {"type": "object"}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
        ({"max_tokens": 0, "messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
        ({"max_tokens": 4, "messages": []}, "messages"),
        ({"max_tokens": 4, "messages": [{"role": "robot", "content": "x"}]}, "messages"),
        ({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "?"}]}]}, "messages"),
        (
            {
                "max_tokens": 4,
                "messages": [{"role": "user", "content": "x"}],
                "tool_choice": {"type": "maybe"},
            },
            "tool_choice",
        ),
    ],
)
def test_what_the_messages_api_refuses_is_refused_naming_the_field(
    body: dict[str, object], param: str
) -> None:
    with pytest.raises(RequestRefused) as refused:
        chat_request({"model": "m", **body})
    assert (refused.value.http_status, refused.value.param) == (400, param)


def test_metadata_user_id_names_the_session_and_nothing_else_does() -> None:
    """Claude Code's `metadata.user_id` carries its session; without one the route names no
    session (the desk finds it by the conversation's prefix:
    services/sessions/session_finder.py)."""
    first = {"system": "s", "messages": [{"role": "user", "content": "a"}]}
    assert user_session(first) is None
    assert user_session({**first, "metadata": {"user_id": ""}}) is None
    named = user_session({**first, "metadata": {"user_id": "u_session_9" * 100}})
    assert named is not None and named.startswith("anthropic-user-") and len(named) <= 64
    assert named != user_session({**first, "metadata": {"user_id": "u_session_8"}})


def test_usage_splits_the_prompt_into_fresh_and_cached() -> None:
    chat = {
        "prompt_tokens": 100,
        "completion_tokens": 7,
        "prompt_tokens_details": {"cached_tokens": 64},
    }
    assert usage(chat) == {"input_tokens": 36, "cache_read_input_tokens": 64, "output_tokens": 7}
    assert usage({"prompt_tokens": 5, "completion_tokens": 1}) == {
        "input_tokens": 5,
        "output_tokens": 1,
    }


def test_a_whole_answer_with_a_tool_call_is_a_message() -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "grep", "arguments": '{"q":1}'}}
    chat = {
        "id": "chatcmpl-1",
        "model": "m",
        "choices": [
            {
                "finish_reason": "tool_calls",
                "message": {"role": "assistant", "content": "ok", "tool_calls": [call]},
            }
        ],
        "usage": {"prompt_tokens": 10, "completion_tokens": 3},
    }
    msg = orjson.loads(message_body(orjson.dumps(chat)))
    used = {"type": "tool_use", "id": "c1", "name": "grep", "input": {"q": 1}}
    assert msg["content"] == [{"type": "text", "text": "ok"}, used]
    assert (msg["stop_reason"], msg["usage"]["input_tokens"]) == ("tool_use", 10)


def _sse(*chunks: dict[str, object]) -> bytes:
    return b"".join(b"data: " + orjson.dumps(c) + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"


def test_a_stream_split_anywhere_becomes_the_messages_event_stream() -> None:
    def delta(d: dict[str, object], finish: str | None = None) -> dict[str, object]:
        return {"id": "c", "model": "m", "choices": [{"delta": d, "finish_reason": finish}]}

    tool = {"index": 0, "id": "t1", "function": {"name": "grep", "arguments": '{"q":'}}
    raw = _sse(
        delta({"role": "assistant", "content": ""}),
        delta({"content": "Hel"}),
        delta({"content": "lo"}),
        delta({"tool_calls": [tool]}),
        delta({"tool_calls": [{"index": 0, "function": {"arguments": '"x"}'}}]}, "tool_calls"),
        {
            "id": "c",
            "model": "m",
            "choices": [],
            "usage": {"prompt_tokens": 9, "completion_tokens": 4},
        },
    )

    async def pieces() -> AsyncGenerator[bytes, None]:
        for i in range(0, len(raw), 7):  # lines cut across chunks
            yield raw[i : i + 7]

    async def run() -> list[bytes]:
        return [e async for e in MessageEvents().events(pieces())]

    events = [orjson.loads(e.split(b"data: ", 1)[1]) for e in asyncio.run(run())]
    kinds = [e["type"] for e in events]
    assert kinds == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    text = "".join(
        e["delta"]["text"]
        for e in events
        if e["type"] == "content_block_delta" and e["delta"]["type"] == "text_delta"
    )
    args = "".join(
        e["delta"]["partial_json"]
        for e in events
        if e["type"] == "content_block_delta" and e["delta"]["type"] == "input_json_delta"
    )
    assert (text, orjson.loads(args)) == ("Hello", {"q": "x"})
    assert events[5]["content_block"] == {
        "type": "tool_use",
        "id": "t1",
        "name": "grep",
        "input": {},
    }
    assert events[-2]["delta"]["stop_reason"] == "tool_use"
    assert events[-2]["usage"] == {"input_tokens": 9, "output_tokens": 4}
