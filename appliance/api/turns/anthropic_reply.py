"""A chat answer in the Anthropic Messages API's shapes, as vLLM's `/v1/messages` gives it
(`messages_full_converter`, `message_stream_converter` in vllm/entrypoints/anthropic/
serving.py): see anthropic_messages.py for why the appliance converts it itself."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Any

import orjson

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def usage(chat_usage: dict[str, Any] | None) -> dict[str, int]:
    """Anthropic's usage: `input_tokens` the fresh prompt, `cache_read_input_tokens` the
    cached part (vLLM's prompt_tokens less it), `output_tokens`."""
    if not chat_usage:
        return {"input_tokens": 0, "output_tokens": 0}
    out = {"output_tokens": int(chat_usage.get("completion_tokens") or 0)}
    prompt = int(chat_usage.get("prompt_tokens") or 0)
    details = chat_usage.get("prompt_tokens_details") or {}
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    if cached is not None:
        out["cache_read_input_tokens"] = int(cached)
        prompt -= int(cached)
    return {"input_tokens": max(0, prompt), **out}


def stop_reason(finish: str | None, stop: Any, tool_used: bool) -> tuple[str | None, str | None]:
    """(stop_reason, stop_sequence) of a chat finish reason."""
    if finish == "length":
        return "max_tokens", None
    if finish not in ("stop", "tool_calls"):
        return None, None
    if isinstance(stop, str):
        return "stop_sequence", stop
    return ("tool_use" if finish == "tool_calls" or tool_used else "end_turn"), None


def message_body(chat_answer: bytes) -> bytes:
    """A non-streamed chat answer as a Messages API message."""
    chat = orjson.loads(chat_answer)
    choice = (chat.get("choices") or [{}])[0]
    msg = choice.get("message") or {}
    calls = msg.get("tool_calls") or []
    content: list[dict[str, Any]] = []
    if msg.get("reasoning"):
        content.append({"type": "thinking", "thinking": msg["reasoning"], "signature": ""})
    if msg.get("content"):
        content.append({"type": "text", "text": msg["content"]})
    for call in calls:
        fn = call.get("function") or {}
        content.append(
            {
                "type": "tool_use",
                "id": call.get("id"),
                "name": fn.get("name"),
                "input": _json_or_empty(fn.get("arguments")),
            }
        )
    reason, sequence = stop_reason(
        choice.get("finish_reason"), choice.get("stop_reason"), bool(calls)
    )
    return orjson.dumps(
        {
            "id": chat.get("id"),
            "type": "message",
            "role": "assistant",
            "content": content or [{"type": "text", "text": ""}],
            "model": chat.get("model"),
            "stop_reason": reason,
            "stop_sequence": sequence,
            "usage": usage(chat.get("usage")),
        }
    )


def _json_or_empty(text: Any) -> Any:
    try:
        return orjson.loads(text) if isinstance(text, str) and text else {}
    except orjson.JSONDecodeError:
        return {}


def anthropic_error(status: int, openai_error: bytes) -> bytes:
    """An error body of the appliance's (or a worker's) in the Messages API's shape."""
    try:
        error = orjson.loads(openai_error).get("error") or {}
        message = error.get("message") if isinstance(error, dict) else str(error)
    except (orjson.JSONDecodeError, AttributeError):
        message = openai_error.decode("utf-8", "replace")
    kind = _ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return orjson.dumps({"type": "error", "error": {"type": kind, "message": message}})


def _event(name: str, data: dict[str, Any]) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


class MessageEvents:
    """A chat completion's SSE stream, as relayed from the worker, turned into the Messages
    API's event stream (`events`). Lines may be split across chunks; the stream's usage
    line (the appliance asks every stream for one) gives message_delta's usage."""

    def __init__(self) -> None:
        self._tail = b""
        self._block: str | None = None  # the open content block's type
        self._index = -1
        self._tool_ids: dict[int, str] = {}
        self._finish: tuple[str | None, Any] = (None, None)
        self._tool_used = False
        self._started = False

    async def events(self, chunks: AsyncGenerator[bytes, None]) -> AsyncGenerator[bytes, None]:
        """The events; closing them closes `chunks` (the worker's request ends with them)."""
        try:
            async for data in chunks:
                buffer = self._tail + data
                end = buffer.rfind(b"\n") + 1
                lines, self._tail = buffer[:end], buffer[end:]
                for line in lines.split(b"\n"):
                    if line.startswith(b"data:"):
                        for out in self._line(line[5:].strip()):
                            yield out
        finally:
            await chunks.aclose()

    def _line(self, data: bytes) -> list[bytes]:
        if data == b"[DONE]":
            return [*self._close(), _event("message_stop", {"type": "message_stop"})]
        chunk = orjson.loads(data)
        if "error" in chunk:  # the appliance's own: a worker broke off, the task was stopped
            err = chunk["error"] if isinstance(chunk["error"], dict) else {}
            body = {
                "type": "error",
                "error": {"type": "api_error", "message": err.get("message", "")},
            }
            return [_event("error", body)]
        out = [] if self._started else [self._start(chunk)]
        self._started = True
        choices = chunk.get("choices") or []
        if not choices:  # the usage line, last
            reason, sequence = stop_reason(*self._finish, self._tool_used)
            delta = {"stop_reason": reason, "stop_sequence": sequence}
            return [
                *out,
                *self._close(),
                _event(
                    "message_delta",
                    {"type": "message_delta", "delta": delta, "usage": usage(chunk.get("usage"))},
                ),
            ]
        choice = choices[0]
        if choice.get("finish_reason") is not None:
            self._finish = (choice["finish_reason"], choice.get("stop_reason"))
        delta = choice.get("delta") or {}
        if delta.get("content"):
            out += self._open("text", {"type": "text", "text": ""})
            out.append(self._delta({"type": "text_delta", "text": delta["content"]}))
        for call in delta.get("tool_calls") or []:
            out += self._tool_delta(call)
        return out

    def _start(self, chunk: dict[str, Any]) -> bytes:
        message = {
            "id": chunk.get("id"),
            "type": "message",
            "role": "assistant",
            "content": [],
            "model": chunk.get("model"),
            "stop_reason": None,
            "stop_sequence": None,
            "usage": usage(None),
        }
        return _event("message_start", {"type": "message_start", "message": message})

    def _tool_delta(self, call: dict[str, Any]) -> list[bytes]:
        out: list[bytes] = []
        fn = call.get("function") or {}
        index = int(call.get("index") or 0)
        if call.get("id") is not None and fn.get("name") is not None:
            self._tool_ids[index] = call["id"]
            self._tool_used = True
            block = {"type": "tool_use", "id": call["id"], "name": fn["name"], "input": {}}
            out += self._open("tool_use", block, force=True)
        if fn.get("arguments") and index in self._tool_ids:
            out.append(self._delta({"type": "input_json_delta", "partial_json": fn["arguments"]}))
        return out

    def _open(self, kind: str, block: dict[str, Any], *, force: bool = False) -> list[bytes]:
        if self._block == kind and not force:
            return []
        out = self._close()
        self._index += 1
        self._block = kind
        start = {"type": "content_block_start", "index": self._index, "content_block": block}
        return [*out, _event("content_block_start", start)]

    def _delta(self, delta: dict[str, Any]) -> bytes:
        body = {"type": "content_block_delta", "index": self._index, "delta": delta}
        return _event("content_block_delta", body)

    def _close(self) -> list[bytes]:
        if self._block is None:
            return []
        self._block = None
        return [_event("content_block_stop", {"type": "content_block_stop", "index": self._index})]
