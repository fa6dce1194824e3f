"""Escalation end to end: a local `appliance up` whose outside endpoint is a second simulated
appliance (`server.auth: none`, on its own ports), and a second endpoint that is down. A task
class set to escalate sends its turns outside and they stay there; `X-Escalate` does the same
per task; streaming, tool calls and the Messages API pass through; the outside turns are
ledger rows priced at the endpoint's prices, and `appliance costs` adds both sides; the down
endpoint's turn is a failed attempt and the turn is served locally; the key never lands in
the ledger or the logs, nor do the appliance's task ids leave the box."""

from __future__ import annotations

import json
import socket
import sqlite3
import subprocess
import time
from collections.abc import Iterator
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
import yaml

from tests.e2e.test_up import text
from tests.ports import free_port
from tests.running import BIN, Started, add_key, appliance_process

pytestmark = pytest.mark.e2e
KEY = "sk-outside-secret-4711"
PRICES = {"input_per_mtok": 3.0, "cached_per_mtok": 0.3, "output_per_mtok": 15.0}
TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]


@dataclass
class Pair:
    local: Started
    outside: Started
    key: str
    local_dir: Path
    outside_dir: Path

    def headers(self, **extra: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}", **extra}

    def chat(self, headers: dict[str, str], **body: Any) -> httpx.Response:
        body = {"model": "sim", "max_tokens": 6} | body
        return httpx.post(
            f"{self.local.url}/v1/chat/completions",
            json=body,
            headers=self.headers(**headers),
            timeout=30,
        )

    def task(self, task_id: str, task_class: str) -> None:
        made = httpx.post(
            f"{self.local.url}/v1/tasks",
            json={"task_id": task_id, "task_class": task_class},
            headers=self.headers(),
            timeout=10,
        )
        assert made.status_code in (200, 201), made.text


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    outside_dir = tmp_path_factory.mktemp("outside")
    local_dir = tmp_path_factory.mktemp("local")
    config = local_dir / "appliance.yaml"
    env = {
        "APPLIANCE_SERVER__AUTH": "none",
        "APPLIANCE_ENGINE__MAX_MODEL_LEN": "65536",
        "APPLIANCE_ENGINE__SIM_TIME_SCALE": "0.01",  # a faster GPU than the local box's
    }
    silent = socket.create_server(("127.0.0.1", 0))  # takes connections, never answers
    with silent, appliance_process(outside_dir, workers=1, env=env) as outside:
        endpoint = {"base_url": outside.url, "model": "sim", **PRICES}
        escalation = {
            "endpoints": [
                {"name": "frontier", "api_key_env": "FRONTIER_KEY", "latency_s": 1, **endpoint},
                {"name": "claude", "kind": "anthropic", "api_key_env": "FRONTIER_KEY", **endpoint},
                {
                    "name": "silent",
                    **endpoint,
                    "base_url": f"http://127.0.0.1:{silent.getsockname()[1]}",
                    "timeout_s": 1,
                },
                {
                    "name": "down",
                    **endpoint,
                    "base_url": f"http://127.0.0.1:{free_port()}",
                    "timeout_s": 3,
                },
            ],
            "task_classes": {"planning": "frontier", "flaky": "down", "hung": "silent"},
            "spill_to": "frontier",
        }
        config.write_text(yaml.safe_dump({"escalation": escalation}))
        key = add_key(local_dir, "alice")
        local_env = {
            "APPLIANCE_CONFIG": str(config),
            "FRONTIER_KEY": KEY,
            "APPLIANCE_ENGINE__MAX_MODEL_LEN": "65536",
        }
        with appliance_process(local_dir, env=local_env) as local:
            yield Pair(local, outside, key, local_dir, outside_dir)


def rows(db: Path, sql: str, *params: Any, n: int = 1) -> list[tuple[Any, ...]]:
    """The rows once there are `n` (the ledger commits a moment after the answer)."""
    deadline = time.monotonic() + 5
    while True:
        with closing(sqlite3.connect(db)) as conn:
            got = [tuple(r) for r in conn.execute(sql, params)]
        if len(got) >= n or time.monotonic() > deadline:
            return got
        time.sleep(0.05)


