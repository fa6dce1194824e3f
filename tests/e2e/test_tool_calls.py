"""Tool calls and structured output through `appliance up`, driven by the unchanged `openai`
client. On the simulated engine: vLLM's shapes come back intact (tool_calls with arguments
valid for their schemas, streamed deltas, each tool_choice, parallel calls, JSON-schema
content) with the ledger counting what usage says. On real vLLM (CPU build, a tiny random
model): every request is answered through the appliance exactly as the worker answers it
directly (temperature 0, fixed seed; ids, timestamps and cache counts aside), and
structured output makes even a random model's answer valid for its schema."""

from __future__ import annotations

import json
import sqlite3
import time
from contextlib import closing
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from tests.e2e.conftest import RunningAppliance

pytestmark = pytest.mark.e2e
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1}},
    "required": ["city", "days"],
}
CLOCK = {"type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}}, "required": ["tz"]}
SCHEMAS = {"get_weather": WEATHER, "get_time": CLOCK}
TOOLS: list[Any] = [
    {"type": "function", "function": {"name": n, "description": n, "parameters": s}}
    for n, s in SCHEMAS.items()
]
ANSWER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "rain": {"type": "boolean"}},
    "required": ["city", "rain"],
    "additionalProperties": False,
}
JSON_SCHEMA: Any = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER}}
NAMED = {"type": "function", "function": {"name": "get_time"}}
CHOICES: list[Any] = ["auto", "required", NAMED, "none"]


def client(app: RunningAppliance) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{app.url}/v1", api_key=app.keys["alice"], max_retries=0)


SIM_ONLY = pytest.mark.parametrize("appliance_up", ["sim"], indirect=True)
"""The simulated engine's own answers; vLLM's are compared with vLLM's direct ones below."""
VLLM_ONLY = pytest.mark.parametrize(
    "appliance_up", [pytest.param("vllm", marks=pytest.mark.vllm)], indirect=True
)


def ledger_tokens(app: RunningAppliance, session: str) -> tuple[int, int] | None:
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        with closing(sqlite3.connect(app.ledger)) as db:
            row = db.execute(
                "SELECT prompt_tokens, output_tokens FROM turns WHERE session_id LIKE ?",
                (f"%{session}",),
            ).fetchone()
        if row is not None:
            return int(row[0]), int(row[1])
        time.sleep(0.05)
    return None


@SIM_ONLY
@pytest.mark.parametrize(
    ("tool_choice", "said", "names", "finish"),
    [
        ("auto", "Weather in Oslo?", ["get_weather"], "tool_calls"),
        ("auto", "get_time and get_weather", ["get_weather", "get_time"], "tool_calls"),
        ("required", "Hi", ["get_weather"], "tool_calls"),
        (NAMED, "Hi", ["get_time"], "stop"),
    ],
    ids=["auto", "parallel", "required", "named"],
)
def test_tool_calls_pass_through_and_the_ledger_counts_them(
    appliance_up: RunningAppliance, tool_choice: Any, said: str, names: list[str], finish: str
) -> None:
    session = f"tools-{names[-1]}-{finish}-{len(names)}-{said[:2]}"
    reply = client(appliance_up).chat.completions.create(
        model=appliance_up.model,
        messages=[{"role": "user", "content": said}],
        tools=TOOLS,
        tool_choice=tool_choice,
        extra_headers={"X-Session-ID": session},
    )
    choice = reply.choices[0]
    assert choice.finish_reason == finish
    calls = choice.message.tool_calls or []
    assert [c.function.name for c in calls] == names  # type: ignore[union-attr]
    for call in calls:
        args = json.loads(call.function.arguments)  # type: ignore[union-attr]
        jsonschema.validate(args, SCHEMAS[call.function.name])  # type: ignore[union-attr]
    assert reply.usage is not None
    usage = (reply.usage.prompt_tokens, reply.usage.completion_tokens)
    assert ledger_tokens(appliance_up, session) == usage


@SIM_ONLY
def test_streamed_tool_call_deltas_pass_through(appliance_up: RunningAppliance) -> None:
    stream = client(appliance_up).chat.completions.create(
        model=appliance_up.model,
        messages=[{"role": "user", "content": "get_weather, get_time"}],
        tools=TOOLS,
        stream=True,
        stream_options={"include_usage": True},
    )
    calls: dict[int, list[str]] = {}
    finish = None
    for chunk in stream:
        for d in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
            name, args = calls.setdefault(d.index, ["", ""])
            fn = d.function
            calls[d.index] = [name + ((fn and fn.name) or ""), args + ((fn and fn.arguments) or "")]
        if chunk.choices and chunk.choices[0].finish_reason:
            finish = chunk.choices[0].finish_reason
    assert finish == "tool_calls" and [n for n, _ in calls.values()] == ["get_weather", "get_time"]
    for name, args in calls.values():
        jsonschema.validate(json.loads(args), SCHEMAS[name])


