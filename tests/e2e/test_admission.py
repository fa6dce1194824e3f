"""Admission end to end against `appliance up --engine sim`: refusals are OpenAI-style 429s
with Retry-After, written to the ledger's admission_events, and never reach a worker."""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Iterator
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.running import add_key, appliance_process

pytestmark = pytest.mark.e2e


@dataclass
class App:
    url: str
    key: str
    ops: str
    worker_url: str
    ledger: Path

    def post(self, path: str, body: dict[str, Any], **headers: str) -> httpx.Response:
        auth = {"Authorization": f"Bearer {self.key}"}
        return httpx.post(f"{self.url}{path}", json=body, headers=auth | headers, timeout=30)

    def chat(self, content: str, **headers: str) -> httpx.Response:
        body = {"model": "sim", "messages": [{"role": "user", "content": content}]}
        return self.post("/v1/chat/completions", body | {"max_tokens": 4}, **headers)

    def rows(self, sql: str, *params: Any) -> list[tuple[Any, ...]]:
        with closing(sqlite3.connect(self.ledger)) as db:
            return db.execute(sql, params).fetchall()

    def worker_requests(self) -> float:
        """Requests the (only) simulated worker has finished, from its own /metrics."""
        text = httpx.get(f"{self.worker_url}/metrics", timeout=10).text
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("vllm:request_success_total")
        )


@pytest.fixture(scope="module")
def app(tmp_path_factory: pytest.TempPathFactory) -> Iterator[App]:
    data_dir = tmp_path_factory.mktemp("appliance-admission")
    key, ops = add_key(data_dir, "alice"), add_key(data_dir, "ops", "--admin")
    with appliance_process(data_dir, workers=1) as up:
        yield App(up.url, key, ops, f"http://127.0.0.1:{up.base_port}", data_dir / "ledger.db")


def _refusal(r: httpx.Response, status: int, code: str) -> dict[str, Any]:
    assert r.status_code == status, r.text
    assert int(r.headers["retry-after"]) >= 1
    error = r.json()["error"]
    assert (error["code"], error["type"]) == (code, "rate_limit_error")
    assert error["message"]
    return error


def test_a_child_beyond_max_children_is_refused_with_retry_after_and_a_ledger_row(
    app: App,
) -> None:
    assert app.post("/v1/tasks", {"task_id": "orch", "max_children": 2}).status_code == 201
    for child in ("c1", "c2"):
        r = app.post("/v1/tasks", {"task_id": child, "parent_task_id": "orch"})
        assert r.status_code == 201, r.text
    error = _refusal(
        app.post("/v1/tasks", {"task_id": "c3", "parent_task_id": "orch"}), 429, "children_cap"
    )
    assert "its max_children is 2" in error["message"]
    [(decision, reason)] = app.rows(
        "SELECT decision, reason FROM admission_events WHERE task_id = 'alice/c3'"
    )
    assert decision == "deny" and reason.startswith("children_cap:")
    assert app.rows("SELECT count(*) FROM tasks WHERE task_id = 'alice/c3'") == [(0,)]
    # A child opened by its first model turn meets the same cap...
    headers = {"X-Task-ID": "c4", "X-Parent-Task-ID": "orch"}
    _refusal(app.chat("hello", **headers), 429, "children_cap")
    # ...until a child closes and frees its place.
    r = app.post("/v1/tasks/c1/events", {"type": "succeeded", "verified": True})
    assert r.status_code == 200, r.text
    r = app.chat("hello", **headers)
    assert r.status_code == 200, r.text
    state = httpx.get(
        f"{app.url}/admin/v1/state", headers={"Authorization": f"Bearer {app.ops}"}
    ).json()
    assert state["admission"]["by_reason"]["children_cap"] >= 2
    assert state["admission"]["accepted"] >= 4
    events = [e for e in state["events"] or [] if e["kind"] == "rejection"]
    assert any(e["subject"] == "c3" and e["tenant"] == "alice" for e in events)
    metrics = httpx.get(f"{app.url}/metrics").text
    assert 'appliance_admission_rejected_total{reason="children_cap"}' in metrics


