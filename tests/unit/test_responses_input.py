"""A Responses request's input items, tools and tool choice as the chat messages, tools and
tool choice vLLM 0.32 makes of them (`construct_input_messages`, `construct_tool_dicts`,
`check_tool_usage`): function calls joined into the assistant message before them, their
outputs as tool messages, reasoning, the errors; written out by hand, and (marker `vllm`)
compared with vLLM's own functions on the same requests."""

from __future__ import annotations

import json
from typing import Any

import pytest

from appliance.domain.responses_input import ResponsesInputError, input_messages
from appliance.domain.responses_tools import chat_tool_choice, chat_tools
from tests.vllm_server import run_in_vllm

USER = {"role": "user", "content": "Please call grep."}


def call(call_id: str, name: str = "grep", **extra: Any) -> dict[str, Any]:
    item = {"type": "function_call", "call_id": call_id, "name": name, "arguments": "{}"}
    return {**item, **extra}


def tool_call(call_id: str, name: str = "grep") -> dict[str, Any]:
    function = {"name": name, "arguments": "{}"}
    return {"id": call_id, "function": function, "type": "function"}


def output(call_id: str, text: Any = "3 matches") -> dict[str, Any]:
    return {"type": "function_call_output", "call_id": call_id, "output": text}


def test_a_codex_loop_renders_calls_and_their_outputs() -> None:
    items = [
        USER,
        call("c1", id="fc_1", status="completed"),
        call("c2", "read_file"),
        output("c1"),
        output("c2", [{"type": "input_text", "text": "the file"}]),
        {"role": "user", "content": [{"type": "input_text", "text": "Now edit it."}]},
    ]
    assert input_messages({"instructions": "be a coder", "input": items}) == [
        {"role": "system", "content": "be a coder"},
        USER,
        {"role": "assistant", "tool_calls": [tool_call("c1"), tool_call("c2", "read_file")]},
        {"role": "tool", "content": "3 matches", "tool_call_id": "c1"},
        {"role": "tool", "content": [{"type": "text", "text": "the file"}], "tool_call_id": "c2"},
        {"role": "user", "content": [{"type": "text", "text": "Now edit it."}]},
    ]


def test_reasoning_calls_and_text_join_one_assistant_message() -> None:
    said = {
        "type": "message",
        "role": "assistant",
        "content": [{"type": "output_text", "text": "ok"}],
    }
    items = [
        USER,
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "think"}]},
        call("c1"),
        said,
        output("c1"),
        said,  # a second text, after a tool message: a new assistant message
        {"role": "assistant", "content": "more"},  # the one before has content: new again
    ]
    assert input_messages({"input": items}) == [
        USER,
        {
            "role": "assistant",
            "reasoning": "think",
            "tool_calls": [tool_call("c1")],
            "content": "ok",
        },
        {"role": "tool", "content": "3 matches", "tool_call_id": "c1"},
        {"role": "assistant", "content": "ok"},
        {"role": "assistant", "content": "more"},
    ]


def test_reasoning_prefers_content_and_a_second_one_starts_a_message() -> None:
    first = {
        "type": "reasoning",
        "summary": [{"type": "summary_text", "text": "summary"}],
        "content": [{"type": "reasoning_text", "text": "content"}],
    }
    empty = {"type": "reasoning", "summary": []}
    assert input_messages({"input": [first, empty, call("c1", "ls", namespace="fs")]}) == [
        {"role": "assistant", "reasoning": "content"},
        {"role": "assistant", "reasoning": "", "tool_calls": [tool_call("c1", "fs__ls")]},
    ]


def test_custom_tool_calls_carry_their_input_as_arguments() -> None:
    items = [
        {"type": "custom_tool_call", "call_id": "k", "name": "apply_patch", "input": "*** é"},
        {"type": "custom_tool_call_output", "call_id": "k", "output": "done"},
    ]
    function = {"name": "apply_patch", "arguments": '{"input": "*** é"}'}
    assert input_messages({"input": items}) == [
        {
            "role": "assistant",
            "tool_calls": [{"id": "k", "function": function, "type": "function"}],
        },
        {"role": "tool", "content": "done", "tool_call_id": "k"},
    ]


