"""`POST /v1/responses` through the appliance (simulated workers, and real vLLM), driven by
the unchanged `openai` client: chained by `previous_response_id`, streamed and not, placed
on the worker that stores the chain, counted in the ledger as the worker counted it."""

from __future__ import annotations

import os
import signal
import sqlite3
import time
from contextlib import closing
from typing import Any

import httpx
import openai
import pytest

from tests.e2e.conftest import RunningAppliance
from tests.e2e.test_faults import worker_process, worker_state
from tests.e2e.test_up import client, text

pytestmark = pytest.mark.e2e


def _ledger_turn(app: RunningAppliance, task: str) -> tuple[Any, ...]:
    """(session, worker, prompt, cached, output tokens, predicted cached tokens) of the task's
    one turn, once written."""
    deadline = time.monotonic() + 5
    while True:
        with closing(sqlite3.connect(app.ledger)) as db:
            row = db.execute(
                "SELECT session_id, worker, prompt_tokens, cached_tokens, output_tokens,"
                " predicted_cached_tokens"
                " FROM turns WHERE task_id LIKE ?",
                (f"%{task}",),
            ).fetchone()
        if row is not None or time.monotonic() > deadline:
            assert row is not None, f"no ledger row for {task}"
            return tuple(row)
        time.sleep(0.2)


def _reasons(app: RunningAppliance, task: str) -> str:
    with closing(sqlite3.connect(app.ledger)) as db:
        rows = db.execute(
            "SELECT r.reason FROM route_decisions r JOIN turns t USING (turn_id)"
            " WHERE t.task_id LIKE ?",
            (f"%{task}",),
        ).fetchall()
    return " | ".join(r for (r,) in rows)


def _create(c: openai.OpenAI, app: RunningAppliance, **kw: Any) -> tuple[Any, Any]:
    """The raw answer's headers and its parsed response (or event stream)."""
    raw = c.responses.with_raw_response.create(
        model=app.model, max_output_tokens=8, extra_body={"ignore_eos": True}, **kw
    )
    return raw.headers, raw.parse()


def test_three_chained_turns_stay_on_their_worker_and_the_ledger_agrees(
    appliance_up: RunningAppliance,
) -> None:
    app = appliance_up
    c = client(app)
    rules = text(301, app.words(200))
    head1, first = _create(c, app, instructions=rules, input=text(302, app.words(40)))
    assert first.id.startswith("resp_") and first.output[0].type == "message"
    head2, second = _create(
        c, app, instructions=rules, input=text(303, app.words(20)), previous_response_id=first.id
    )
    head3, stream = _create(
        c,
        app,
        instructions=rules,
        input=text(304, app.words(20)),
        previous_response_id=second.id,
        stream=True,
    )
    events = list(stream)
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed", kinds
    assert "response.output_text.delta" in kinds
    third = events[-1].response
    workers = [h["x-appliance-worker"] for h in (head1, head2, head3)]
    assert len(set(workers)) == 1, workers
    usages = [r.usage for r in (first, second, third)]
    assert usages[1].input_tokens > usages[0].input_tokens + usages[0].output_tokens
    assert usages[1].input_tokens_details.cached_tokens > 0
    assert (
        usages[2].input_tokens_details.cached_tokens > usages[1].input_tokens_details.cached_tokens
    )
    # The streamed answer was learnt too: a fourth turn chains onto it, on the same worker.
    head4, fourth = _create(
        c, app, instructions=rules, input=text(306, app.words(20)), previous_response_id=third.id
    )
    assert head4["x-appliance-worker"] == workers[0]
    assert (
        fourth.usage.input_tokens_details.cached_tokens
        > usages[2].input_tokens_details.cached_tokens
    )
    rows = [_ledger_turn(app, h["x-task-id"]) for h in (head1, head2, head3)]
    for row, usage, worker in zip(rows, usages, workers, strict=True):
        assert row[1:5] == (
            worker,
            usage.input_tokens,
            usage.input_tokens_details.cached_tokens,
            usage.output_tokens,
        ), (row, usage)
    # The router's prompt ids are the worker's: it knew exactly what the worker had cached.
    assert [row[5] for row in rows] == [row[3] for row in rows], rows
    assert len({row[0] for row in rows}) == 1, rows  # one session: the chain's
    assert "new session (no id, no prefix match)" in _reasons(app, head1["x-task-id"])
    reason = _reasons(app, head3["x-task-id"])
    assert f"previous_response_id {second.id}" in reason and workers[0] in reason, reason


def test_an_unknown_previous_response_and_bad_input_get_the_apis_errors(
    appliance_up: RunningAppliance,
) -> None:
    app = appliance_up
    c = client(app)
    with pytest.raises(openai.NotFoundError) as err:
        c.responses.create(model=app.model, input="hi", previous_response_id="resp_nowhere")
    assert err.value.body["message"] == "Response with id 'resp_nowhere' not found."  # type: ignore[index]
    auth = {"Authorization": f"Bearer {app.keys['alice']}"}
    bad = [
        {"model": app.model},
        {"model": app.model, "input": 7},
        {"model": app.model, "input": [{"type": "bogus"}]},
        {"model": app.model, "input": "hi", "max_output_tokens": 0},
        {"model": app.model, "input": "hi", "previous_response_id": 5},
        {"model": "nope", "input": "hi"},
    ]
    for body in bad:
        r = httpx.post(f"{app.url}/v1/responses", json=body, headers=auth, timeout=30)
        assert 400 <= r.status_code < 500, (body, r.status_code, r.text)
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"], error


def test_a_chained_response_whose_worker_restarted_is_refused_clearly(
    appliance_up: RunningAppliance,
) -> None:
    """vLLM keeps stored responses in its worker's memory: after that worker's restart the
    chain is refused (404 `previous_response_lost`), never answered elsewhere without it."""
    app = appliance_up
    c = client(app)
    head, first = _create(c, app, input=text(305, app.words(30)))
    home = head["x-appliance-worker"]
    restarts = worker_state(app, home)["restarts"]
    victim = worker_process(app.proc.pid, app.base_port + int(home[1:]))
    os.kill(victim.pid, signal.SIGKILL)
    victim.wait(10)
    deadline = time.monotonic() + (300 if app.engine == "vllm" else 60)
    while not (
        worker_state(app, home)["restarts"] == restarts + 1  # type: ignore[operator]
        and worker_state(app, home)["healthy"]
    ):
        assert time.monotonic() < deadline, f"{home} was not restarted"
        time.sleep(0.5)
    with pytest.raises(openai.NotFoundError) as err:
        c.responses.create(model=app.model, input="and then?", previous_response_id=first.id)
    body = err.value.body
    assert isinstance(body, dict) and body["code"] == "previous_response_lost", body
    assert home in body["message"] and "restarted" in body["message"], body
