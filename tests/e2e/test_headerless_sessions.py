"""Sessions without headers, through `appliance up`: a client that sends no `X-` header and
no session id of any kind (the SDKs unchanged but for their base URL and key) runs a
five-step tool loop (the answer calls a tool, the client appends the call and its result,
then asks again), and the ledger holds it as ONE session, found by its prefix
(`chain-...`): every turn on one worker, its cached tokens growing, each route decision
saying how the session was known, and the idle reaper deciding on that session after
each turn. Through the OpenAI SDK (chat, and Responses with function tools, the whole
conversation as input each time as the Codex CLI sends it: the answer's `function_call`
items, then `function_call_output`; whole and streamed answers) and the Anthropic SDK.

What each engine can show: on the simulated engine the model calls the tool the last user
message names (docs/harnesses.md), and the reaper's decision after each tool call names that
tool. On vLLM (CPU build, a tiny random model) a chat or Responses request's structured
output makes it write the call as a hermes block that vLLM's parser turns into `tool_calls`
or a `function_call` item (tests/e2e/test_answer_waits.py), and the reaper's decisions name
the tool there too. The Messages route passes no structured output to the worker, so on
vLLM its client writes the assistant's tool_use block itself, as if the model had made it,
and the reaper's decisions are not checked against tool names."""

from __future__ import annotations

import itertools
import sqlite3
import uuid
from contextlib import closing
from typing import Any

import anthropic
import pytest

from tests.e2e.conftest import RunningAppliance
from tests.e2e.test_answer_waits import (
    ANTHROPIC_TOOLS,
    NAMES,
    TOOLS,
    decided,
    forced,
    hermes_call,
    openai_client,
)
from tests.e2e.test_up import text
from tests.running import eventually

pytestmark = pytest.mark.e2e


def ledger_turns(app: RunningAppliance, tasks: list[str]) -> list[tuple[Any, ...]]:
    """(session, worker, cached tokens, route reason) of each task's one turn, in order,
    once all are written."""

    def read() -> list[tuple[Any, ...]]:
        with closing(sqlite3.connect(app.ledger)) as db:
            return [
                row
                for task in tasks
                for row in db.execute(
                    "SELECT t.session_id, t.worker, t.cached_tokens, r.reason FROM turns t"
                    " JOIN route_decisions r USING (turn_id) WHERE t.task_id LIKE ?"
                    " AND t.outcome = 'ok'",
                    (f"%{task}",),
                )
            ]

    return eventually(read, lambda rows: len(rows) == len(tasks))


def one_session(app: RunningAppliance, tasks: list[str]) -> str:
    """The session all the tasks' turns were of, after checking the ledger holds them as one
    session found by its prefix, on one worker, its cached tokens growing."""
    rows = ledger_turns(app, tasks)
    assert len(rows) == len(tasks), rows
    sessions = {session for session, *_ in rows}
    assert len(sessions) == 1, rows  # one session, not one per turn
    session = str(sessions.pop())
    assert session.startswith("chain-"), rows
    assert len({worker for _, worker, _, _ in rows}) == 1, rows
    cached = [c for _, _, c, _ in rows]
    assert all(b > a for a, b in itertools.pairwise(cached)), cached
    reasons = [reason for *_, reason in rows]
    assert "new session (no id, no prefix match)" in reasons[0], reasons
    assert all("session from prefix chain" in r for r in reasons[1:]), reasons
    return session


def result(app: RunningAppliance, seed: int) -> str:
    """A tool's result: enough text that each step adds whole blocks to the prompt."""
    return f"3 matches: {text(seed, app.words(60))}"


def test_a_headerless_chat_tool_loop_is_one_session(appliance_up: RunningAppliance) -> None:
    app, client = appliance_up, openai_client(appliance_up)
    system = f"You are a coding agent {uuid.uuid4().hex}. Call the tool the user names."
    messages: list[Any] = [
        {"role": "system", "content": system},
        {"role": "user", "content": f"Please call {NAMES[0]}. {text(501, app.words(40))}"},
    ]
    tasks: list[str] = []
    for step, name in enumerate(NAMES):
        kw: dict[str, Any] = dict(
            model=app.model,
            messages=messages,
            tools=TOOLS,
            max_tokens=128,
            temperature=0,
            extra_body=forced(app, hermes_call(name)),
        )
        if step % 2:  # streamed: the session's turn ends when its stream does
            raw = client.chat.completions.with_raw_response.create(**kw, stream=True)
            calls: dict[int, list[str]] = {}
            for chunk in raw.parse():
                for d in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
                    got = calls.setdefault(d.index, ["", ""])
                    got[0] = d.id or got[0]
                    got[1] += (d.function and d.function.name) or ""
            [(call_id, called)] = list(calls.values())
        else:
            raw = client.chat.completions.with_raw_response.create(**kw)
            [call] = raw.parse().choices[0].message.tool_calls or []
            call_id, called = call.id, call.function.name
        assert called == name
        tasks.append(raw.headers["x-task-id"])
        fn = {"name": name, "arguments": '{"target": "src"}'}
        messages += [
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"id": call_id, "type": "function", "function": fn}],
            },
            {"role": "tool", "tool_call_id": call_id, "content": result(app, 510 + step)},
            {"role": "user", "content": f"Now call {NAMES[(step + 1) % len(NAMES)]}."},
        ]
        session = one_session(app, tasks)
        assert decided(app, session, step + 1)[step] == f"tool {name}"


