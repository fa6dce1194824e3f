"""A chat turn as an Anthropic Messages request, for an endpoint of kind `anthropic`: the
system messages as `system`, user and assistant messages as blocks (text, images, the
assistant's tool calls as `tool_use`, tool results as the user's `tool_result` blocks),
tools and tool_choice in Anthropic's shapes, and the sampling fields it takes. Nothing else
of the body leaves the box (services/escalation/outside_body.py says the same of the
OpenAI kind)."""

from __future__ import annotations

from typing import Any

import orjson

DEFAULT_MAX_TOKENS = 4096
"""`max_tokens` when the chat request sets none (the Messages API requires one)."""
_CHOICES = {"auto": {"type": "auto"}, "required": {"type": "any"}, "none": {"type": "none"}}


def messages_body(body: dict[str, Any], model: str) -> dict[str, Any]:
    """The Messages request of a chat request, asking for `model`."""
    system: list[str] = []
    messages: list[dict[str, Any]] = []
    for m in body.get("messages") or []:
        role = m.get("role")
        if role in ("system", "developer"):
            system.append(_text(m.get("content")))
        elif role == "tool":
            result = {"type": "tool_result", "tool_use_id": str(m.get("tool_call_id") or "")}
            _add(messages, "user", [result | {"content": _text(m.get("content"))}])
        elif role == "assistant":
            _add(messages, "assistant", _blocks(m.get("content")) + _tool_uses(m))
        else:
            _add(messages, "user", _blocks(m.get("content")))
    limit = body.get("max_completion_tokens") or body.get("max_tokens") or DEFAULT_MAX_TOKENS
    sent: dict[str, Any] = {"model": model, "messages": messages, "max_tokens": limit}
    if system:
        sent["system"] = "\n\n".join(system)
    for name in ("temperature", "top_p", "stream"):
        if body.get(name) is not None:
            sent[name] = body[name]
    stop = body.get("stop")
    if stop:
        sent["stop_sequences"] = [stop] if isinstance(stop, str) else list(stop)
    return sent | _tools(body.get("tools"), body.get("tool_choice"))


def _add(messages: list[dict[str, Any]], role: str, blocks: list[dict[str, Any]]) -> None:
    """Appends the blocks as a message of `role`, joined to the last one of the same role."""
    if messages and messages[-1]["role"] == role:
        messages[-1]["content"].extend(blocks)
    else:
        messages.append({"role": role, "content": blocks})


def _text(content: Any) -> str:
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return str(content or "")


def _blocks(content: Any) -> list[dict[str, Any]]:
    if not isinstance(content, list):
        return [{"type": "text", "text": content}] if content else []
    blocks: list[dict[str, Any]] = []
    for part in content:
        if not isinstance(part, dict):
            continue
        if part.get("type") == "text" and part.get("text"):
            blocks.append({"type": "text", "text": part["text"]})
        elif part.get("type") == "image_url":
            blocks.append({"type": "image", "source": _image(part.get("image_url"))})
    return blocks


def _image(image: Any) -> dict[str, Any]:
    url = image.get("url", "") if isinstance(image, dict) else str(image or "")
    if url.startswith("data:") and ";base64," in url:
        media, data = url[5:].split(";base64,", 1)
        return {"type": "base64", "media_type": media, "data": data}
    return {"type": "url", "url": url}


def _tool_uses(message: dict[str, Any]) -> list[dict[str, Any]]:
    uses = []
    for call in message.get("tool_calls") or []:
        fn = call.get("function") or {}
        try:
            args = orjson.loads(fn.get("arguments") or "{}")
        except ValueError:
            args = {}
        named = {"type": "tool_use", "id": call.get("id") or "", "name": fn.get("name")}
        uses.append(named | {"input": args if isinstance(args, dict) else {}})
    return uses


def _tools(tools: Any, choice: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if tools:
        out["tools"] = [
            {
                "name": (t.get("function") or {}).get("name"),
                "description": (t.get("function") or {}).get("description") or "",
                "input_schema": (t.get("function") or {}).get("parameters") or {"type": "object"},
            }
            for t in tools
            if isinstance(t, dict)
        ]
    if isinstance(choice, str) and choice in _CHOICES:
        out["tool_choice"] = _CHOICES[choice]
    elif isinstance(choice, dict) and choice.get("type") == "function":
        out["tool_choice"] = {"type": "tool", "name": (choice.get("function") or {}).get("name")}
    return out
