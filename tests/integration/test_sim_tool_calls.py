"""The simulated worker's tool calls and structured output, driven by the unchanged `openai`
client: vLLM's shapes (message.tool_calls, finish_reason, streamed tool-call deltas), JSON
arguments and documents valid for their schemas (checked by `jsonschema`), usage that counts
the generated text's tokens. The worker runs as `--enable-auto-tool-choice
--tool-call-parser hermes` would (`appliance/sim/entrypoints/tool_calls.py` states its rule)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from appliance.sim.entrypoints.serving import ThreadedWorker
from appliance.sim.runtime.worker import WorkerConfig
from appliance.tokenization.tokenizer import FallbackTokenizer

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "minLength": 2},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "units": {"enum": ["C", "F"]},
    },
    "required": ["city", "days"],
}
CLOCK = {"type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]}
TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": CLOCK}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": CLOCK}
ANSWER = {
    "type": "object",
    "properties": {"verdict": {"enum": ["yes", "no"]}, "score": {"type": "number"}},
    "required": ["verdict", "score"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def sim() -> Iterator[ThreadedWorker]:
    config = WorkerConfig(port=0, enable_auto_tool_choice=True, time_scale=0.02)
    with ThreadedWorker(config) as worker:
        yield worker


@pytest.fixture(scope="module")
def client(sim: ThreadedWorker) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{sim.base_url}/v1", api_key="x", max_retries=0)


def check_calls(calls: Any, names: list[str]) -> None:
    assert [c.function.name for c in calls] == names
    for call in calls:
        assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize(
    ("tool_choice", "said", "names", "content", "finish"),
    [
        ("auto", "What is the weather?", ["get_weather"], None, "tool_calls"),
        ("auto", "get_time then get_weather", ["get_weather", "get_time"], None, "tool_calls"),
        ("required", "Hello", ["get_weather"], "", "tool_calls"),
        ({"type": "function", "function": {"name": "get_time"}}, "x", ["get_time"], "", "stop"),
    ],
    ids=["auto", "auto-parallel", "required", "named"],
)
def test_tool_calls_come_in_vllms_shape(
    client: openai.OpenAI, tool_choice: Any, said: str, names: list[str], content: Any, finish: str
) -> None:
    reply = client.chat.completions.create(
        model="sim",
        messages=[{"role": "user", "content": said}],
        tools=TOOLS,
        tool_choice=tool_choice,
    )
    choice = reply.choices[0]
    assert (choice.message.content, choice.finish_reason) == (content, finish)
    check_calls(choice.message.tool_calls, names)


def test_none_and_a_tool_result_are_answered_in_text(client: openai.OpenAI) -> None:
    none = client.chat.completions.create(
        model="sim", messages=ASK, tools=TOOLS, tool_choice="none"
    )
    assert none.choices[0].message.tool_calls is None and none.choices[0].message.content
    result = [
        *ASK,
        {
            "role": "assistant",
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": "{}"},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    after = client.chat.completions.create(model="sim", messages=result, tools=TOOLS)
    assert after.choices[0].finish_reason == "stop" and after.choices[0].message.content
    assert after.choices[0].message.tool_calls is None


def test_parallel_tool_calls_false_calls_one_tool(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model="sim",
        messages=[{"role": "user", "content": "get_time and get_weather"}],
        tools=TOOLS,
        parallel_tool_calls=False,
    )
    check_calls(reply.choices[0].message.tool_calls, ["get_weather"])


@pytest.mark.parametrize("tool_choice", ["auto", "required", "named"])
def test_streamed_tool_call_deltas_add_up_to_the_calls(
    client: openai.OpenAI, tool_choice: str
) -> None:
    choice: Any = tool_choice
    if tool_choice == "named":
        choice = {"type": "function", "function": {"name": "get_time"}}
    stream = client.chat.completions.create(
        model="sim",
        messages=[{"role": "user", "content": "get_weather and get_time"}],
        tools=TOOLS,
        tool_choice=choice,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    calls: dict[int, dict[str, str]] = {}
    for chunk in chunks:
        for d in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            call = calls.setdefault(d.index, {"id": d.id or "", "name": "", "arguments": ""})
            call["name"] += (d.function and d.function.name) or ""
            call["arguments"] += (d.function and d.function.arguments) or ""
    names = ["get_time"] if tool_choice == "named" else ["get_weather", "get_time"]
    assert [c["name"] for c in calls.values()] == names
    for call in calls.values():
        assert call["id"].startswith("chatcmpl-tool-")
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == ("stop" if tool_choice == "named" else "tool_calls")
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0


@pytest.mark.parametrize("stream", [False, True])
def test_a_json_schema_answer_validates_and_usage_counts_its_tokens(
    client: openai.OpenAI, stream: bool
) -> None:
    fmt: Any = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER}}
    kw: Any = {"stream_options": {"include_usage": True}} if stream else {}
    reply = client.chat.completions.create(
        model="sim", messages=ASK, response_format=fmt, stream=stream, **kw
    )
    if stream:
        chunks = list(reply)  # type: ignore[arg-type]
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        usage = chunks[-1].usage
    else:
        text, usage = reply.choices[0].message.content or "", reply.usage  # type: ignore[union-attr]
    jsonschema.validate(json.loads(text), ANSWER)
    tokens = FallbackTokenizer().encode(text, add_special_tokens=False)
    assert usage is not None and usage.completion_tokens == len(tokens)


def test_max_tokens_cuts_the_document(client: openai.OpenAI) -> None:
    fmt: Any = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER}}
    reply = client.chat.completions.create(
        model="sim", messages=ASK, response_format=fmt, max_tokens=2
    )
    assert reply.choices[0].finish_reason == "length" and reply.usage is not None
    assert reply.usage.completion_tokens == 2
    with pytest.raises(json.JSONDecodeError):
        json.loads(reply.choices[0].message.content or "")


def test_json_object_is_a_json_object(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model="sim", messages=ASK, response_format={"type": "json_object"}
    )
    assert isinstance(json.loads(reply.choices[0].message.content or ""), dict)


def test_without_auto_tool_choice_tools_are_refused_as_vllm_does() -> None:
    with ThreadedWorker(WorkerConfig(port=0, time_scale=0.02)) as plain:
        body = {"model": "sim", "messages": ASK, "tools": TOOLS, "tool_choice": "required"}
        r = httpx.post(f"{plain.base_url}/v1/chat/completions", json=body, timeout=30)
        assert r.status_code == 400 and "--tool-call-parser" in r.json()["error"]["message"]


@pytest.mark.parametrize("tool_choice", ["auto", "required", "named"])
def test_a_cut_tool_call_is_text_as_on_vllm(client: openai.OpenAI, tool_choice: str) -> None:
    choice: Any = tool_choice
    if tool_choice == "named":
        choice = {"type": "function", "function": {"name": "get_time"}}
    reply = client.chat.completions.create(
        model="sim", messages=ASK, tools=TOOLS, tool_choice=choice, max_tokens=8
    )
    message = reply.choices[0].message
    assert reply.choices[0].finish_reason == "length" and message.tool_calls is None
    assert (message.content or "").startswith("<tool_call>")


@pytest.mark.parametrize("stream", [False, True])
def test_a_completion_with_a_json_schema_validates(client: openai.OpenAI, stream: bool) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER}}
    reply: Any = client.completions.create(
        model="sim",
        prompt="Verdict:",
        max_tokens=100,
        stream=stream,
        extra_body={"response_format": fmt},
    )
    text = "".join(c.choices[0].text for c in reply) if stream else reply.choices[0].text
    jsonschema.validate(json.loads(text), ANSWER)
