"""An Anthropic Messages answer as a chat answer, for an endpoint of kind `anthropic`: the
turn desk, the ledger and every API route read chat answers. A message becomes a chat
completion (text, `tool_use` blocks as tool calls, the stop reason as a finish reason, the
usage with its cache reads as cached prompt tokens); an event stream becomes chat chunks
(`ChatChunks`), its last a usage chunk and `data: [DONE]`."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import orjson

FINISH = dict(
    end_turn="stop",
    stop_sequence="stop",
    max_tokens="length",
    tool_use="tool_calls",
    pause_turn="stop",
    refusal="content_filter",
)
"""A stop reason's chat finish reason."""
DONE = b"data: [DONE]\n\n"


def chat_usage(usage: dict[str, Any]) -> dict[str, Any]:
    """Anthropic's usage in the chat API's shape: every prompt token (fresh, written to the
    cache, read from it) in prompt_tokens, the cache reads as its cached tokens."""
    cached = int(usage.get("cache_read_input_tokens") or 0)
    written = int(usage.get("cache_creation_input_tokens") or 0)
    prompt = int(usage.get("input_tokens") or 0) + cached + written
    output = int(usage.get("output_tokens") or 0)
    counts = {"prompt_tokens": prompt, "completion_tokens": output}
    return counts | {
        "total_tokens": prompt + output,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def chat_answer(raw: bytes) -> bytes:
    """A Messages API message as a chat completion."""
    doc = orjson.loads(raw)
    blocks = doc.get("content") or []
    text = "".join(b.get("text", "") for b in blocks if b.get("type") == "text")
    calls = [_call(b) for b in blocks if b.get("type") == "tool_use"]
    message: dict[str, Any] = {"role": "assistant", "content": text or None}
    if calls:
        message["tool_calls"] = calls
    finish = FINISH.get(doc.get("stop_reason") or "", "stop")
    return orjson.dumps(
        {
            "id": doc.get("id"),
            "object": "chat.completion",
            "created": int(time.time()),
            "model": doc.get("model"),
            "choices": [{"index": 0, "message": message, "finish_reason": finish}],
            "usage": chat_usage(doc.get("usage") or {}),
        }
    )


def _call(block: dict[str, Any]) -> dict[str, Any]:
    arguments = orjson.dumps(block.get("input") or {}).decode()
    function = {"name": block.get("name"), "arguments": arguments}
    return {"id": block.get("id"), "type": "function", "function": function}


class ChatChunks:
    """A Messages API event stream, fed as its bytes arrive, as chat completion chunks."""

    def __init__(self) -> None:
        self._tail = b""
        self._head: dict[str, Any] = {"object": "chat.completion.chunk", "created": 0}
        self._usage: dict[str, Any] = {}
        self._tools: dict[int, int] = {}  # content block index -> tool call index

    def feed(self, data: bytes) -> bytes:
        """The chat SSE bytes of the complete events in what has arrived so far."""
        buffer = self._tail + data
        end = buffer.rfind(b"\n") + 1
        complete, self._tail = buffer[:end], buffer[end:]
        out = []
        for line in complete.split(b"\n"):
            if line.startswith(b"data:"):
                for chunk in self._chunks(orjson.loads(line[5:])):
                    out.append(b"data: " + orjson.dumps(chunk) + b"\n\n")
        return b"".join(out)

    def _chunks(self, event: dict[str, Any]) -> list[dict[str, Any]]:
        kind = event.get("type")
        if kind == "message_start":
            message = event.get("message") or {}
            self._head |= {"id": message.get("id"), "model": message.get("model")}
            self._head["created"] = int(time.time())
            self._usage = dict(message.get("usage") or {})
            return [self._delta({"role": "assistant", "content": ""})]
        if kind == "content_block_start":
            return self._block(event.get("index", 0), event.get("content_block") or {})
        if kind == "content_block_delta":
            return self._piece(event.get("index", 0), event.get("delta") or {})
        if kind == "message_delta":
            self._usage |= {k: v for k, v in (event.get("usage") or {}).items() if v is not None}
            reason = (event.get("delta") or {}).get("stop_reason") or ""
            return [self._delta({}, FINISH.get(reason, "stop"))]
        if kind == "message_stop":
            return [self._head | {"choices": [], "usage": chat_usage(self._usage)}]
        if kind == "error":
            raise RuntimeError(str((event.get("error") or {}).get("message") or event))
        return []

    def _block(self, index: int, block: dict[str, Any]) -> list[dict[str, Any]]:
        if block.get("type") == "tool_use":
            n = self._tools[index] = len(self._tools)
            function = {"name": block.get("name"), "arguments": ""}
            call = {"index": n, "id": block.get("id"), "type": "function", "function": function}
            return [self._delta({"tool_calls": [call]})]
        if block.get("type") == "text" and block.get("text"):
            return [self._delta({"content": block["text"]})]
        return []

    def _piece(self, index: int, delta: dict[str, Any]) -> list[dict[str, Any]]:
        if delta.get("type") == "text_delta":
            return [self._delta({"content": delta.get("text", "")})]
        if delta.get("type") == "input_json_delta" and index in self._tools:
            function = {"arguments": delta.get("partial_json", "")}
            call = {"index": self._tools[index], "function": function}
            return [self._delta({"tool_calls": [call]})]
        return []

    def _delta(self, delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        choice = {"index": 0, "delta": delta, "finish_reason": finish}
        return self._head | {"choices": [choice]}


async def chat_stream(pieces: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """A Messages API event stream's bytes as chat SSE bytes, ending with [DONE]."""
    chunks = ChatChunks()
    async for data in pieces:
        out = chunks.feed(data)
        if out:
            yield out
    yield DONE