def test_an_infeasible_deadline_is_refused_before_any_worker_sees_it(app: App) -> None:
    before = app.worker_requests()
    # The shortest prompt takes the simulated H200 several milliseconds to prefill.
    r = app.chat("a deadline of one millisecond", **{"X-Task-ID": "late", "X-Deadline-S": "0.001"})
    error = _refusal(r, 429, "deadline_infeasible")
    assert "prefill" in error["message"]
    assert app.worker_requests() == before
    assert app.rows("SELECT count(*) FROM turns WHERE task_id = 'alice/late'") == [(0,)]
    [(reason,)] = app.rows("SELECT reason FROM admission_events WHERE task_id = 'alice/late'")
    assert reason.startswith("deadline_infeasible:")
    # The same turn with time to spare reaches the worker.
    r = app.chat("a deadline of one millisecond", **{"X-Task-ID": "late", "X-Deadline-S": "60"})
    assert r.status_code == 200, r.text
    assert app.worker_requests() == before + 1
    # The task this turn created keeps the turn's deadline.
    auth = {"Authorization": f"Bearer {app.key}"}
    task = httpx.get(f"{app.url}/v1/tasks/late", headers=auth, timeout=10).json()
    [(created_at,)] = app.rows("SELECT created_at FROM tasks WHERE task_id = 'alice/late'")
    assert task["deadline_at"] == pytest.approx(created_at + 60, abs=1e-3)


def test_a_task_trees_budget_binds_its_later_turns_and_children(app: App) -> None:
    # Priced per token by default: one short turn costs about 1e-4 USD, past a budget of
    # 1e-6. The first turn starts within the budget; once the ledger has priced it, the
    # tree's later turns and new children are refused before any worker sees them.
    assert app.post("/v1/tasks", {"task_id": "thrifty", "budget": 1e-6}).status_code == 201
    assert app.chat("spend it", **{"X-Task-ID": "thrifty"}).status_code == 200
    before = app.worker_requests()
    for _ in range(50):  # the turn's cost is added when its ledger row is written
        r = app.chat("and more", **{"X-Task-ID": "thrifty"})
        if r.status_code == 429:
            break
        time.sleep(0.1)
    error = _refusal(r, 429, "budget_exhausted")
    assert "spent its budget" in error["message"]
    r = app.post("/v1/tasks", {"task_id": "thrifty-child", "parent_task_id": "thrifty"})
    _refusal(r, 429, "budget_exhausted")
    r = app.chat("a child's turn", **{"X-Task-ID": "kid", "X-Parent-Task-ID": "thrifty"})
    _refusal(r, 429, "budget_exhausted")
    assert app.worker_requests() <= before + 1  # at most a turn priced late got through
    rows = app.rows("SELECT count(*) FROM admission_events WHERE reason LIKE 'budget_exhausted:%'")
    assert rows[0][0] >= 3


def test_a_streamed_turn_is_released_when_its_stream_ends(app: App) -> None:
    body = {
        "model": "sim",
        "messages": [{"role": "user", "content": "stream me"}],
        "max_tokens": 4,
        "stream": True,
    }
    auth = {"Authorization": f"Bearer {app.key}", "X-Task-ID": "streamed"}
    ops = {"Authorization": f"Bearer {app.ops}"}
    before = httpx.get(f"{app.url}/admin/v1/state", headers=ops).json()["admission"]
    with httpx.stream(
        "POST", f"{app.url}/v1/chat/completions", json=body, headers=auth, timeout=30
    ) as r:
        assert r.status_code == 200
        lines = list(r.iter_lines())
    assert "data: [DONE]" in lines
    after = httpx.get(f"{app.url}/admin/v1/state", headers=ops).json()["admission"]
    assert after["accepted"] == before["accepted"] + 1
    assert after["in_flight_turns"] == 0
    assert after["tenants"]["alice"]["in_flight_turns"] == 0
