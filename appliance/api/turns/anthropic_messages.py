"""The Anthropic Messages API (`POST /v1/messages`) as a dialect of a chat turn.

vLLM serves `/v1/messages` by turning the request into a chat completion request and its
answer back (`vllm/entrypoints/anthropic/serving.py`). The appliance makes the same chat
request itself (`chat_request`) and sends it to the worker's chat route, so the turn is a
chat turn in every respect: its token ids and block hashes are the chat's, and it carries
the session key, the priority and the cache salt the appliance adds (vLLM's Messages
request has no `session_id` or `priority`: the retention connector and the scheduler would
never see them). The answer goes back in the Messages API's shapes: a message
(`message_body`), or its event stream (`MessageEvents`: message_start, content blocks of
text and tool_use with their deltas, message_delta with the stop reason and usage,
message_stop), with usage as vLLM reports it (`input_tokens` the fresh part,
`cache_read_input_tokens` the cached part), and errors as `{"type": "error", "error":
{"type", "message"}}` (`anthropic_error`).

Covered: system (text or text blocks; Claude Code's per-request billing header dropped, as
vLLM does, so it cannot defeat prefix caching), text, image (URL or base64), thinking,
tool_use and tool_result blocks, tools and tool_choice, stop_sequences, temperature,
top_p, top_k, output_config.format (JSON schema), metadata. Not: vLLM's inline-system
merge for templates that want one system message first (the bundled templates do not).
"""

from __future__ import annotations

import hashlib
from typing import Any

import orjson

from appliance.api.errors import RequestRefused

MESSAGES_PATH = "/v1/messages"
CHAT_PATH = "/v1/chat/completions"
BILLING_HEADER = "x-anthropic-billing-header"
_PASSED = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "stop_sequences": "stop",
    "cache_salt": "cache_salt",
}
_TOOL_CHOICE = {"auto": "auto", "any": "required", "none": "none"}


def _refused(message: str, param: str) -> RequestRefused:
    return RequestRefused(400, message, "invalid_value", param=param)


