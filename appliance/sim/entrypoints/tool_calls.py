"""Tool calls and structured output in the simulated engine, in vLLM 0.32's shapes.

Model of the world (vLLM `chat_completion/serving.py` with `--enable-auto-tool-choice
--tool-call-parser hermes`): the model writes its answer as text and vLLM turns it into
`message.tool_calls` [{id, type: function, function: {name, arguments}}]: the hermes parser
reads `<tool_call>{"name", "arguments"}</tool_call>` blocks (content: the text before the
first block, null when none); "required" and a named tool constrain the output to such
blocks (structured output; content ""). finish_reason is "tool_calls" for auto and
required, "stop" for a named tool. Streamed, the calls come as deltas: {id, type, index,
function: {name}} first, then argument fragments. `response_format` json_schema /
json_object makes the content a JSON document valid for the schema. A Responses API request
runs as such a chat turn (`responses_api.py`), its calls answered as `function_call` items
(`responses_events.py`).

The sim's rule (deterministic, per request id): with tools and tool_choice auto it calls,
unless the last message is a tool result (then it answers in text), each tool whose name
occurs in the last user message (only the first when parallel_tool_calls is false), else
the first tool; "required" picks the same way but calls a tool after a tool result too; a
named tool is called alone; "none" answers in text. Arguments are drawn from the tool's
`parameters` schema (`json_instance.py`). The planned text is what the engine "generates":
its length in the sim tokenizer's tokens is the number of tokens the engine runs (so usage
counts it), and each generated token reveals the next slice of it; max_tokens below that
cuts it ("length"), and a cut tool call is text again (as on vLLM: the parser finds no
whole block), streamed as the deltas of what is whole so far.
"""

from __future__ import annotations

import json
import random
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from appliance.sim.engine_io import SimRequest
from appliance.sim.entrypoints.api_errors import bad_request
from appliance.sim.entrypoints.detokenizer import IncrementalDecoder
from appliance.sim.entrypoints.json_instance import SchemaError, instance
from appliance.tokenization.tokenizer import ModelTokenizer

Mode = Literal["auto", "required", "named", "json"]


@dataclass(frozen=True, slots=True)
class PlannedCall:
    name: str
    arguments: str
    header_at: int
    """Characters of the text after which the call's name is known (its first delta)."""
    start: int
    """Where its arguments begin in the text; they end at start + len(arguments)."""


@dataclass(frozen=True, slots=True)
class Plan:
    """What the model writes: the text and, for tool calls, where each call lies in it."""

    mode: Mode
    text: str
    calls: tuple[PlannedCall, ...] = ()


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def _pick_tools(body: Any, tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    last_user = next((m for m in reversed(body.messages) if m.get("role") == "user"), {})
    said = last_user.get("content")
    said = said if isinstance(said, str) else _dumps(said or "")
    named = [t for t in tools if _name(t) and _name(t) in said] or tools[:1]
    return named[:1] if getattr(body, "parallel_tool_calls", None) is False else named


def _name(tool: dict[str, Any]) -> str:
    return str((tool.get("function") or {}).get("name") or "")


def _arguments(tool: dict[str, Any], rng: random.Random) -> str:
    schema = (tool.get("function") or {}).get("parameters") or {"type": "object"}
    try:
        return _dumps(instance(schema, rng))
    except SchemaError as exc:
        raise bad_request(f"tool {_name(tool)!r}: {exc}") from None


def _tool_plan(body: Any, rng: random.Random) -> Plan | None:
    tools, choice = getattr(body, "tools", None) or [], getattr(body, "tool_choice", None)
    if not tools or choice in (None, "none"):
        return None
    if isinstance(choice, dict):
        wanted = (choice.get("function") or {}).get("name")
        tool = next((t for t in tools if _name(t) == wanted), None)
        if tool is None:
            raise bad_request(f"Tool '{wanted}' has not been passed in `tools`.")
        return _hermes("named", [tool], rng)
    after_result = bool(body.messages) and body.messages[-1].get("role") == "tool"
    if choice == "auto" and after_result:
        return None
    return _hermes("required" if choice == "required" else "auto", _pick_tools(body, tools), rng)


def _hermes(mode: Mode, tools: list[dict[str, Any]], rng: random.Random) -> Plan:
    """The calls as hermes blocks, which vLLM 0.32 also constrains required and named
    tool choices to (a structural tag)."""
    parts, calls, at = [], [], 0
    for i, tool in enumerate(tools):
        name, args = _name(tool), _arguments(tool, rng)
        head = f'{chr(10) if i else ""}<tool_call>\n{{"name": {_dumps(name)}, "arguments": '
        tail = "}\n</tool_call>"
        calls.append(PlannedCall(name, args, at + len(head), at + len(head)))
        parts.append(head + args + tail)
        at += len(head) + len(args) + len(tail)
    return Plan(mode, "".join(parts), tuple(calls))


def _json_plan(body: Any, rng: random.Random) -> Plan | None:
    fmt = getattr(body, "response_format", None)
    if not isinstance(fmt, dict) or fmt.get("type") not in ("json_schema", "json_object"):
        return None
    if fmt["type"] == "json_object":
        return Plan("json", _dumps({"answer": rng.choice(("yes", "no"))}))
    spec = fmt.get("json_schema") or {}
    schema = spec.get("schema", spec.get("json_schema"))
    if not isinstance(schema, dict):
        raise bad_request("response_format.json_schema.schema must be a JSON schema object")
    try:
        return Plan("json", _dumps(instance(schema, rng)))
    except SchemaError as exc:
        raise bad_request(f"response_format: {exc}") from None


def plan_reply(body: Any, request_id: str) -> Plan | None:
    """The structured answer a chat (or completion: JSON only) request gets, or None for a
    plain text answer."""
    rng = random.Random(zlib.crc32(request_id.encode()))
    return _tool_plan(body, rng) or _json_plan(body, rng)


class PlannedDecoder(IncrementalDecoder):
    """The planned text, a slice per generated token (the engine's ids stand in for it)."""

    def __init__(self, tokenizer: ModelTokenizer, text: str) -> None:
        super().__init__(tokenizer)
        n = max(1, len(tokenizer.encode(text, add_special_tokens=False)))
        self.bounds = [round(i * len(text) / n) for i in range(n + 1)]
        self.plan_text = text
        self.tokens = n
        self.done = 0

    def push(self, token_ids: Sequence[int]) -> str:
        start = self.bounds[min(self.done, self.tokens)]
        self.done += len(token_ids)
        return self.plan_text[start : self.bounds[min(self.done, self.tokens)]]

    @property
    def text(self) -> str:
        return self.plan_text[: self.bounds[min(self.done, self.tokens)]]


def attach(
    plan: Plan, tokenizer: ModelTokenizer, requests: list[SimRequest], decoders: list[Any]
) -> list[PlannedDecoder]:
    """Make each engine request run the plan's tokens (then stop) and decode to its text."""
    planned = [PlannedDecoder(tokenizer, plan.text) for _ in requests]
    for req, dec in zip(requests, planned, strict=True):
        req.ignore_eos = False
        req.eos_after = dec.tokens
    decoders[:] = planned
    return planned
