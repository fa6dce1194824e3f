"""The idle reaper learns what a session waits on from the answers, through `appliance up`:
a client that sends its session id and no other agent header (no `X-Tool-Class`, no
`X-Expected-Tool-Wait-S`) runs a five-step tool loop (each answer calls a named tool, the
client sends the tool's result back), and after each tool call the reaper's decision in the
ledger names that tool; the answer that calls no tool leaves the session waiting on the
person. Through the OpenAI SDK (chat, whole and streamed answers) and the Anthropic SDK
(whole and streamed).

On the simulated engine the model calls the tool the last user message names
(docs/engines.md). On vLLM (CPU build, a tiny random model) a model calls no tool by
itself, and a named or required `tool_choice` does not bound its arguments (it writes
digits until `max_tokens`, and the parser finds no whole call); so each request's
structured output (a choice of one text) makes it write the call as a hermes block, which
vLLM's own tool-call parser turns into `tool_calls` (finish reason "tool_calls"), streamed
or not: what the appliance reads is vLLM's answer.
"""

from __future__ import annotations

import sqlite3
import uuid
from contextlib import closing
from typing import Any

import anthropic
import httpx
import openai
import pytest

from tests.e2e.conftest import RunningAppliance
from tests.running import eventually

pytestmark = pytest.mark.e2e
NAMES = ["read_file", "grep", "run_tests", "edit_file", "list_dir"]
SCHEMA = {
    "type": "object",
    "properties": {"target": {"enum": ["src", "tests"]}},
    "required": ["target"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {"name": n, "description": f"{n} in the repository", "parameters": SCHEMA},
    }
    for n in NAMES
]
SYSTEM = "You are a coding agent. Call the tool the user names, then report."


def decisions(app: RunningAppliance, session: str) -> list[tuple[str, str]]:
    """The reaper's decision rows on the session, in order: (action, reason)."""
    with closing(sqlite3.connect(app.ledger)) as db:
        rows = db.execute(
            "SELECT action, reason FROM residency_events WHERE session_id LIKE ?"
            " AND action IN ('hold', 'release', 'evict', 'demote') ORDER BY at, rowid",
            (f"%/{session}",),
        ).fetchall()
    return [(str(a), str(r)) for a, r in rows]


def waits(app: RunningAppliance, session: str) -> list[str]:
    """What each decision said the session waits on ("tool NAME", "the person"), repeats
    (a hold's revisits) folded."""
    said: list[str] = []
    for _, reason in decisions(app, session):
        wait = (
            reason.rsplit("; waits on ", 1)[-1].split(" (", 1)[0]
            if "; waits on " in reason
            else "?"
        )
        if not said or said[-1] != wait:
            said.append(wait)
    return said


def decided(app: RunningAppliance, session: str, n: int) -> list[str]:
    """`waits` once it holds `n` entries (the decision comes a moment after the answer)."""
    return eventually(lambda: waits(app, session), lambda w: len(w) >= n)


def openai_client(app: RunningAppliance) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{app.url}/v1", api_key=app.keys["alice"], max_retries=0)


def forced(app: RunningAppliance, text: str) -> dict[str, Any]:
    """On vLLM, the body's part that makes a random model write exactly `text` (structured
    output: a choice of one); the simulated engine writes by its rule."""
    return {"structured_outputs": {"choice": [text]}} if app.engine == "vllm" else {}


def hermes_call(name: str) -> str:
    """A call of `name` as the workers' tool-call parser (hermes) reads it from the text."""
    return f'<tool_call>\n{{"name": "{name}", "arguments": {{"target": "src"}}}}\n</tool_call>'


def chat_step(
    app: RunningAppliance, messages: list[Any], session: str, name: str, *, stream: bool
) -> tuple[str, list[tuple[str, str]], str | None]:
    """One model turn: (content, [(call id, tool name)], finish reason)."""
    kw: dict[str, Any] = dict(
        model=app.model,
        messages=messages,
        tools=TOOLS,
        max_tokens=128,
        temperature=0,
        extra_headers={"X-Session-ID": session},
        extra_body=forced(app, hermes_call(name)),
    )
    client = openai_client(app)
    if not stream:
        reply = client.chat.completions.create(**kw).choices[0]
        calls = [(c.id, c.function.name) for c in reply.message.tool_calls or []]  # type: ignore[union-attr]
        return reply.message.content or "", calls, reply.finish_reason
    text, names, ids, finish = "", {}, {}, None
    for chunk in client.chat.completions.create(**kw, stream=True):
        for d in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
            names[d.index] = names.get(d.index, "") + ((d.function and d.function.name) or "")
            ids[d.index] = d.id or ids.get(d.index, "")
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    return text, [(ids[i], names[i]) for i in sorted(names)], finish