def test_a_task_class_set_to_escalate_sends_its_turns_outside_and_they_stay(pair: Pair) -> None:
    pair.task("plan-1", "planning")
    first = pair.chat({"X-Task-ID": "plan-1"}, messages=[{"role": "user", "content": "plan"}])
    assert first.status_code == 200, first.text
    assert first.headers["x-appliance-endpoint"] == "frontier"
    assert "x-appliance-worker" not in first.headers
    messages = [
        {"role": "user", "content": "plan"},
        {"role": "assistant", "content": first.json()["choices"][0]["message"]["content"]},
        {"role": "user", "content": text(1, 30)},
    ]
    second = pair.chat({"X-Task-ID": "plan-1"}, messages=messages)
    assert second.headers["x-appliance-endpoint"] == "frontier"
    usage = second.json()["usage"]
    got = rows(
        pair.local_dir / "ledger.db",
        "SELECT endpoint, route_reason, worker, outcome, prompt_tokens, output_tokens, cost"
        " FROM turns WHERE task_id LIKE '%plan-1' ORDER BY started_at",
        n=2,
    )
    assert [r[:4] for r in got] == [
        ("frontier", "task class planning -> frontier", None, "ok"),
        ("frontier", "task class planning -> frontier", None, "ok"),
    ]
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    price = (
        3.0 * (usage["prompt_tokens"] - cached) + 0.3 * cached + 15.0 * usage["completion_tokens"]
    ) / 1e6
    assert got[1][4:] == (usage["prompt_tokens"], usage["completion_tokens"], pytest.approx(price))
    # The outside appliance served both, and heard nothing of the task: its own turns are
    # one-turn tasks of its `local` tenant.
    outside = rows(pair.outside_dir / "ledger.db", "SELECT tenant, task_id FROM turns", n=2)
    assert len(outside) >= 2
    assert all(t == "local" and "plan-1" not in (task or "") for t, task in outside)


def test_x_escalate_sends_a_task_outside_and_its_next_turns_follow(pair: Pair) -> None:
    said = pair.chat(
        {"X-Task-ID": "esc-1", "X-Escalate": "frontier"},
        messages=[{"role": "user", "content": "hello"}],
    )
    assert said.headers["x-appliance-endpoint"] == "frontier"
    follows = pair.chat({"X-Task-ID": "esc-1"}, messages=[{"role": "user", "content": "more"}])
    assert follows.headers["x-appliance-endpoint"] == "frontier"
    back = pair.chat(
        {"X-Task-ID": "esc-1", "X-Escalate": "local"}, messages=[{"role": "user", "content": "x"}]
    )
    assert "x-appliance-endpoint" not in back.headers and back.headers["x-appliance-worker"]
    got = rows(
        pair.local_dir / "ledger.db",
        "SELECT endpoint, route_reason FROM turns WHERE task_id LIKE '%esc-1' ORDER BY started_at",
        n=3,
    )
    assert got == [
        ("frontier", "X-Escalate: frontier"),
        ("frontier", "task stays on frontier (an earlier turn's X-Escalate)"),
        (None, "X-Escalate: local"),
    ]


def test_a_responses_api_turn_of_an_escalated_class_stays_on_the_box(pair: Pair) -> None:
    """Its state is stored on the worker that served it: it is never sent outside."""
    pair.task("plan-r", "planning")
    answered = httpx.post(
        f"{pair.local.url}/v1/responses",
        json={"model": "sim", "input": "plan", "max_output_tokens": 4},
        headers=pair.headers(**{"X-Task-ID": "plan-r"}),
        timeout=30,
    )
    assert answered.status_code == 200, answered.text
    assert answered.headers["x-appliance-worker"]
    assert "x-appliance-endpoint" not in answered.headers


def test_an_unknown_endpoint_in_x_escalate_is_refused(pair: Pair) -> None:
    refused = pair.chat({"X-Escalate": "nowhere"}, messages=[{"role": "user", "content": "x"}])
    assert refused.status_code == 400
    assert refused.json()["error"]["code"] == "unknown_endpoint"
    assert "frontier" in refused.json()["error"]["message"]