@SIM_ONLY
def test_tool_choice_none_answers_in_text(appliance_up: RunningAppliance) -> None:
    reply = client(appliance_up).chat.completions.create(
        model=appliance_up.model,
        messages=[{"role": "user", "content": "get_weather"}],
        tools=TOOLS,
        tool_choice="none",
        max_tokens=8,
    )
    assert reply.choices[0].message.tool_calls is None and reply.choices[0].message.content


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_json_schema_answer_validates(appliance_up: RunningAppliance, stream: bool) -> None:
    """On vLLM too: its structured output constrains even a random-weight model."""
    app = appliance_up
    extra: Any = {"stream_options": {"include_usage": True}} if stream else {}
    reply: Any = client(app).chat.completions.create(
        model=app.model,
        messages=[{"role": "user", "content": "Will it rain in Oslo? Answer in JSON."}],
        response_format=JSON_SCHEMA,
        max_tokens=200,
        temperature=0,
        stream=stream,
        **extra,
    )
    if stream:
        chunks = list(reply)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    else:
        text = reply.choices[0].message.content
    jsonschema.validate(json.loads(text), ANSWER)


def test_a_json_schema_completion_validates(appliance_up: RunningAppliance) -> None:
    """The completions route takes response_format too."""
    reply = client(appliance_up).completions.create(
        model=appliance_up.model,
        prompt="Will it rain in Oslo? JSON:",
        max_tokens=200,
        temperature=0,
        extra_body={"response_format": JSON_SCHEMA},
    )
    jsonschema.validate(json.loads(reply.choices[0].text), ANSWER)


def _comparable(value: Any) -> Any:
    """A body without what differs between two answers of the same: ids, timestamps, the
    prompt cache's counts (the second request hits the first one's blocks)."""
    if isinstance(value, dict):
        drop = {"id", "created", "prompt_tokens_details"}
        return {k: _comparable(v) for k, v in value.items() if k not in drop}
    if isinstance(value, list):
        return [_comparable(v) for v in value]
    return value


def _folded_stream(text: str) -> dict[str, Any]:
    """A stream's chunks folded into what they say: per choice its content, its tool calls'
    names and arguments, its finish and stop reasons; the usage; the ending. Where one
    chunk ends and the next begins is vLLM's timing (tokens made while the last chunk was
    being sent come together), not part of the answer."""
    lines = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    folded: dict[str, Any] = {"done": lines[-1:] == ["[DONE]"], "choices": {}, "usage": None}
    for chunk in (_comparable(json.loads(line)) for line in lines if line != "[DONE]"):
        if "choices" not in chunk:  # an error event
            folded.setdefault("events", []).append(chunk)
            continue
        folded["usage"] = chunk.get("usage") or folded["usage"]
        for choice in chunk["choices"]:
            into = folded["choices"].setdefault(choice["index"], {"content": "", "calls": {}})
            delta = choice["delta"]
            into["content"] += delta.get("content") or ""
            for call in delta.get("tool_calls") or []:
                got = into["calls"].setdefault(call["index"], {"name": "", "arguments": ""})
                for key in ("name", "arguments"):
                    got[key] += (call.get("function") or {}).get(key) or ""
            if choice.get("finish_reason"):
                into["finish"] = (choice["finish_reason"], choice.get("stop_reason"))
    return folded


@VLLM_ONLY
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("tool_choice", CHOICES, ids=["auto", "required", "named", "none"])
def test_vllm_answers_through_the_appliance_as_directly(
    appliance_up: RunningAppliance, tool_choice: Any, stream: bool
) -> None:
    app = appliance_up
    body = {
        "model": app.model,
        "messages": [{"role": "user", "content": "What time is it in Oslo?"}],
        "tools": TOOLS,
        "tool_choice": tool_choice,
        "max_tokens": 24,
        "temperature": 0,
        "seed": 7,
        "stream": stream,
        **({"stream_options": {"include_usage": True}} if stream else {}),  # as the API asks
    }
    auth = {"Authorization": f"Bearer {app.keys['alice']}"}
    answers = []
    for base in (f"http://127.0.0.1:{app.base_port}", app.url):
        r = httpx.post(f"{base}/v1/chat/completions", json=body, headers=auth, timeout=300)
        answers.append((r.status_code, _folded_stream(r.text) if stream else _comparable(r.json())))
    direct, relayed = answers
    assert relayed == direct
    assert direct[0] == 200, direct