def test_a_five_step_tool_loop_is_decided_on_each_tool_its_answers_call(
    appliance_up: RunningAppliance,
) -> None:
    app, session = appliance_up, f"loop-{uuid.uuid4().hex[:8]}"
    messages: list[Any] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"Please call {NAMES[0]}."},
    ]
    for step, name in enumerate(NAMES):
        text, calls, finish = chat_step(app, messages, session, name, stream=step % 2 == 1)
        assert ([n for _, n in calls], finish) == ([name], "tool_calls"), text
        call_id = calls[0][0]
        messages.append(
            {
                "role": "assistant",
                "content": text or None,
                "tool_calls": [
                    {
                        "id": call_id,
                        "type": "function",
                        "function": {"name": name, "arguments": '{"target": "src"}'},
                    }
                ],
            }
        )
        messages.append({"role": "tool", "tool_call_id": call_id, "content": "3 matches"})
        if step + 1 < len(NAMES):
            messages.append({"role": "user", "content": f"Now call {NAMES[step + 1]}."})
        # The reaper's decision at this turn's end names the tool the answer called.
        assert decided(app, session, step + 1)[step] == f"tool {name}"
    assert waits(app, session) == [f"tool {n}" for n in NAMES]
    # After the last result the model reports in text: the turn goes back to the person.
    reply = openai_client(app).chat.completions.create(
        model=app.model,
        messages=messages,
        tools=TOOLS,
        max_tokens=16,
        temperature=0,
        extra_headers={"X-Session-ID": session},
        extra_body=forced(app, "All done."),
    )
    assert not reply.choices[0].message.tool_calls
    assert decided(app, session, len(NAMES) + 1)[-1] == "the person"
    actions = {a for a, _ in decisions(app, session)}
    assert "evict" not in actions  # never taken for a last step: no header, none is one


ANTHROPIC_TOOLS: list[Any] = [
    {"name": n, "description": f"{n} in the repository", "input_schema": SCHEMA} for n in NAMES
]


@pytest.mark.parametrize("appliance_up", ["sim"], indirect=True)
def test_an_anthropic_sdk_tool_loop_is_decided_on_each_tool_it_calls(
    appliance_up: RunningAppliance,
) -> None:
    app, session = appliance_up, f"messages-{uuid.uuid4().hex[:8]}"
    client = anthropic.Anthropic(base_url=app.url, api_key=app.keys["alice"], max_retries=0)
    history: list[Any] = [{"role": "user", "content": "Please call grep."}]
    for step, name in enumerate(["grep", "read_file"]):
        kw: Any = dict(
            model=app.model,
            max_tokens=128,
            system=SYSTEM,
            tools=ANTHROPIC_TOOLS,
            messages=history,
            extra_headers={"X-Session-ID": session},
        )
        if step == 0:
            message = client.messages.create(**kw)
        else:  # streamed: the forwarder reads the worker's chat stream behind the events
            with client.messages.stream(**kw) as events:
                message = events.get_final_message()
        assert message.stop_reason == "tool_use"
        [use] = [b for b in message.content if b.type == "tool_use"]
        assert use.name == name
        history.append({"role": "assistant", "content": [b.model_dump() for b in message.content]})
        history.append(
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": use.id, "content": "3 matches"},
                    {"type": "text", "text": "Now call read_file."},
                ],
            }
        )
        assert decided(app, session, step + 1)[step] == f"tool {name}"
    assert waits(app, session) == ["tool grep", "tool read_file"]


def test_a_tool_started_event_tells_the_reaper_what_the_session_waits_on(
    appliance_up: RunningAppliance,
) -> None:
    """A client that reports its tools (`POST /v1/tasks/{id}/events`): its turn's answer
    calls no tool, so the reaper first decides the session waits on the person; its task's
    `tool_started` event then says which tool runs and for how long, and the reaper decides
    again on that (the ledger's reason names the event)."""
    app, session = appliance_up, f"started-{uuid.uuid4().hex[:8]}"
    task = f"task-{session}"
    reply = openai_client(app).chat.completions.create(
        model=app.model,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hello."}],
        max_tokens=8,
        extra_headers={"X-Session-ID": session, "X-Task-ID": task},
        extra_body={"ignore_eos": True},
    )
    assert reply.choices[0].finish_reason == "length"
    assert decided(app, session, 1) == ["the person"]  # no tool called: back to the person
    event = {"type": "tool_started", "tool_class": "deploy", "expected_s": 300}
    auth = {"Authorization": f"Bearer {app.keys['alice']}"}
    r = httpx.post(f"{app.url}/v1/tasks/{task}/events", json=event, headers=auth)
    assert r.status_code == 200, r.text
    assert decided(app, session, 2)[1] == "deploy"
    _, reason = decisions(app, session)[-1]
    assert "waits on deploy (its task's tool_started event, expected 300 s;" in reason
