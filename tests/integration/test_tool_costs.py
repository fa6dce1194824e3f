"""What a task's tools cost, told with its `tool_finished` events: part of the task's
attempted cost in the ledger, its tree and its budget (the task issue's "costs that add
up"). At the API of the wired appliance, against a real ledger file."""

from __future__ import annotations

import sqlite3
from contextlib import closing

import pytest
from starlette.testclient import TestClient

from appliance.ledger.reports import cost_report

A = {"Authorization": "Bearer a"}


def event(http: TestClient, task: str, body: dict[str, object]) -> tuple[int, dict[str, object]]:
    r = http.post(f"/v1/tasks/{task}/events", json=body, headers=A)
    return r.status_code, r.json()


def test_a_tools_cost_counts_in_its_tree_and_in_the_ledgers_cost_report(http: TestClient) -> None:
    assert http.post("/v1/tasks", json={"task_id": "root"}, headers=A).status_code == 201
    child = {"task_id": "kid", "parent_task_id": "root"}
    assert http.post("/v1/tasks", json=child, headers=A).status_code == 201
    search = {"type": "tool_finished", "tool_class": "search", "cost": 0.25}
    assert event(http, "kid", search)[0] == 200
    assert event(http, "root", {"type": "tool_finished", "cost": 0.5})[0] == 200
    assert event(http, "root", {"type": "succeeded", "verified": True})[0] == 200
    tree = http.get("/v1/tasks/root", headers=A).json()
    assert tree["cost"] == pytest.approx(0.5)
    assert tree["children"][0]["cost"] == pytest.approx(0.25)
    (group,) = cost_report(http.db)  # type: ignore[attr-defined]
    assert (group["tasks"], group["attempts"]) == (1, 0)  # no model turn, but money spent
    assert group["cost_per_success"] == pytest.approx(0.75)
    with closing(sqlite3.connect(http.db)) as db:  # type: ignore[attr-defined]
        costs = db.execute("SELECT task_id, cost FROM task_events ORDER BY event_id").fetchall()
    # The root's success closed its open child (a discarded branch): its event costs nothing.
    assert costs == [("a/kid", 0.25), ("a/root", 0.5), ("a/root", 0.0), ("a/kid", 0.0)]


def test_a_tools_cost_spends_the_tasks_budget(http: TestClient) -> None:
    body = {"task_id": "capped", "budget": 1.0}
    assert http.post("/v1/tasks", json=body, headers=A).status_code == 201
    assert event(http, "capped", {"type": "tool_finished", "cost": 1.5})[0] == 200
    turn = {"model": "m", "messages": [{"role": "user", "content": "next"}]}
    r = http.post("/v1/chat/completions", json=turn, headers=A | {"X-Task-ID": "capped"})
    assert (r.status_code, r.json()["error"]["code"]) == (429, "budget_exhausted")


@pytest.mark.parametrize(
    "body",
    [
        {"type": "tool_finished", "cost": -1},
        {"type": "tool_finished", "cost": "0.5"},
        {"type": "tool_finished", "cost": 1e12},
        {"type": "tool_finished", "cost": True},
        {"type": "succeeded", "cost": 0.5},  # only a finished tool has a cost
    ],
)
def test_a_bad_tool_cost_is_refused_and_changes_nothing(
    http: TestClient, body: dict[str, object]
) -> None:
    assert http.post("/v1/tasks", json={"task_id": "t"}, headers=A).status_code == 201
    status, answer = event(http, "t", body)
    assert status == 400
    assert answer["error"]["param"] == "cost"  # type: ignore[index]
    assert http.get("/v1/tasks/t", headers=A).json()["status"] == "open"
    with closing(sqlite3.connect(http.db)) as db:  # type: ignore[attr-defined]
        assert db.execute("SELECT count(*) FROM task_events").fetchone() == (0,)
