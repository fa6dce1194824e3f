"""The simulated worker's Responses output items, whole and streamed, from a tool-call plan:
`function_call` items and the stream's events in vLLM 0.32's shapes and field order (written
out by hand, and, marker `vllm`, compared with the shapes vLLM's own builders make)."""

from __future__ import annotations

import json
import subprocess
from types import SimpleNamespace
from typing import Any

import pytest

from appliance.sim.entrypoints.responses_events import ResponsesStream, whole_output
from appliance.sim.entrypoints.tool_calls import Plan, plan_reply

SCHEMA = {"type": "object", "properties": {"target": {"enum": ["src"]}}, "required": ["target"]}
TOOLS = [
    {"type": "function", "function": {"name": name, "parameters": SCHEMA}}
    for name in ("read_file", "grep")
]
ARGS = '{"target": "src"}'
CALL_KEYS = ["arguments", "call_id", "name", "type", "id", "async", "caller", "namespace", "status"]
MESSAGE_KEYS = ["id", "content", "role", "status", "type", "phase"]
EVENT_KEYS = {
    "response.output_item.added": ["item", "output_index", "sequence_number", "type"],
    "response.output_item.done": ["item", "output_index", "sequence_number", "type"],
    "response.function_call_arguments.delta": [
        "delta",
        "item_id",
        "output_index",
        "sequence_number",
        "type",
    ],
    "response.function_call_arguments.done": [
        "arguments",
        "item_id",
        "output_index",
        "sequence_number",
        "type",
        "name",
    ],
    "response.content_part.added": [
        "content_index",
        "item_id",
        "output_index",
        "part",
        "sequence_number",
        "type",
    ],
    "response.content_part.done": [
        "content_index",
        "item_id",
        "output_index",
        "part",
        "sequence_number",
        "type",
    ],
    "response.output_text.delta": [
        "content_index",
        "delta",
        "item_id",
        "logprobs",
        "output_index",
        "sequence_number",
        "type",
    ],
    "response.output_text.done": [
        "content_index",
        "item_id",
        "logprobs",
        "output_index",
        "sequence_number",
        "text",
        "type",
    ],
}


def plan(said: str, parallel: bool = True) -> Plan:
    body = SimpleNamespace(
        messages=[{"role": "user", "content": said}],
        tools=TOOLS,
        tool_choice="auto",
        parallel_tool_calls=parallel,
    )
    made = plan_reply(body, "resp_test")
    assert made is not None
    return made


def streamed(stream: ResponsesStream, text: str, piece: int) -> list[dict[str, Any]]:
    events = [e for i in range(0, len(text), piece) for e in stream.feed(text[i : i + piece])]
    return events + stream.close()


def test_whole_tool_calls_are_function_call_items() -> None:
    two = plan("grep, then read_file")
    items = whole_output(two, two.text, "stop")
    assert [list(item) for item in items] == [CALL_KEYS, CALL_KEYS]
    assert [(i["name"], i["arguments"], i["status"]) for i in items] == [
        ("read_file", ARGS, "completed"),
        ("grep", ARGS, "completed"),
    ]
    assert all(i["id"].startswith("fc_") and len(i["id"]) == 19 for i in items)
    assert all(i["call_id"].startswith("chatcmpl-tool-") for i in items)
    assert len({i["call_id"] for i in items}) == 2
    assert all(i["namespace"] is None and i["async"] is None for i in items)


def test_a_cut_call_and_a_plain_answer_are_a_message() -> None:
    one = plan("grep it", parallel=False)
    for output in (whole_output(one, one.text[:30], "length"), whole_output(None, "hi", "stop")):
        [message] = output
        assert list(message) == MESSAGE_KEYS and message["id"].startswith("msg_")
        assert message["role"] == "assistant" and message["status"] == "completed"
    assert whole_output(one, one.text[:30], "length")[0]["content"] == [
        {"annotations": [], "text": one.text[:30], "type": "output_text", "logprobs": None}
    ]


