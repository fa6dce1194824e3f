"""A planned answer (`tool_calls.Plan`) rendered as vLLM 0.32 renders it: the whole chat
body's message with `tool_calls` and its finish_reason, or the stream's content deltas
turned into tool-call deltas (`tool_calls.py` states the model; the Responses API's output
items are built from the same plan and deltas in `responses_events.py`)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from appliance.sim.entrypoints.protocol import random_uuid
from appliance.sim.entrypoints.tool_calls import Plan, PlannedCall, PlannedDecoder


def tool_call_id() -> str:
    """vLLM's `make_tool_call_id` (random ids)."""
    return f"chatcmpl-tool-{random_uuid()}"


def _message(content: str | None, calls: list[dict[str, Any]]) -> dict[str, Any]:
    message = {"role": "assistant", "content": content, "refusal": None, "annotations": None}
    message.update(audio=None, function_call=None)
    if calls:
        message["tool_calls"] = calls
    message["reasoning"] = None
    return message


def _whole_call(call: PlannedCall, arguments: str) -> dict[str, Any]:
    function = {"name": call.name, "arguments": arguments}
    return {"id": tool_call_id(), "type": "function", "function": function}


def rewrite_body(plan: Plan, body: dict[str, Any], decoders: Sequence[PlannedDecoder]) -> None:
    """Put the plan's answer into a whole chat body (built with the engine's token counts)."""
    for choice in body["choices"]:
        text = decoders[choice["index"]].text
        whole = choice["finish_reason"] == "stop"
        if plan.mode == "json":
            choice["message"]["content"] = text
        elif whole:
            calls = [_whole_call(c, c.arguments) for c in plan.calls]
            choice["message"] = _message(None if plan.mode == "auto" else "", calls)
            choice["finish_reason"] = "stop" if plan.mode == "named" else "tool_calls"
        else:  # cut short: the parser finds no whole call, the text is content
            choice["message"]["content"] = text


@dataclass(slots=True)
class CallDeltas:
    """One choice's stream so far: its text, and what each call has sent (the Responses
    stream reads its calls from these deltas too: `responses_events.py`)."""

    text: str = ""
    ids: dict[int, str] = field(default_factory=dict)
    sent: dict[int, int] = field(default_factory=dict)

    def deltas(self, calls: Sequence[PlannedCall]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for k, call in enumerate(calls):
            if len(self.text) < call.header_at:
                break
            begin = call.start + self.sent.get(k, 0)
            end = min(len(self.text), call.start + len(call.arguments))
            piece = self.text[begin:end] if end > begin else ""
            function: dict[str, Any] = {}
            delta: dict[str, Any] = {}
            if k not in self.ids:
                self.ids[k] = tool_call_id()
                delta.update(id=self.ids[k], type="function")
                function["name"] = call.name
            if piece:
                function["arguments"] = piece
                self.sent[k] = self.sent.get(k, 0) + len(piece)
            if function:
                out.append({**delta, "index": k, "function": function})
        return out


async def rewrite_stream(plan: Plan, chunks: AsyncIterator[str]) -> AsyncIterator[str]:
    """The chat stream's content deltas as tool-call deltas (a JSON plan streams as text).
    A chunk that says nothing new is held back, as vLLM's parser does."""
    states: dict[int, CallDeltas] = {}
    async for raw in chunks:
        chunk = json.loads(raw)
        choices = chunk.get("choices") or []
        if plan.mode == "json" or not choices or "role" in choices[0].get("delta", {}):
            yield raw
            continue
        choice = choices[0]
        state = states.setdefault(choice["index"], CallDeltas())
        state.text += choice["delta"].get("content") or ""
        deltas = state.deltas(plan.calls)
        finish = choice.get("finish_reason")
        if not deltas and finish is None:
            continue
        choice["delta"] = {"tool_calls": deltas} if deltas else {}
        if finish == "stop" and state.ids and plan.mode != "named":
            choice["finish_reason"] = "tool_calls"
        yield json.dumps(chunk, ensure_ascii=False, separators=(",", ":"))
