"""How an answer ended, read from worker answers in vLLM's shapes: non-streamed chat,
completion and Responses bodies, and their streams fed to the scanner in arbitrary pieces."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from appliance.services.sessions.answer_tools import (
    MAX_CALLS,
    TO_PERSON,
    TOOL_NAME_CHARS,
    AnswerEnd,
    ToolCallScanner,
    answer_end,
    bounded,
    tool_calls,
)


def chat(finish: str | None, *names: str, content: str | None = None) -> dict[str, Any]:
    calls = [
        {"id": f"call_{i}", "type": "function", "function": {"name": n, "arguments": "{}"}}
        for i, n in enumerate(names)
    ]
    message = {"role": "assistant", "content": content, "tool_calls": calls}
    return {
        "object": "chat.completion",
        "choices": [{"index": 0, "message": message, "finish_reason": finish}],
        "usage": {"prompt_tokens": 10, "completion_tokens": 5},
    }


def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
    body = {
        "object": "chat.completion.chunk",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }
    return b"data: " + orjson.dumps(body) + b"\n\n"


def chat_stream(finish: str, *names: str, text: str = "") -> bytes:
    """vLLM's shape: a role chunk, text, each call's name then its argument fragments, a
    last chunk with the finish reason, the usage chunk, [DONE]."""
    out = chunk({"role": "assistant", "content": ""})
    for piece in text.split():
        out += chunk({"content": piece + " "})
    for i, name in enumerate(names):
        head = {"index": i, "id": f"call_{i}", "type": "function", "function": {"name": name}}
        out += chunk({"tool_calls": [head]})
        for fragment in ('{"path": ', '"name"', "}"):  # arguments that mention "name"
            out += chunk({"tool_calls": [{"index": i, "function": {"arguments": fragment}}]})
    out += chunk({}, finish)
    usage = {"choices": [], "usage": {"prompt_tokens": 10, "completion_tokens": 5}}
    return out + b"data: " + orjson.dumps(usage) + b"\n\ndata: [DONE]\n\n"


def scanned(stream: bytes, piece: int) -> AnswerEnd | None:
    scanner = ToolCallScanner()
    for at in range(0, len(stream), piece):
        scanner.feed(stream[at : at + piece])
    return scanner.end()


@pytest.mark.parametrize(
    ("answer", "end"),
    [
        (chat("tool_calls", "read_file"), AnswerEnd(True, ("read_file",))),
        (chat("tool_calls", "grep", "read_file", "grep"), AnswerEnd(True, ("grep", "read_file"))),
        (chat("stop", "read_file"), AnswerEnd(True, ("read_file",))),  # a named tool_choice
        (chat("stop", content="Done."), TO_PERSON),
        (chat("length", content="Cut sh"), TO_PERSON),
        (chat("tool_calls"), AnswerEnd(True)),  # a call whose name is not said
        (chat(None, content="?"), None),
        (
            {"object": "text_completion", "choices": [{"index": 0, "finish_reason": "length"}]},
            TO_PERSON,
        ),
        ({"error": {"message": "boom"}}, None),
        ([1, 2], None),
        (None, None),
    ],
)
def test_a_chat_answer_says_the_tools_it_called_or_the_person(answer: Any, end: Any) -> None:
    assert answer_end(answer) == end


def test_the_tool_class_is_the_names_sorted_and_joined_else_the_person() -> None:
    end = answer_end(chat("tool_calls", "read_file", "grep"))
    assert end is not None and end.tool_class == "grep+read_file"
    assert TO_PERSON.tool_class == "person"
    assert AnswerEnd(True).tool_class is None


def response(status: str, *items: dict[str, Any]) -> dict[str, Any]:
    return {"object": "response", "status": status, "output": list(items)}


MESSAGE = {"type": "message", "role": "assistant", "content": [{"type": "output_text"}]}


def call_item(name: str) -> dict[str, Any]:
    return {"type": "function_call", "name": name, "call_id": "c", "arguments": "{}"}


@pytest.mark.parametrize(
    ("answer", "end"),
    [
        (response("completed", call_item("shell")), AnswerEnd(True, ("shell",))),
        (
            response("completed", MESSAGE, call_item("b"), call_item("a")),
            AnswerEnd(True, ("a", "b")),
        ),
        (response("completed", MESSAGE), TO_PERSON),
        (response("incomplete", MESSAGE), TO_PERSON),
        (response("failed"), None),
        (response("in_progress"), None),
    ],
)
def test_a_responses_answer_says_its_function_calls_or_the_person(answer: Any, end: Any) -> None:
    assert answer_end(answer) == end


@pytest.mark.parametrize("piece", [1, 7, 64, 100_000])
@pytest.mark.parametrize(
    ("stream", "end"),
    [
        (chat_stream("tool_calls", "read_file"), AnswerEnd(True, ("read_file",))),
        (chat_stream("tool_calls", "read_file", "grep"), AnswerEnd(True, ("grep", "read_file"))),
        (chat_stream("stop", text='It is done: "name" said'), TO_PERSON),
        (chat_stream("length", text="cut short"), TO_PERSON),
    ],
)
def test_a_chat_stream_says_how_it_ended_in_any_pieces(
    stream: bytes, end: AnswerEnd, piece: int
) -> None:
    assert scanned(stream, piece) == end


def test_a_stream_cut_before_its_finish_reason_says_nothing() -> None:
    whole = chat_stream("tool_calls", "read_file")
    cut = whole[: whole.index(b'"finish_reason":"tool_calls"')]
    assert scanned(cut, 50) is None
    assert scanned(chunk({"content": "hi"}), 50) is None


def test_a_responses_stream_says_it_in_its_completed_event() -> None:
    def event(kind: str, **body: Any) -> bytes:
        return (
            f"event: {kind}\n".encode() + b"data: " + orjson.dumps({"type": kind, **body}) + b"\n\n"
        )

    head = {
        "object": "response",
        "status": "in_progress",
        "output": [],
        "tools": [{"type": "function", "name": "shell"}],
    }
    stream = event("response.created", response=head)
    stream += event("response.output_item.added", output_index=0, item=call_item("shell"))
    assert scanned(stream, 9) is None  # a tool named in the head, a call begun: not whole yet
    done = event("response.completed", response=response("completed", call_item("shell")))
    assert scanned(stream + done, 9) == AnswerEnd(True, ("shell",))
    text = event("response.completed", response=response("completed", MESSAGE))
    assert scanned(event("response.created", response=head) + text, 9) == TO_PERSON


def test_names_are_kept_safe_and_short_and_long_ones_stay_apart() -> None:
    assert bounded("mcp__github__create_issue") == "mcp__github__create_issue"
    assert bounded("run shell+pipe") == "run_shell_pipe"  # "+" joins a class's names
    a, b = bounded("x" * 200 + "a"), bounded("x" * 200 + "b")
    assert len(a) == len(b) == TOOL_NAME_CHARS and a != b
    assert a.startswith("x" * 50)
    many = tool_calls(f"tool_{i:03d}" for i in range(100))
    assert len(many.tools) == MAX_CALLS
    assert many.tool_class is not None and len(many.tool_class) == TOOL_NAME_CHARS
    assert tool_calls(["", None, 3, "ok"]).tools == ("ok",)


def test_a_stream_keeps_at_most_max_calls_names() -> None:
    stream = chat_stream("tool_calls", *(f"t{i:03d}" for i in range(3 * MAX_CALLS)))
    end = scanned(stream, 4096)
    assert end is not None and len(end.tools) == MAX_CALLS
