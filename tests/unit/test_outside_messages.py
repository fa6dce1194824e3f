"""A chat turn as an Anthropic Messages request and its answer back as chat, for an outside
endpoint of kind `anthropic` (services/escalation/anthropic_out.py, anthropic_back.py)."""

from __future__ import annotations

import orjson

from appliance.services.escalation.anthropic_back import ChatChunks, chat_answer
from appliance.services.escalation.anthropic_out import DEFAULT_MAX_TOKENS, messages_body

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}}


def test_a_chat_with_tools_becomes_a_messages_request() -> None:
    chat = {
        "model": "sim",
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "Oslo?"}]},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "c1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "rain"},
            {"role": "user", "content": "thanks"},
        ],
        "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}],
        "tool_choice": "required",
        "stop": "END",
        "temperature": 0.1,
        "session_id": "alice/s1",
        "cache_salt": "t:secret",
    }
    sent = messages_body(chat, "claude-x")
    assert sent == {
        "model": "claude-x",
        "max_tokens": DEFAULT_MAX_TOKENS,
        "system": "be brief",
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Oslo?"}]},
            {
                "role": "assistant",
                "content": [
                    {
                        "type": "tool_use",
                        "id": "c1",
                        "name": "get_weather",
                        "input": {"city": "Oslo"},
                    }
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "c1", "content": "rain"},
                    {"type": "text", "text": "thanks"},
                ],
            },
        ],
        "temperature": 0.1,
        "stop_sequences": ["END"],
        "tools": [{"name": "get_weather", "description": "", "input_schema": WEATHER}],
        "tool_choice": {"type": "any"},
    }


def test_a_message_comes_back_as_a_chat_completion_with_its_usage() -> None:
    message = {
        "id": "msg_1",
        "type": "message",
        "role": "assistant",
        "model": "claude-x",
        "content": [
            {"type": "text", "text": "Let me look."},
            {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "Oslo"}},
        ],
        "stop_reason": "tool_use",
        "usage": {
            "input_tokens": 10,
            "cache_read_input_tokens": 90,
            "cache_creation_input_tokens": 5,
            "output_tokens": 7,
        },
    }
    chat = orjson.loads(chat_answer(orjson.dumps(message)))
    choice = chat["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Let me look."
    (call,) = choice["message"]["tool_calls"]
    assert (call["id"], call["function"]["name"]) == ("t1", "get_weather")
    assert orjson.loads(call["function"]["arguments"]) == {"city": "Oslo"}
    assert chat["usage"] == {
        "prompt_tokens": 105,
        "completion_tokens": 7,
        "total_tokens": 112,
        "prompt_tokens_details": {"cached_tokens": 90},
    }


def sse(*events: dict[str, object]) -> bytes:
    return b"".join(
        b"event: " + str(e["type"]).encode() + b"\ndata: " + orjson.dumps(e) + b"\n\n"
        for e in events
    )


def test_an_event_stream_becomes_chat_chunks_whatever_its_pieces() -> None:
    stream = sse(
        {
            "type": "message_start",
            "message": {
                "id": "m",
                "model": "claude-x",
                "usage": {"input_tokens": 12, "output_tokens": 1},
            },
        },
        {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
        {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "Hi"}},
        {
            "type": "content_block_start",
            "index": 1,
            "content_block": {"type": "tool_use", "id": "t1", "name": "get_weather"},
        },
        {
            "type": "content_block_delta",
            "index": 1,
            "delta": {"type": "input_json_delta", "partial_json": '{"city": '},
        },
        {
            "type": "content_block_delta",
            "index": 1,
            "delta": {"type": "input_json_delta", "partial_json": '"Oslo"}'},
        },
        {
            "type": "message_delta",
            "delta": {"stop_reason": "tool_use"},
            "usage": {"output_tokens": 9},
        },
        {"type": "message_stop"},
    )
    chunks = ChatChunks()
    out = b"".join(chunks.feed(stream[i : i + 7]) for i in range(0, len(stream), 7))
    got = [orjson.loads(line[6:]) for line in out.split(b"\n\n") if line]
    deltas = [c["choices"][0]["delta"] for c in got if c["choices"]]
    text = "".join(d.get("content") or "" for d in deltas)
    calls = [t for d in deltas for t in d.get("tool_calls") or []]
    assert text == "Hi"
    assert calls[0]["function"]["name"] == "get_weather" and calls[0]["id"] == "t1"
    assert "".join(c["function"]["arguments"] for c in calls) == '{"city": "Oslo"}'
    assert [c["choices"][0]["finish_reason"] for c in got if c["choices"]][-1] == "tool_calls"
    assert got[-1]["usage"] == {
        "prompt_tokens": 12,
        "completion_tokens": 9,
        "total_tokens": 21,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