def test_a_headerless_anthropic_tool_loop_is_one_session(appliance_up: RunningAppliance) -> None:
    app = appliance_up
    client = anthropic.Anthropic(base_url=app.url, api_key=app.keys["alice"], max_retries=0)
    system = f"You are a coding agent {uuid.uuid4().hex}. Call the tool the user names."
    history: list[Any] = [
        {"role": "user", "content": f"Please call {NAMES[0]}. {text(601, app.words(40))}"}
    ]
    tasks: list[str] = []
    for step, name in enumerate(NAMES):
        raw = client.messages.with_raw_response.create(
            model=app.model,
            max_tokens=128 if app.engine == "sim" else 16,
            system=system,
            tools=ANTHROPIC_TOOLS,
            messages=history,
        )
        message = raw.parse()
        tasks.append(raw.headers["x-task-id"])
        if app.engine == "sim":
            assert message.stop_reason == "tool_use"
            [use] = [b.model_dump() for b in message.content if b.type == "tool_use"]
            assert use["name"] == name
        else:  # a random model calls no tool: the client writes the call it would have made
            use = {
                "type": "tool_use",
                "id": f"toolu_{step}",
                "name": name,
                "input": {"target": "src"},
            }
        history += [
            {"role": "assistant", "content": [use]},
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": use["id"],
                        "content": result(app, 610 + step),
                    },
                    {"type": "text", "text": f"Now call {NAMES[(step + 1) % len(NAMES)]}."},
                ],
            },
        ]
        session = one_session(app, tasks)
        if app.engine == "sim":
            assert decided(app, session, step + 1)[step] == f"tool {name}"


RESPONSES_TOOLS: list[Any] = [
    {"type": "function", **tool["function"]} for tool in TOOLS
]  # the same tools in the Responses API's flat shape


def responses_step(app: RunningAppliance, stream: bool, name: str, **kw: Any) -> tuple[Any, str]:
    """One Responses turn: (the response, its task id); streamed, the response the stream's
    `response.completed` event carries."""
    client = openai_client(app)
    if app.engine == "sim":
        kw["max_output_tokens"] = 128
    else:  # structured output: the random model writes the call, vLLM's parser reads it
        kw.update(max_output_tokens=128, temperature=0, extra_body=forced(app, hermes_call(name)))
    raw = client.responses.with_raw_response.create(**kw, stream=stream)
    if not stream:
        return raw.parse(), raw.headers["x-task-id"]
    events = list(raw.parse())
    assert events[-1].type == "response.completed", [e.type for e in events]
    return events[-1].response, raw.headers["x-task-id"]


def test_a_headerless_responses_loop_is_one_session(appliance_up: RunningAppliance) -> None:
    app = appliance_up
    instructions = f"You are a coding agent {uuid.uuid4().hex}. Call the tool the user names."
    items: list[Any] = [
        {"role": "user", "content": f"Please call {NAMES[0]}. {text(701, app.words(40))}"}
    ]
    tasks: list[str] = []
    for step, name in enumerate(NAMES):
        answer, task = responses_step(
            app,
            bool(step % 2),
            name,
            model=app.model,
            instructions=instructions,
            input=items,
            tools=RESPONSES_TOOLS,
            store=False,
        )
        tasks.append(task)
        items += [item.model_dump(exclude_none=True) for item in answer.output]  # as Codex
        calls = [item for item in answer.output if item.type == "function_call"]
        assert [call.name for call in calls] == [name] and answer.output[-1] == calls[0]
        call_id = calls[0].call_id
        items += [
            {"type": "function_call_output", "call_id": call_id, "output": result(app, 710 + step)},
            {"role": "user", "content": f"Now call {NAMES[(step + 1) % len(NAMES)]}."},
        ]
        session = one_session(app, tasks)
        assert decided(app, session, step + 1)[step] == f"tool {name}"
