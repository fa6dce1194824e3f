"""A simulated Responses answer's output items, whole and streamed, as vLLM 0.32 builds them
(`responses/utils.py` `build_response_output_items`; `streaming_events.py`, the simple
non-Harmony processor) from the chat turn's text and its tool-call plan (`tool_calls.py`).

Whole: an answer whose planned tool calls are whole (not cut by `max_output_tokens`) is one
`function_call` item per call, `{arguments, call_id, name, type, id: "fc_...", async,
caller, namespace, status: "completed"}`, its `call_id` the parser's tool-call id
(`chatcmpl-tool-...`), and no message (the text before the calls is empty); any other
answer is one assistant message with the text (a cut call is text: the parser finds no whole
block).

Streamed: the text's pieces become the chat stream's tool-call deltas (`tool_replies.py`
`CallDeltas`), and those, or the text, go through vLLM's state machine: text opens a message
(`response.output_item.added`, `response.content_part.added`) and is sent as
`response.output_text.delta`; a call's first delta (its name) closes what is open and opens
a `function_call` item (`response.output_item.added`, status "in_progress", arguments ""),
and each argument fragment is a `response.function_call_arguments.delta`. Closing a call
sends `response.function_call_arguments.done` (with its name) and
`response.output_item.done` (status "completed", a call cut short too); closing a message its
`output_text.done`, `content_part.done` and `output_item.done`. The items closed are the
output of `response.completed`. Events keep vLLM's field order (alphabetical, but the name
of `function_call_arguments.done`); their `sequence_number` is set as they are sent.
"""

from __future__ import annotations

from typing import Any

from appliance.sim.entrypoints.protocol import random_uuid
from appliance.sim.entrypoints.tool_calls import Plan
from appliance.sim.entrypoints.tool_replies import CallDeltas, tool_call_id


def output_message(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {
        "id": item_id,
        "content": [text_part(text)] if status == "completed" else [],
        "role": "assistant",
        "status": status,
        "type": "message",
        "phase": None,
    }


def text_part(text: str, logprobs: list[Any] | None = None) -> dict[str, Any]:
    return {"annotations": [], "text": text, "type": "output_text", "logprobs": logprobs}


def function_call_item(
    item_id: str, call_id: str, name: str, arguments: str, status: str
) -> dict[str, Any]:
    return {
        "arguments": arguments,
        "call_id": call_id,
        "name": name,
        "type": "function_call",
        "id": item_id,
        "async": None,
        "caller": None,
        "namespace": None,
        "status": status,
    }


def whole_output(plan: Plan | None, text: str, finish_reason: str | None) -> list[dict[str, Any]]:
    """A whole (non-streamed) answer's `output` (module docstring)."""
    if plan is not None and plan.calls and finish_reason == "stop":
        return [
            function_call_item(
                f"fc_{random_uuid()}", tool_call_id(), c.name, c.arguments, "completed"
            )
            for c in plan.calls
        ]
    return [output_message(f"msg_{random_uuid()}", text)]


def stream_event(kind: str, **fields: Any) -> dict[str, Any]:
    """An event as vLLM serialises it: fields in alphabetical order, `sequence_number` -1
    until it is sent."""
    return dict(sorted({**fields, "sequence_number": -1, "type": kind}.items()))


class ResponsesStream:
    """vLLM's `SimpleStreamingEventProcessor` for one answer: feed it the text's pieces, then
    close it; `items` are the output items it closed."""

    def __init__(self, plan: Plan | None) -> None:
        self._plan = plan
        self._calls = CallDeltas() if plan is not None and plan.calls else None
        self.items: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None
        """The open item (as `output_item.added` sent it); None when none is."""
        self._call_index: int | None = None
        self._text = ""
        """The open item's text: a message's, or a call's arguments."""

    def feed(self, piece: str) -> list[dict[str, Any]]:
        """The events the answer's next piece of text makes (none for a piece the tool-call
        parser holds back)."""
        if not piece:
            return []
        if self._calls is None or self._plan is None:
            return self._content(piece)
        self._calls.text += piece
        events: list[dict[str, Any]] = []
        for delta in self._calls.deltas(self._plan.calls):
            in_call = self._open is not None and self._open["type"] == "function_call"
            if not in_call or delta["index"] != self._call_index:
                events += self.close()
                events += self._open_call(delta)
            if delta["function"].get("arguments"):
                events += self._arguments(delta["function"]["arguments"])
        return events

    def close(self) -> list[dict[str, Any]]:
        """The open item's closing events (none when nothing is open)."""
        item, self._open = self._open, None
        if item is None:
            return []
        where = {"item_id": item["id"], "output_index": len(self.items)}
        if item["type"] == "function_call":
            done = {**item, "arguments": self._text, "status": "completed"}
            args_done = stream_event(
                "response.function_call_arguments.done", arguments=self._text, **where
            )
            events = [{**args_done, "name": item["name"]}]
        else:
            part = text_part(self._text)
            done = output_message(item["id"], self._text)
            events = [
                stream_event(
                    "response.output_text.done",
                    content_index=0,
                    logprobs=[],
                    text=self._text,
                    **where,
                ),
                stream_event("response.content_part.done", content_index=0, part=part, **where),
            ]
        events.append(
            stream_event("response.output_item.done", item=done, output_index=len(self.items))
        )
        self.items.append(done)
        return events

    def _content(self, piece: str) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if self._open is None or self._open["type"] != "message":
            events += self.close()
            item_id, index = f"msg_{random_uuid()}", len(self.items)
            self._open, self._text = output_message(item_id, "", "in_progress"), ""
            events += [
                stream_event("response.output_item.added", item=self._open, output_index=index),
                stream_event(
                    "response.content_part.added",
                    content_index=0,
                    item_id=item_id,
                    output_index=index,
                    part=text_part("", []),
                ),
            ]
        self._text += piece
        where = {"item_id": self._open["id"], "output_index": len(self.items)}
        return [
            *events,
            stream_event(
                "response.output_text.delta", content_index=0, delta=piece, logprobs=[], **where
            ),
        ]

    def _open_call(self, delta: dict[str, Any]) -> list[dict[str, Any]]:
        name = delta["function"].get("name", "")
        call_id = delta.get("id") or tool_call_id()
        self._call_index, self._text = delta["index"], ""
        self._open = function_call_item(f"fc_{random_uuid()}", call_id, name, "", "in_progress")
        index = len(self.items)
        return [stream_event("response.output_item.added", item=self._open, output_index=index)]

    def _arguments(self, fragment: str) -> list[dict[str, Any]]:
        assert self._open is not None
        self._text += fragment
        return [
            stream_event(
                "response.function_call_arguments.delta",
                delta=fragment,
                item_id=self._open["id"],
                output_index=len(self.items),
            )
        ]