def _object(value: Any, param: str) -> dict[str, Any]:
    """A field that is an object, or absent ({})."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise _refused(f"'{param}' must be an object", param)
    return value


def _string(value: Any, param: str) -> str:
    if not isinstance(value, str):
        raise _refused(f"'{param}' must be a string", param)
    return value


def chat_request(body: dict[str, Any]) -> dict[str, Any]:
    """The chat completion request vLLM makes of a Messages request (400 naming the field
    for what the Messages API refuses)."""
    max_tokens = body.get("max_tokens")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise _refused("'max_tokens' is required: an integer >= 1", "max_tokens")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _refused("'messages' must be a non-empty list", "messages")
    history = [*_system(body.get("system")), *_messages(messages)]
    chat: dict[str, Any] = {
        "model": body.get("model"),
        "max_tokens": max_tokens,
        "messages": history,
    }
    for name, chat_name in _PASSED.items():
        if body.get(name) is not None:
            chat[chat_name] = body[name]
    if body.get("stream"):
        chat["stream"] = True
    chat |= _tools(body.get("tools"), body.get("tool_choice"))
    output = _object(body.get("output_config"), "output_config")
    schema = _object(output.get("format"), "output_config.format").get("json_schema")
    if schema is not None:
        named = {"name": "json_schema", "schema": schema}
        chat["response_format"] = {"type": "json_schema", "json_schema": named}
    return chat


def user_session(body: dict[str, Any]) -> str | None:
    """A session for a Messages client that names none: its `metadata.user_id` (Claude
    Code's carries its session), hashed to a bounded id; None without one (the desk then
    finds the session by the conversation's prefix: services/sessions/session_finder.py)."""
    metadata = body.get("metadata")
    user = metadata.get("user_id") if isinstance(metadata, dict) else None
    if isinstance(user, str) and user:
        return f"anthropic-user-{hashlib.sha256(user.encode()).hexdigest()[:24]}"
    return None


def _text(value: Any, param: str) -> str:
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise _refused(f"'{param}' must be a string or a list of text blocks", param)
    parts = [
        _string(b.get("text") or "", f"{param}.text")
        for b in value
        if isinstance(b, dict) and b.get("type") == "text"
    ]
    return "".join(p for p in parts if not p.startswith(BILLING_HEADER))


def _system(system: Any) -> list[dict[str, Any]]:
    if system is None:
        return []
    text = _text(system, "system")
    if isinstance(system, str) and text.startswith(BILLING_HEADER):
        return []
    return [{"role": "system", "content": text}] if text else []


def _messages(messages: list[Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or msg.get("role") not in ("user", "assistant", "system"):
            raise _refused(f"messages[{i}] needs a role of user or assistant", "messages")
        role, content = msg["role"], msg.get("content")
        if role == "system":
            text = _text(content, f"messages[{i}].content")
            if text and not text.startswith(BILLING_HEADER):
                out.append({"role": "system", "content": text})
        elif isinstance(content, str):
            out.append({"role": role, "content": content})
        elif isinstance(content, list):
            _blocks(role, content, out, i)
        else:
            raise _refused(f"messages[{i}].content must be a string or blocks", "messages")
    return out


def _blocks(role: str, blocks: list[Any], out: list[dict[str, Any]], i: int) -> None:
    """One message of content blocks, as vLLM converts it (tool results become tool
    messages ahead of it)."""
    parts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    reasoning: list[str] = []
    where = f"messages[{i}].content"
    for block in blocks:
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            text = _string(block.get("text", ""), f"{where}.text")
            parts += [{"type": "text", "text": text}] if text else []
        elif kind == "image":
            url = _image_url(_object(block.get("source"), f"{where}.source"))
            parts.append({"type": "image_url", "image_url": {"url": url}})
        elif kind == "thinking" and block.get("thinking") is not None:
            reasoning.append(_string(block["thinking"], f"{where}.thinking"))
        elif kind == "tool_use":
            name = _string(block.get("name") or "", f"{where}.name")
            fn = {"name": name, "arguments": _arguments(block.get("input") or {}, i)}
            call_id = _string(block.get("id") or "", f"{where}.id")
            calls.append({"id": call_id, "type": "function", "function": fn})
        elif kind == "tool_result":
            _tool_result(role, block, out, parts)
        elif kind not in ("redacted_thinking", "tool_reference", "text", "image", "thinking"):
            raise _refused(f"messages[{i}]: unknown content block type {kind!r}", "messages")
    msg: dict[str, Any] = {"role": role}
    if reasoning:
        msg["reasoning"] = "".join(reasoning)
    if calls:
        msg["tool_calls"] = calls
    if parts:
        one_text = len(parts) == 1 and parts[0]["type"] == "text"
        msg["content"] = parts[0]["text"] if one_text else parts
    if parts or calls or reasoning:
        out.append(msg)


def _arguments(value: Any, i: int) -> str:
    try:
        return orjson.dumps(value).decode()
    except TypeError as exc:  # an integer past 64 bits: no model's argument
        raise _refused(
            f"messages[{i}]: a tool_use input cannot be encoded: {exc}", "messages"
        ) from None


def _tool_result(
    role: str, block: dict[str, Any], out: list[dict[str, Any]], parts: list[dict[str, Any]]
) -> None:
    content = block.get("content")
    if isinstance(content, list):
        texts = [c.get("text") for c in content if isinstance(c, dict) and c.get("type") == "text"]
        text = "\n".join(_string(t or "", "tool_result.content.text") for t in texts)
    else:
        text = content if isinstance(content, str) else ""
    if role == "user":
        call = _string(block.get("tool_use_id") or "", "tool_result.tool_use_id")
        out.append({"role": "tool", "tool_call_id": call, "content": text})
    else:
        parts.append({"type": "text", "text": f"Tool result: {content or ''}"})


def _function(tool: dict[str, Any]) -> dict[str, Any]:
    fn = {"name": _string(tool.get("name"), "tools.name"), "parameters": tool.get("input_schema")}
    return fn | ({"description": tool["description"]} if tool.get("description") else {})


def _image_url(source: dict[str, Any]) -> str:
    if source.get("type") == "url":
        return _string(source.get("url"), "source.url")
    media = _string(source.get("media_type", "image/png"), "source.media_type")
    return f"data:{media};base64,{_string(source.get('data', ''), 'source.data')}"


def _tools(tools: Any, choice: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if choice is not None:
        kind = _object(choice, "tool_choice").get("type")
        out["parallel_tool_calls"] = not choice.get("disable_parallel_tool_use", False)
        if kind == "tool":
            name = _string(choice.get("name"), "tool_choice.name")
            out["tool_choice"] = {"type": "function", "function": {"name": name}}
        elif kind in _TOOL_CHOICE:
            out["tool_choice"] = _TOOL_CHOICE[kind]
        else:
            raise _refused("'tool_choice.type' must be auto, any, tool or none", "tool_choice")
    if tools is None:
        return out
    if not isinstance(tools, list):
        raise _refused("'tools' must be a list", "tools")
    out["tools"] = [{"type": "function", "function": _function(_object(t, "tools"))} for t in tools]
    out.setdefault("tool_choice", "auto")
    return out