def test_merging_stays_inside_the_input() -> None:
    history = ([{"role": "system", "content": "old"}, USER], ["I will."])
    body = {"input": [call("c1"), output("c1")]}
    assert input_messages(body, history) == [
        USER,
        {"role": "assistant", "content": "I will."},
        {"role": "assistant", "tool_calls": [tool_call("c1")]},
        {"role": "tool", "content": "3 matches", "tool_call_id": "c1"},
    ]


def test_input_items_are_not_changed() -> None:
    items = [
        {"role": "assistant", "content": None},
        call("c1"),
        {"role": "assistant", "content": "x"},
    ]
    before = json.dumps(items)
    assert input_messages({"input": items}) == [
        {"role": "assistant", "content": "x", "tool_calls": [tool_call("c1")]}
    ]
    assert json.dumps(items) == before


@pytest.mark.parametrize(
    ("item", "message"),
    [
        (
            {"type": "function_call", "call_id": "c1", "name": "grep"},
            "'call_id', 'name' and 'arguments'",
        ),
        (call("c1", arguments={"a": 1}), "'call_id', 'name' and 'arguments'"),
        (call("c1", namespace=3), "'call_id', 'name' and 'arguments'"),
        ({"type": "function_call_output", "output": "x"}, "needs a 'call_id' and an 'output'"),
        ({"type": "function_call_output", "call_id": "c1"}, "needs a 'call_id' and an 'output'"),
        ({"type": "reasoning"}, "a reasoning item needs 'summary'"),
        ({"type": "reasoning", "summary": [{"text": "x"}]}, "a reasoning item needs 'summary'"),
        (
            {"type": "reasoning", "summary": [], "encrypted_content": "gAAA"},
            "Encrypted content is not supported.",
        ),
        ({"type": "item_reference", "id": "msg_1"}, "Unsupported input item type: item_reference"),
        ("just text", "Unsupported input item type: str"),
        ({"role": "user", "content": 7}, "content must be a string or a list of parts"),
    ],
)
def test_what_vllm_refuses_is_refused_naming_the_input(item: Any, message: str) -> None:
    with pytest.raises(ResponsesInputError) as info:
        input_messages({"input": [USER, item]})
    assert message in str(info.value) and info.value.param == "input"


FUNCTION = {
    "type": "function",
    "name": "grep",
    "description": "search",
    "parameters": {"type": "object"},
}


def test_function_tools_take_chats_shape_and_others_are_dropped() -> None:
    tools = [
        FUNCTION,
        {"type": "web_search"},
        {"type": "function", "name": "ls", "strict": True, "defer_loading": False, "x": 1},
    ]
    assert chat_tools({"tools": tools}) == [
        {
            "type": "function",
            "function": {"name": "grep", "description": "search", "parameters": {"type": "object"}},
        },
        {
            "type": "function",
            "function": {
                "name": "ls",
                "description": None,
                "parameters": None,
                "strict": True,
                "defer_loading": False,
            },
        },
    ]
    assert chat_tools({"tools": [{"type": "web_search"}]}) is None
    assert chat_tools({}) is None
    for bad in ({"tools": {"type": "function"}}, {"tools": [{"type": "function", "name": 3}]}):
        with pytest.raises(ResponsesInputError) as info:
            chat_tools(bad)
        assert info.value.param == "tools"


@pytest.mark.parametrize(
    ("tools", "choice", "want"),
    [
        ([FUNCTION], None, "auto"),
        ([FUNCTION], "required", "required"),
        ([FUNCTION], "none", "none"),
        (
            [FUNCTION],
            {"type": "function", "name": "grep"},
            {"type": "function", "function": {"name": "grep"}},
        ),
        ([FUNCTION], {"type": "allowed_tools", "mode": "auto", "tools": []}, "none"),
        (None, "auto", "none"),
        ([], None, "none"),
    ],
)
def test_tool_choice_becomes_chats(tools: Any, choice: Any, want: Any) -> None:
    body = {"tools": tools} if choice is None else {"tools": tools, "tool_choice": choice}
    assert chat_tool_choice(body) == want