@pytest.mark.parametrize("piece", [1, 7, 500])
def test_streamed_calls_are_added_argued_and_done_in_turn(piece: int) -> None:
    two = plan("grep, then read_file")
    stream = ResponsesStream(two)
    events = streamed(stream, two.text, piece)
    kinds = [e["type"].removeprefix("response.") for e in events]
    per_call = kinds.index("output_item.done") + 1
    assert kinds[:1] == ["output_item.added"] and kinds[per_call] == "output_item.added"
    for k in (kinds[:per_call], kinds[per_call:]):
        assert k[-2:] == ["function_call_arguments.done", "output_item.done"]
        assert set(k[1:-2]) == {"function_call_arguments.delta"}
    assert all(list(e) == EVENT_KEYS[e["type"]] for e in events)
    added = [e for e in events if e["type"] == "response.output_item.added"]
    done = [e for e in events if e["type"] == "response.output_item.done"]
    assert [e["output_index"] for e in added] == [0, 1] == [e["output_index"] for e in done]
    for index, (a, d, name) in enumerate(zip(added, done, ("read_file", "grep"), strict=True)):
        assert (a["item"]["arguments"], a["item"]["status"]) == ("", "in_progress")
        assert {**a["item"], "arguments": ARGS, "status": "completed"} == d["item"]
        assert d["item"]["name"] == name and d["item"]["id"].startswith("fc_")
        assert d["item"]["call_id"].startswith("chatcmpl-tool-")
        mine = [e for e in events if e.get("item_id") == d["item"]["id"]]
        deltas = "".join(e["delta"] for e in mine if e["type"].endswith("arguments.delta"))
        assert deltas == ARGS and all(e["output_index"] == index for e in mine)
        assert mine[-1] == {
            "arguments": ARGS,
            "item_id": d["item"]["id"],
            "output_index": index,
            "sequence_number": -1,
            "type": "response.function_call_arguments.done",
            "name": name,
        }
    assert stream.items == [e["item"] for e in done]


def test_a_call_cut_short_is_closed_with_what_came() -> None:
    one = plan("grep it", parallel=False)
    stream = ResponsesStream(one)
    cut = one.calls[0].start + 5
    events = streamed(stream, one.text[:cut], 3)
    assert [e["type"] for e in events][-2:] == [
        "response.function_call_arguments.done",
        "response.output_item.done",
    ]
    [item] = stream.items
    assert (item["arguments"], item["status"]) == (ARGS[:5], "completed")
    before_the_name = ResponsesStream(one)
    assert streamed(before_the_name, one.text[:10], 3) == [] and before_the_name.items == []


def test_streamed_text_is_one_message() -> None:
    stream = ResponsesStream(None)
    events = streamed(stream, "hello there", 4)
    assert [e["type"].removeprefix("response.") for e in events] == [
        "output_item.added",
        "content_part.added",
        *["output_text.delta"] * 3,
        "output_text.done",
        "content_part.done",
        "output_item.done",
    ]
    assert all(list(e) == EVENT_KEYS[e["type"]] for e in events)
    item_id = events[0]["item"]["id"]
    assert events[0]["item"] == {
        "id": item_id,
        "content": [],
        "role": "assistant",
        "status": "in_progress",
        "type": "message",
        "phase": None,
    }
    part = {"annotations": [], "text": "hello there", "type": "output_text", "logprobs": None}
    assert events[1]["part"] == {**part, "text": "", "logprobs": []}
    assert events[-3]["text"] == "hello there" and events[-2]["part"] == part
    assert stream.items == [events[-1]["item"]] and stream.items[0]["content"] == [part]
    assert ResponsesStream(None).close() == []


_VLLM_SHAPES_RUNNER = r"""
import json
from vllm.entrypoints.generate.base.protocol import FunctionCall
from vllm.entrypoints.openai.responses.streaming_events import (
    SimpleStreamingState, emit_simple_content_delta, emit_simple_content_done,
    emit_simple_content_open, emit_simple_tool_call_delta, emit_simple_tool_call_done,
    emit_simple_tool_call_open,
)
from vllm.entrypoints.openai.responses.utils import build_response_output_items

def dump(e):
    return json.loads(e.model_dump_json(indent=None, by_alias=True))

s = SimpleStreamingState()
call = emit_simple_tool_call_open(s, "grep", 0, None, False, "chatcmpl-tool-1")
call += emit_simple_tool_call_delta(s, '{"target": "src"}') + emit_simple_tool_call_done(s)
s = SimpleStreamingState()
text = emit_simple_content_open(s) + emit_simple_content_delta(s, "hi")
text += emit_simple_content_done(s)
grep = FunctionCall(name="grep", arguments='{"target": "src"}')
whole = build_response_output_items(None, None, [grep])
whole = [i.model_dump(mode="json", by_alias=True) for i in whole]
print(json.dumps([[dump(e) for e in call + text], whole]))
"""


def _shape(value: Any) -> Any:
    """Keys in order, and values but for the random ids."""
    if isinstance(value, dict):
        return [
            (k, "<id>" if k in ("id", "item_id", "call_id") else _shape(v))
            for k, v in value.items()
        ]
    if isinstance(value, list):
        return [_shape(v) for v in value]
    return value


@pytest.mark.vllm
def test_the_same_shapes_as_vllms(vllm_python: str) -> None:
    r = subprocess.run(
        [vllm_python, "-c", _VLLM_SHAPES_RUNNER], capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, f"vLLM runner failed:\n{r.stderr[-4000:]}"
    events, whole = json.loads(r.stdout.strip().splitlines()[-1])
    one = plan("grep it", parallel=False)
    ours = streamed(ResponsesStream(one), one.text, len(one.text))
    ours += streamed(ResponsesStream(None), "hi", 2)
    assert _shape(ours) == _shape(events)
    assert _shape(whole_output(one, one.text, "stop")) == _shape(whole)
