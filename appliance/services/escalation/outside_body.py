"""What leaves the box with an outside turn: the client's model fields and nothing of the
appliance's own (its session key, tenant salt, priority, task headers are never sent)."""

from __future__ import annotations

from typing import Any

PASSED = frozenset(
    [
        "messages",
        "prompt",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "functions",
        "function_call",
        "temperature",
        "top_p",
        "n",
        "max_tokens",
        "max_completion_tokens",
        "stop",
        "stream",
        "presence_penalty",
        "frequency_penalty",
        "logit_bias",
        "logprobs",
        "top_logprobs",
        "seed",
        "response_format",
        "reasoning_effort",
    ]
)
"""The request fields an outside endpoint gets (OpenAI's chat and completions fields)."""


def outside_body(body: dict[str, Any], model: str) -> dict[str, Any]:
    """The body sent outside: the passed fields of the client's, `model` the endpoint's, and
    for a stream the usage the ledger needs."""
    sent = {k: v for k, v in body.items() if k in PASSED}
    sent["model"] = model
    if sent.get("stream"):
        sent["stream_options"] = {"include_usage": True}
    return sent