@pytest.mark.parametrize(
    ("tools", "choice", "message"),
    [
        (None, "required", "Tool choice 'required' must be specified with 'tools' parameter."),
        (
            [],
            {"type": "function", "name": "grep"},
            "Tool choice 'function' not found in 'tools' parameter.",
        ),
        (
            [FUNCTION],
            {"type": "function", "name": "ls"},
            "Tool choice 'function' not found in 'tools' parameter.",
        ),
        (
            [FUNCTION],
            {"type": "function"},
            "Tool choice 'function' not found in 'tools' parameter.",
        ),
    ],
)
def test_a_tool_choice_vllm_refuses_is_refused(tools: Any, choice: Any, message: str) -> None:
    with pytest.raises(ResponsesInputError) as info:
        chat_tool_choice({"tools": tools, "tool_choice": choice})
    assert (str(info.value), info.value.param) == (message, "tool_choice")


PARITY_INPUTS: list[Any] = [
    [
        USER,
        call("c1"),
        call("c2", "read_file"),
        output("c1"),
        output("c2", [{"type": "input_text", "text": "t"}]),
    ],
    [
        USER,
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "s"}]},
        call("c1"),
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "a"}]},
        output("c1"),
        {"role": "user", "content": [{"type": "input_text", "text": "next"}]},
    ],
    [
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "a"}]},
        call("c1", "ls", namespace="fs"),
        {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "r"}]},
        {"role": "assistant", "content": "b"},
        {"type": "reasoning", "summary": []},
    ],
    [
        {"role": "assistant", "content": "x"},
        {"role": "assistant", "content": "y"},
        {"type": "custom_tool_call", "call_id": "k", "name": "patch", "input": "*** diff"},
        {"type": "custom_tool_call_output", "call_id": "k", "output": "ok"},
    ],
    [output("c0"), call("c1"), {"role": "developer", "content": "d"}],
    [USER, {"type": "reasoning", "summary": [], "encrypted_content": "zzz"}],
    [USER, {"type": "item_reference", "id": "x"}],
]
PARITY_TOOLS: list[Any] = [
    [FUNCTION, {"type": "web_search"}, {"type": "function", "name": "ls", "strict": False}],
    [{"type": "function", "name": "a", "defer_loading": True, "x": 1}],
]

_VLLM_RESPONSES_RUNNER = r"""
import json, sys
from vllm.entrypoints.openai.responses.protocol import ResponsesRequest
from vllm.entrypoints.openai.responses.utils import construct_input_messages, construct_tool_dicts

inputs, tools = json.load(sys.stdin)

def messages(items):
    try:
        r = ResponsesRequest(model="m", input=items, instructions="sys")
        return construct_input_messages(request_instructions=r.instructions, request_input=r.input)
    except Exception as exc:
        return {"error": str(exc)}

def tool_dicts(t):
    r = ResponsesRequest(model="m", input="x", tools=t)
    return construct_tool_dicts(r.tools, r.tool_choice)

print(json.dumps([[messages(i) for i in inputs], [tool_dicts(t) for t in tools]]))
"""


def _as_vllm_parses(value: Any) -> Any:
    """vLLM's chat parser reads `input_text` parts as text parts (the appliance turns them
    into text parts before templating), and its errors end in the parameter."""
    if isinstance(value, list):
        return [_as_vllm_parses(v) for v in value]
    if isinstance(value, dict) and value.get("type") == "input_text":
        return {"type": "text", "text": value["text"]}
    if isinstance(value, dict):
        return {k: _as_vllm_parses(v) for k, v in value.items()}
    return value


@pytest.mark.vllm
def test_the_same_messages_and_tools_as_vllms(vllm_python: str) -> None:
    messages, tools = run_in_vllm(
        vllm_python, _VLLM_RESPONSES_RUNNER, [PARITY_INPUTS, PARITY_TOOLS], timeout=300
    )
    for items, theirs in zip(PARITY_INPUTS, messages, strict=True):
        try:
            ours: Any = input_messages({"input": items, "instructions": "sys"})
        except ResponsesInputError as exc:
            ours = {"error": f"{exc} (parameter={exc.param})"}
        assert ours == _as_vllm_parses(theirs), items
    for given, theirs in zip(PARITY_TOOLS, tools, strict=True):
        assert chat_tools({"tools": given}) == theirs
