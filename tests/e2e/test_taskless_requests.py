"""Requests that name no task, through `appliance up`: each runs as a one-turn task
(`turn-...`), closed `done` when its turn ends (a whole answer, a stream's end), so forty of
them leave no open task: not in the ledger, not in the state's tasks, not in admission's
count. A session the client named with X-Session-ID lives on across them: the closing of
its turns' tasks ends it not, and its next turn still finds its cache."""

from __future__ import annotations

import sqlite3
import time
from contextlib import closing
from typing import Any

import httpx
import pytest

from tests.e2e.conftest import RunningAppliance
from tests.e2e.test_up import client, text
from tests.running import eventually

pytestmark = pytest.mark.e2e
SESSION = "taskless"
REQUESTS = 40


def ledger_rows(app: RunningAppliance, sql: str, *params: Any) -> list[tuple[Any, ...]]:
    with closing(sqlite3.connect(app.ledger)) as db:
        return db.execute(sql, params).fetchall()


def statuses(app: RunningAppliance, tasks: list[str]) -> dict[str, int]:
    """How many of the tasks the ledger holds in each status."""
    marks = ", ".join("?" * len(tasks))
    sql = f"SELECT status, count(*) FROM tasks WHERE task_id IN ({marks}) GROUP BY status"
    rows = ledger_rows(app, sql, *[f"alice/{t}" for t in tasks])
    return {str(s): int(n) for s, n in rows}


def state(app: RunningAppliance) -> dict[str, Any]:
    ops = {"Authorization": f"Bearer {app.keys['ops']}"}
    answer = httpx.get(f"{app.url}/admin/v1/state", headers=ops, timeout=30)
    assert answer.status_code == 200, answer.text
    return dict(answer.json())


def test_forty_requests_without_a_task_leave_no_open_task(appliance_up: RunningAppliance) -> None:
    app, c = appliance_up, client(appliance_up)
    history: list[Any] = [{"role": "system", "content": text(4001, app.words(200))}]
    tasks: list[str] = []
    cached: list[int] = []
    plain: dict[str, Any] = dict(model=app.model, max_tokens=4, extra_body={"ignore_eos": True})
    for i in range(REQUESTS):
        words = text(4100 + i, app.words(20))
        if i % 4 == 0:  # plain chat, no header at all
            raw = c.chat.completions.with_raw_response.create(
                messages=[{"role": "user", "content": words}], **plain
            )
            raw.parse()
        elif i % 4 == 1:  # streamed: its turn ends when its stream does
            raw = c.chat.completions.with_raw_response.create(
                messages=[{"role": "user", "content": words}], stream=True, **plain
            )
            assert list(raw.parse())
        elif i % 4 == 2:  # a plain completion: a one-turn session, too
            raw = c.completions.with_raw_response.create(prompt=words, **plain)
            raw.parse()
        else:  # a session the client named, and no task
            history.append({"role": "user", "content": words})
            raw = c.chat.completions.with_raw_response.create(
                messages=history, extra_headers={"X-Session-ID": SESSION}, **plain
            )
            answer = raw.parse()
            assert answer.usage is not None and answer.usage.prompt_tokens_details is not None
            cached.append(answer.usage.prompt_tokens_details.cached_tokens or 0)
            history.append({"role": "assistant", "content": answer.choices[0].message.content})
        tasks.append(raw.headers["x-task-id"])
    assert len(set(tasks)) == REQUESTS and all(t.startswith("turn-") for t in tasks), tasks

    # The ledger: every one closed `done`, by its own `done` event; nothing open at all.
    closed = eventually(lambda: statuses(app, tasks), lambda s: s == {"done": REQUESTS})
    assert closed == {"done": REQUESTS}, closed
    assert ledger_rows(app, "SELECT count(*) FROM tasks WHERE status = 'open'") == [(0,)]
    events = ledger_rows(app, "SELECT count(*) FROM task_events WHERE type = 'done'")
    assert events == [(REQUESTS,)]
    unfinished = "SELECT count(*) FROM tasks WHERE status = 'done' AND finished_at IS NULL"
    assert ledger_rows(app, unfinished) == [(0,)]

    # The state agrees, and so does admission.
    now = state(app)
    shown = {t["id"]: t["status"] for t in now["tasks"] if t["tenant"] == "alice"}
    assert {shown.get(t) for t in tasks} == {"done"}, shown
    assert "open" not in {t["status"] for t in now["tasks"]}
    admission = now["admission"]
    assert admission["open_tasks"] == 0 and admission["in_flight_turns"] == 0, admission
    assert all(t["open_tasks"] == 0 for t in admission["tenants"].values()), admission

    # The named session lives on, across the reaper's ticks: no task of its closed it.
    time.sleep(1.5)
    ours = [s for s in state(app)["sessions"] if s["id"] == SESSION]
    assert len(ours) == 1 and ours[0]["turns"] == REQUESTS // 4, ours
    ended = ledger_rows(
        app,
        "SELECT reason FROM residency_events WHERE session_id = ? AND reason LIKE '%task closed%'",
        f"alice/{SESSION}",
    )
    assert ended == [], ended
    history.append({"role": "user", "content": text(4999, app.words(20))})
    raw = c.chat.completions.with_raw_response.create(
        messages=history, extra_headers={"X-Session-ID": SESSION}, **plain
    )
    answer = raw.parse()
    assert answer.usage is not None and answer.usage.prompt_tokens_details is not None
    cached.append(answer.usage.prompt_tokens_details.cached_tokens or 0)
    assert cached[0] == 0 and all(n > 0 for n in cached[1:]), cached
    last = [raw.headers["x-task-id"]]
    assert eventually(lambda: statuses(app, last), lambda s: s == {"done": 1}) == {"done": 1}
