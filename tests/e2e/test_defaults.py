"""The README's own commands, nothing else: `appliance up --engine vllm --model DIR` and
`appliance up --engine sim --workers 2`, with every setting at its default (only the data
dir and free ports are chosen, so tests do not collide), and one agent session through each:
a task, turns that re-send a growing transcript with tool calls and results between them,
tool-wait events, and a verified success."""

from __future__ import annotations

import sqlite3
import sys
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path

import httpx
import pytest

from appliance.start.engine_start import SIM_MAX_MODEL_LEN
from tests.running import Started, add_key, appliance_process

pytestmark = pytest.mark.e2e
TINY_MODEL_CONTEXT = 4096
"""max_position_embeddings of the generated tiny model: its own limit."""


@pytest.fixture(scope="module", params=["sim", pytest.param("vllm", marks=pytest.mark.vllm)])
def readme_up(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Started, str, str]]:
    engine = request.param
    data_dir = tmp_path_factory.mktemp(f"defaults-{engine}")
    key = add_key(data_dir, "agent")
    env: dict[str, str] = {}
    if engine == "vllm":
        model_dir = request.getfixturevalue("tiny_model_dir")
        python = request.getfixturevalue("vllm_python")
        if python != sys.executable:  # a separate vLLM interpreter: the only extra setting
            env["APPLIANCE_ENGINE__PYTHON"] = python
        with appliance_process(
            data_dir, engine="vllm", workers=None, env=env, args=["--model", str(model_dir)]
        ) as up:
            yield up, key, Path(model_dir).name
    else:
        with appliance_process(data_dir, engine="sim", workers=2) as up:
            yield up, key, "sim"


def test_an_agent_session_runs_through_the_defaults(readme_up: tuple[Started, str, str]) -> None:
    up, key, model = readme_up
    auth = {"Authorization": f"Bearer {key}"}
    with httpx.Client(base_url=up.url, headers=auth, timeout=120) as http:
        card = http.get("/v1/models").json()["data"][0]
        assert card["id"] == model
        limit = card["max_model_len"]
        # The limit is the engine's own: the tiny model's context, or the simulator's.
        assert limit == (TINY_MODEL_CONTEXT if model != "sim" else SIM_MAX_MODEL_LEN)
        created = http.post("/v1/tasks", json={"task_id": "fix-it", "task_class": "swe"})
        assert created.status_code == 201, created.text
        transcript = [
            {"role": "system", "content": "You are a coding agent. " * 40},
            {"role": "user", "content": "The test test_parse fails; fix it."},
        ]
        cached = []
        for step in range(4):
            answer = http.post(
                "/v1/chat/completions",
                headers={"X-Task-ID": "fix-it", "X-Session-ID": "fix-it"},
                json={"model": model, "messages": transcript, "max_tokens": 8, "ignore_eos": True},
            )
            assert answer.status_code == 200, answer.text
            body = answer.json()
            cached.append(body["usage"]["prompt_tokens_details"]["cached_tokens"])
            transcript.append({"role": "assistant", "content": f"run_tests step {step}"})
            started = http.post(
                "/v1/tasks/fix-it/events",
                json={"type": "tool_started", "tool_class": "pytest", "expected_s": 1},
            )
            assert started.status_code == 200, started.text
            http.post("/v1/tasks/fix-it/events", json={"type": "tool_finished"})
            transcript.append({"role": "user", "content": f"tool output {step}: " + "ok " * 30})
        assert cached[0] == 0 and all(c > 0 for c in cached[1:]), cached
        done = http.post("/v1/tasks/fix-it/events", json={"type": "succeeded", "verified": True})
        assert done.json()["status"] == "succeeded"
        too_long = http.post(  # at least one token a word: over the window
            "/v1/chat/completions",
            json={
                "model": model,
                "max_tokens": 8,
                "messages": [{"role": "user", "content": "word " * (limit + 1)}],
            },
        )
        assert too_long.status_code == 400 and str(limit) in too_long.text
        assert too_long.json()["error"]["code"] == "context_length_exceeded"
    with closing(sqlite3.connect(up.log.parent / "ledger.db")) as db:
        outcomes = db.execute(
            "SELECT outcome FROM turns WHERE session_id = 'fix-it' ORDER BY started_at"
        ).fetchall()
        status = db.execute("SELECT status FROM tasks WHERE task_id = 'agent/fix-it'").fetchone()
    assert outcomes == [("ok",)] * 4
    assert status == ("succeeded",)
