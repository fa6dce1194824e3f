"""A Responses API request as the chat messages vLLM renders (its `construct_input_messages`
for text conversations, without Harmony): the sim serves them, the router tokenises them.

The instructions become a system message; a chained request (`previous_response_id`) then
has the stored response's own messages, less their system ones (instructions do not carry
over), and its output text as assistant messages; then the input: a string is one user
message, a list of items each a message (`input_text`/`output_text` parts as text parts,
an assistant item's first part as its text).
"""

from __future__ import annotations

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
        for item in raw:
            if not isinstance(item, dict) or not isinstance(item.get("role"), str):
                kind = item.get("type") if isinstance(item, dict) else type(item).__name__
                raise ResponsesInputError(f"Unsupported input item type: {kind}")
            messages.append(_message_of(item))
    else:
        raise ResponsesInputError("'input' must be a string or a non-empty list of items")
    return messages


def output_texts(response: dict[str, Any]) -> list[str]:
    """The text of a response's output messages, one per content part (reasoning skipped)."""
    texts: list[str] = []
    for item in response.get("output") or []:
        if isinstance(item, dict) and item.get("type") == "message":
            texts += [str(c.get("text") or "") for c in item.get("content") or []]
    return texts


def _message_of(item: dict[str, Any]) -> dict[str, Any]:
    content = item.get("content")
    if isinstance(content, list):
        content = [
            {"type": "text", "text": p.get("text", "")}
            if isinstance(p, dict) and p.get("type") in ("input_text", "output_text")
            else p
            for p in content
        ]
        if item["role"] == "assistant" and content and isinstance(content[0], dict):
            content = content[0].get("text")
    elif content is not None and not isinstance(content, str):
        raise ResponsesInputError("an input item's content must be a string or a list of parts")
    return {"role": item["role"], "content": content}
