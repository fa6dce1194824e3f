"""A Responses API request as the chat messages vLLM 0.32 renders (its `construct_input_messages`
and `construct_chat_messages_with_tool_call`, without Harmony): the sim serves them, the router
tokenises them.

The instructions become a system message; a chained request (`previous_response_id`) then
has the stored response's own messages, less their system ones (instructions do not carry
over), and the text of its output messages as assistant messages (its `function_call` and
reasoning items are dropped, as vLLM drops them); then the input: a string is one user
message, a list of items each a message or a part of the message before it:

- an item with a `role` is that message (`input_text`/`output_text` parts as text parts); an
  assistant one is its text (a string, or its first part's), which fills the assistant
  message before it when that has no content yet;
- `function_call` (and `custom_tool_call`): a tool call `{id: call_id, function: {name,
  arguments}, type: "function"}` (a namespaced call named `<namespace>__<name>`, a custom
  call's input as the arguments `{"input": ...}`), added to the assistant message before it,
  else the `tool_calls` of a new assistant message;
- `function_call_output` (and `custom_tool_call_output`): a `tool` message, its `output` the
  content, its `call_id` the `tool_call_id`;
- `reasoning`: the assistant's `reasoning` (its first content text, else its first summary
  text, else ""), set on the assistant message before it when that has none, else a new
  assistant message; encrypted reasoning is refused, as vLLM refuses it;
- anything else is refused ("Unsupported input item type: ..."), as is an item missing what
  vLLM's parsing needs.

Merging looks only at the messages the input made, never at the history before them.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any


class ResponsesInputError(ValueError):
    """An input vLLM refuses (a 400 naming `param`)."""

    def __init__(self, message: str, param: str = "input") -> None:
        super().__init__(message)
        self.param = param


def input_messages(
    body: dict[str, Any],
    previous: tuple[Sequence[dict[str, Any]], Sequence[str]] | None = None,
) -> list[dict[str, Any]]:
    """The request's chat messages; `previous`: the stored response's messages and output
    texts, for a chained request."""
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise ResponsesInputError("'instructions' must be a string", "instructions")
    if instructions:
        messages.append({"role": "system", "content": instructions})
    if previous is not None:
        before, texts = previous
        messages += [m for m in before if m.get("role") != "system"]
        messages += [{"role": "assistant", "content": text} for text in texts]
    raw = body.get("input")
    if isinstance(raw, str):
        messages.append({"role": "user", "content": raw})
    elif isinstance(raw, list) and raw:
        messages += item_messages(raw)
    else:
        raise ResponsesInputError("'input' must be a string or a non-empty list of items")
    return messages


def item_messages(items: Sequence[Any]) -> list[dict[str, Any]]:
    """Input items as chat messages (vLLM's `construct_chat_messages_with_tool_call`)."""
    messages: list[dict[str, Any]] = []
    for item in items:
        message = _message_from_item(item, messages[-1] if messages else None)
        if message is not None:
            messages.append(message)
    return messages


def output_texts(response: dict[str, Any]) -> list[str]:
    """The text of a response's output messages, one per content part (reasoning and
    function calls skipped)."""
    texts: list[str] = []
    for item in response.get("output") or []:
        if isinstance(item, dict) and item.get("type") == "message":
            texts += [str(c.get("text") or "") for c in item.get("content") or []]
    return texts


def _message_from_item(item: Any, prev: dict[str, Any] | None) -> dict[str, Any] | None:
    """A new message, or None when the item went into `prev` (vLLM's
    `_construct_message_from_response_item`)."""
    if not isinstance(item, dict):
        raise ResponsesInputError(f"Unsupported input item type: {type(item).__name__}")
    assistant = prev if prev is not None and prev.get("role") == "assistant" else None
    kind = item.get("type")
    if kind in ("function_call", "custom_tool_call"):
        call = _tool_call(item)
        if assistant is None:
            return {"role": "assistant", "tool_calls": [call]}
        assistant["tool_calls"] = [*(assistant.get("tool_calls") or []), call]
        return None
    if kind == "reasoning":
        reasoning = _reasoning(item)
        if assistant is not None and assistant.get("reasoning") is None:
            assistant["reasoning"] = reasoning
            return None
        return {"role": "assistant", "reasoning": reasoning}
    if kind in ("function_call_output", "custom_tool_call_output"):
        call_id, output = item.get("call_id"), item.get("output")
        if not isinstance(call_id, str) or not isinstance(output, str | list):
            raise ResponsesInputError(f"a {kind} item needs a 'call_id' and an 'output'")
        return {"role": "tool", "content": _parts(output), "tool_call_id": call_id}
    role = item.get("role")
    if not isinstance(role, str):
        raise ResponsesInputError(f"Unsupported input item type: {kind}")
    text = _assistant_text(item) if role == "assistant" else None
    if text is None:
        return _message_of(item)
    if assistant is not None and assistant.get("content") is None:
        assistant["content"] = text
        return None
    return {"role": "assistant", "content": text}


def _tool_call(item: dict[str, Any]) -> dict[str, Any]:
    fields = ("call_id", "name", "arguments" if item["type"] == "function_call" else "input")
    call_id, name, arguments = (item.get(f) for f in fields)
    namespace = item.get("namespace")
    if not all(isinstance(v, str) for v in (call_id, name, arguments)) or not isinstance(
        namespace, str | None
    ):
        raise ResponsesInputError(
            f"a {item['type']} item needs string 'call_id', 'name' and '{fields[2]}'"
        )
    if item["type"] == "custom_tool_call":
        arguments = json.dumps({"input": arguments}, ensure_ascii=False)
    elif namespace:
        name = f"{namespace}__{name}"
    return {"id": call_id, "function": {"name": name, "arguments": arguments}, "type": "function"}


def _reasoning(item: dict[str, Any]) -> str:
    summary, content = item.get("summary"), item.get("content")
    if not _text_parts(summary, "summary_text") or not (
        content is None or _text_parts(content, "reasoning_text")
    ):
        raise ResponsesInputError(
            "a reasoning item needs 'summary', a list of summary_text parts (and 'content', "
            "if any, a list of reasoning_text parts)"
        )
    if item.get("encrypted_content"):
        raise ResponsesInputError("Encrypted content is not supported.")
    if content:
        return str(content[0]["text"])
    return str(summary[0]["text"]) if summary else ""


def _text_parts(parts: Any, kind: str) -> bool:
    return isinstance(parts, list) and all(
        isinstance(p, dict) and p.get("type") == kind and isinstance(p.get("text"), str)
        for p in parts
    )


def _assistant_text(item: dict[str, Any]) -> str | None:
    content = item.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content and isinstance(content[0], dict):
        text = content[0].get("text")
        return text if isinstance(text, str) else None
    return None


def _message_of(item: dict[str, Any]) -> dict[str, Any]:
    content = item.get("content")
    if content is not None and not isinstance(content, str | list):
        raise ResponsesInputError("an input item's content must be a string or a list of parts")
    return {"role": item["role"], "content": _parts(content)}


def _parts(content: Any) -> Any:
    """List content with its `input_text`/`output_text` parts as text parts."""
    if not isinstance(content, list):
        return content
    return [
        {"type": "text", "text": p.get("text", "")}
        if isinstance(p, dict) and p.get("type") in ("input_text", "output_text")
        else p
        for p in content
    ]