def test_streamed_tool_calls_pass_through_an_outside_endpoint(pair: Pair) -> None:
    client = openai.OpenAI(base_url=f"{pair.local.url}/v1", api_key=pair.key, max_retries=0)
    stream = client.chat.completions.create(
        model="sim",
        messages=[{"role": "user", "content": "Weather in Oslo?"}],
        tools=TOOLS,
        tool_choice="required",
        stream=True,
        extra_headers={"X-Task-ID": "tools-1", "X-Escalate": "frontier"},
    )
    names, arguments, finish = _streamed_tool_calls(stream)
    assert names == ["get_weather"] and finish == "tool_calls"
    assert "city" in json.loads(arguments)
    got = rows(
        pair.local_dir / "ledger.db",
        "SELECT endpoint, outcome, output_tokens FROM turns WHERE task_id LIKE '%tools-1'",
    )
    assert got[0][:2] == ("frontier", "ok") and got[0][2] > 0  # the stream's usage counted


def test_the_messages_api_works_through_an_outside_endpoint(pair: Pair) -> None:
    client = anthropic.Anthropic(base_url=pair.local.url, api_key=pair.key, max_retries=0)
    headers = {"X-Escalate": "frontier", "X-Task-ID": "msg-1"}
    raw = client.messages.with_raw_response.create(
        model="sim",
        max_tokens=5,
        messages=[{"role": "user", "content": "hi"}],
        extra_headers=headers,
    )
    message = raw.parse()
    assert raw.headers["x-appliance-endpoint"] == "frontier"
    assert message.type == "message" and message.usage.output_tokens == 5
    _assert_streamed_message(client, headers)


def test_an_anthropic_endpoint_serves_chat_streams_tool_calls_and_messages(pair: Pair) -> None:
    """The outside appliance's own /v1/messages as an endpoint of kind `anthropic`: the chat
    turn goes out as a Messages request and its answer comes back as chat."""
    client = openai.OpenAI(base_url=f"{pair.local.url}/v1", api_key=pair.key, max_retries=0)
    headers = {"X-Task-ID": "claude-1", "X-Escalate": "claude"}
    raw = client.chat.completions.with_raw_response.create(
        model="sim",
        messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
        max_tokens=5,
        extra_headers=headers,
    )
    answer = raw.parse()
    assert raw.headers["x-appliance-endpoint"] == "claude"
    assert answer.choices[0].finish_reason == "length" and answer.usage is not None
    assert answer.usage.completion_tokens == 5
    stream = client.chat.completions.create(
        model="sim",
        messages=[{"role": "user", "content": "Weather in Oslo?"}],
        tools=TOOLS,
        tool_choice="required",
        stream=True,
        extra_headers=headers,
    )
    names, arguments, finish = _streamed_tool_calls(stream)
    assert names == ["get_weather"] and finish == "tool_calls"
    assert "city" in json.loads(arguments)
    messages = anthropic.Anthropic(base_url=pair.local.url, api_key=pair.key, max_retries=0)
    _assert_streamed_message(messages, headers)
    got = rows(
        pair.local_dir / "ledger.db",
        "SELECT endpoint, outcome, output_tokens FROM turns WHERE task_id LIKE '%claude-1'"
        " ORDER BY started_at",
        n=3,
    )
    assert [r[:2] for r in got] == [("claude", "ok")] * 3
    assert got[0][2] == 5 and got[2][2] == 4


def test_an_endpoint_that_is_down_is_a_failed_attempt_and_the_turn_runs_locally(
    pair: Pair,
) -> None:
    pair.task("flaky-1", "flaky")
    served = pair.chat({"X-Task-ID": "flaky-1"}, messages=[{"role": "user", "content": "hi"}])
    assert served.status_code == 200, served.text
    assert served.headers["x-appliance-worker"] and "x-appliance-endpoint" not in served.headers
    got = rows(
        pair.local_dir / "ledger.db",
        "SELECT endpoint, outcome, worker IS NOT NULL, route_reason, cost FROM turns"
        " WHERE task_id LIKE '%flaky-1' ORDER BY started_at",
        n=2,
    )
    assert [r[:3] for r in got] == [("down", "failed", 0), (None, "ok", 1)]
    assert got[0][4] == 0.0
    assert got[1][3] == "down failed (engine_unavailable): local"


