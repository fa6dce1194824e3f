"""An agent of the OpenAI Agents SDK with one local tool through `appliance up` on the
simulated engine, unchanged but for its base URL and key: three questions in one
conversation, each a tool round-trip (the model calls the tool, the SDK runs it and sends
the result back, the model answers in text). The simulated engine chooses tools by a rule
(docs/engines.md); a random-weight model on vLLM calls none by itself, so this runs on the
simulator only."""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Iterator
from contextlib import closing
from typing import Any

import openai
import pytest
from agents import Agent, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled

from tests.e2e.conftest import RunningAppliance
from tests.running import add_key, appliance_process

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def simulated(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningAppliance]:
    data_dir = tmp_path_factory.mktemp("agent-loop")
    keys = {"bob": add_key(data_dir, "bob")}
    with appliance_process(data_dir, engine="sim") as up:
        yield RunningAppliance(
            up.url, keys, data_dir, up.proc, up.base_port, up.log, "sim", "sim", 1.0
        )


def test_an_agents_sdk_agent_runs_three_tool_round_trips(simulated: RunningAppliance) -> None:
    set_tracing_disabled(True)  # the SDK would export its traces to the vendor otherwise
    calls: list[dict[str, Any]] = []

    @function_tool
    def forecast(city: str, days: int) -> str:
        """Weather forecast for a city, `days` days ahead."""
        calls.append({"city": city, "days": days})
        return json.dumps({"city": city, "days": days, "sky": "clear"})

    client = openai.AsyncOpenAI(base_url=f"{simulated.url}/v1", api_key=simulated.keys["bob"])
    model = OpenAIChatCompletionsModel(model=simulated.model, openai_client=client)
    agent = Agent(
        name="weather", instructions="You are a weather agent.", tools=[forecast], model=model
    )
    history: list[Any] = []
    for city in ("Oslo", "Lima", "Pune"):
        asked = [*history, {"role": "user", "content": f"What is the forecast for {city}?"}]
        result = Runner.run_sync(agent, asked)
        assert isinstance(result.final_output, str) and result.final_output
        history = result.to_input_list()
    assert len(calls) == 3 and all(isinstance(c["city"], str) for c in calls)
    kinds = [item.get("type") for item in history if isinstance(item, dict)]
    assert kinds.count("function_call") == 3 and kinds.count("function_call_output") == 3
    assert ok_turns(simulated, want=6) == 6  # per question: the call, then the answer


def ok_turns(app: RunningAppliance, want: int) -> int:
    """The ledger's ok turns, once `want` are committed (a moment after each answer) or 5 s
    have passed."""
    deadline = time.monotonic() + 5
    while True:
        with closing(sqlite3.connect(app.data_dir / "ledger.db")) as db:
            (turns,) = db.execute("SELECT COUNT(*) FROM turns WHERE outcome = 'ok'").fetchone()
        if turns >= want or time.monotonic() > deadline:
            return int(turns)
        time.sleep(0.05)
