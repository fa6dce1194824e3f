"""An agent loop with one local tool through `appliance up` on the simulated engine.

Neither the OpenAI Agents SDK nor pydantic-ai is installed here, so the loop is the one
those SDKs run, written with the plain `openai` client, unchanged but for its base URL and
key: ask, run every tool call the model makes, send the results back, until the model
answers in text. Three questions, three tool round-trips, one conversation."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import openai
import pytest

from tests.e2e.conftest import RunningAppliance

pytestmark = pytest.mark.e2e
LOOKUP = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1}},
    "required": ["city", "days"],
}
TOOL: Any = {
    "type": "function",
    "function": {"name": "forecast", "description": "Weather forecast", "parameters": LOOKUP},
}


def forecast(city: str, days: int) -> str:
    """The local tool."""
    return json.dumps({"city": city, "days": days, "sky": "clear"})


def run_agent(
    llm: openai.OpenAI, model: str, messages: list[Any], calls: list[dict[str, Any]]
) -> str:
    """One user request to its text answer, running the tool calls it takes on the way."""
    for _ in range(8):
        reply = llm.chat.completions.create(model=model, messages=messages, tools=[TOOL])
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            return message.content or ""
        for call in message.tool_calls:
            args = json.loads(call.function.arguments)  # type: ignore[union-attr]
            jsonschema.validate(args, LOOKUP)
            calls.append(args)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": forecast(**args)})
    raise AssertionError("the agent never answered in text")


def test_an_agent_loop_runs_three_tool_round_trips(appliance_up: RunningAppliance) -> None:
    if appliance_up.engine != "sim":
        pytest.skip("a random-weight model calls no tools by itself")
    llm = openai.OpenAI(base_url=f"{appliance_up.url}/v1", api_key=appliance_up.keys["bob"])
    messages: list[Any] = [{"role": "system", "content": "You are a weather agent."}]
    calls: list[dict[str, Any]] = []
    for city in ("Oslo", "Lima", "Pune"):
        messages.append({"role": "user", "content": f"What is the forecast for {city}?"})
        assert run_agent(llm, appliance_up.model, messages, calls)
    assert len(calls) == 3
    assert [m["role"] for m in messages].count("tool") == 3