def test_a_turn_the_box_refuses_spills_over_when_its_deadline_allows_the_endpoint(
    pair: Pair,
) -> None:
    """60,000 prompt tokens take the simulated H200 longer than 2 s to prefill: the box refuses
    both turns as infeasible; 2 s allows frontier's 1 s, 0.5 s does not."""
    prompt = [1000 + i % 20000 for i in range(60000)]

    def completion(task: str, deadline_s: str) -> httpx.Response:
        return httpx.post(
            f"{pair.local.url}/v1/completions",
            json={"model": "sim", "prompt": prompt, "max_tokens": 4},
            headers=pair.headers(**{"X-Task-ID": task, "X-Deadline-S": deadline_s}),
            timeout=30,
        )

    spilled = completion("spill-1", "2")
    assert spilled.status_code == 200, spilled.text
    assert spilled.headers["x-appliance-endpoint"] == "frontier"
    refused = completion("spill-2", "0.5")
    assert refused.status_code == 429, refused.text
    assert refused.json()["error"]["code"] == "deadline_infeasible"
    db = pair.local_dir / "ledger.db"
    (row,) = rows(db, "SELECT endpoint, route_reason FROM turns WHERE task_id LIKE '%spill-1'")
    assert row[0] == "frontier"
    assert row[1].startswith("spill-over: box refused (deadline_infeasible); 2 s left")
    assert rows(db, "SELECT count(*) FROM turns WHERE task_id LIKE '%spill-2'") == [(0,)]


def test_an_endpoint_that_times_out_is_a_failed_attempt_and_the_turn_runs_locally(
    pair: Pair,
) -> None:
    pair.task("hung-1", "hung")
    began = time.monotonic()
    served = pair.chat({"X-Task-ID": "hung-1"}, messages=[{"role": "user", "content": "hi"}])
    assert served.status_code == 200, served.text
    assert served.headers["x-appliance-worker"] and time.monotonic() - began < 10
    got = rows(
        pair.local_dir / "ledger.db",
        "SELECT endpoint, outcome, route_reason FROM turns WHERE task_id LIKE '%hung-1'"
        " ORDER BY started_at",
        n=2,
    )
    assert got == [
        ("silent", "failed", "task class hung -> silent"),
        (None, "ok", "silent failed (worker_timeout): local"),
    ]


def test_costs_add_both_sides_and_the_key_stays_in_the_box(pair: Pair) -> None:
    pair.task("both-1", "planning")
    pair.chat({"X-Task-ID": "both-1"}, messages=[{"role": "user", "content": "a"}])
    pair.chat(
        {"X-Task-ID": "both-1", "X-Escalate": "local"}, messages=[{"role": "user", "content": "b"}]
    )
    db = pair.local_dir / "ledger.db"
    sides = rows(db, "SELECT endpoint, cost FROM turns WHERE task_id LIKE '%both-1'", n=2)
    assert {s[0] for s in sides} == {"frontier", None} and all(s[1] > 0 for s in sides)
    report = subprocess.run(
        [str(BIN / "appliance"), "costs", "--db", str(db), "--json", "--by", "task_class"],
        capture_output=True,
        text=True,
        check=True,
    )
    groups = {g["task_class"]: g for g in json.loads(report.stdout)}
    (total,) = rows(
        db,
        "SELECT sum(cost) FROM turns t JOIN tasks k ON k.task_id = t.task_id"
        " WHERE k.task_class = 'planning'",
    )
    assert groups["planning"]["cost"] == pytest.approx(total[0])
    for path in pair.local_dir.rglob("*"):
        if path.is_file():
            assert KEY.encode() not in path.read_bytes(), path


def _streamed_tool_calls(stream: Any) -> tuple[list[str], str, str | None]:
    """The tool names, the arguments (concatenated) and the finish reason of a stream."""
    names, arguments, finish = [], "", None
    for chunk in stream:
        for choice in chunk.choices:
            for call in choice.delta.tool_calls or []:
                if call.function and call.function.name:
                    names.append(call.function.name)
                if call.function and call.function.arguments:
                    arguments += call.function.arguments
            finish = choice.finish_reason or finish
    return names, arguments, finish


def _assert_streamed_message(client: anthropic.Anthropic, headers: dict[str, str]) -> None:
    """A streamed four-token Messages answer: its text as streamed, its usage as asked."""
    with client.messages.stream(
        model="sim",
        max_tokens=4,
        messages=[{"role": "user", "content": "again"}],
        extra_headers=headers,
    ) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert final.content[0].text == streamed  # type: ignore[union-attr]
    assert final.usage.output_tokens == 4
