"""`Idempotency-Key` on the task routes, at the API of the wired appliance (a real ledger
file, ASGI): a retry gets the first answer and changes nothing; the same key for another
request is a 422; keys are per tenant. The seed failure mode "retry duplicates"."""

from __future__ import annotations

import sqlite3
from contextlib import closing

from starlette.testclient import TestClient

A = {"Authorization": "Bearer a"}
B = {"Authorization": "Bearer b"}


def rows(http: TestClient, sql: str) -> list[tuple[object, ...]]:
    with closing(sqlite3.connect(http.db)) as db:  # type: ignore[attr-defined]
        return db.execute(sql).fetchall()


def test_a_retried_creation_gets_the_first_answer_and_makes_one_task(http: TestClient) -> None:
    body = {"task_id": "t1", "deadline_s": 60}
    first = http.post("/v1/tasks", json=body, headers=A | {"Idempotency-Key": "k1"})
    again = http.post("/v1/tasks", json=body, headers=A | {"Idempotency-Key": "k1"})
    assert first.status_code == 201, first.text
    assert (again.status_code, again.content) == (201, first.content)
    assert again.headers["idempotent-replayed"] == "true"
    assert "idempotent-replayed" not in first.headers
    assert rows(http, "SELECT count(*) FROM tasks WHERE task_id = 'a/t1'") == [(1,)]


def test_the_same_key_for_another_request_is_422(http: TestClient) -> None:
    http.post("/v1/tasks", json={"task_id": "t2"}, headers=A | {"Idempotency-Key": "k2"})
    r = http.post("/v1/tasks", json={"task_id": "t3"}, headers=A | {"Idempotency-Key": "k2"})
    assert r.status_code == 422
    assert r.json()["error"]["code"] == "idempotency_key_reused"
    assert rows(http, "SELECT count(*) FROM tasks WHERE task_id = 'a/t3'") == [(0,)]
    # The key of another tenant is another key.
    r = http.post("/v1/tasks", json={"task_id": "t3"}, headers=B | {"Idempotency-Key": "k2"})
    assert r.status_code == 201, r.text


def test_a_retried_event_and_cancel_are_answered_once(http: TestClient) -> None:
    http.post("/v1/tasks", json={"task_id": "p"}, headers=A)
    http.post("/v1/tasks", json={"task_id": "c", "parent_task_id": "p"}, headers=A)
    event = {"type": "tool_started", "tool_class": "test"}
    for _ in range(2):
        r = http.post("/v1/tasks/p/events", json=event, headers=A | {"Idempotency-Key": "e1"})
        assert r.status_code == 200, r.text
    assert rows(http, "SELECT count(*) FROM task_events WHERE task_id = 'a/p'") == [(1,)]
    first = http.post("/v1/tasks/p/cancel", headers=A | {"Idempotency-Key": "x1"})
    again = http.post("/v1/tasks/p/cancel", headers=A | {"Idempotency-Key": "x1"})
    assert first.json() == again.json() == {"cancelled": ["p", "c"]}
    # Without the key, the second cancel finds nothing left open.
    assert http.post("/v1/tasks/p/cancel", headers=A).json() == {"cancelled": []}


def test_a_refused_request_is_not_kept_and_its_retry_is_judged_afresh(http: TestClient) -> None:
    body = {"task_id": "kid", "parent_task_id": "no-such-parent"}
    r = http.post("/v1/tasks", json=body, headers=A | {"Idempotency-Key": "k4"})
    assert r.status_code == 404
    http.post("/v1/tasks", json={"task_id": "no-such-parent"}, headers=A)
    r = http.post("/v1/tasks", json=body, headers=A | {"Idempotency-Key": "k4"})
    assert r.status_code == 201, r.text


def test_a_bad_key_is_400(http: TestClient) -> None:
    r = http.post("/v1/tasks", json={"task_id": "t5"}, headers=A | {"Idempotency-Key": "x" * 257})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "idempotency-key"


def test_a_closed_tree_takes_no_new_child_but_a_retried_creation_gets_its_answer(
    http: TestClient,
) -> None:
    """A cancelled root's tree is done: a new child of any of its tasks is refused (409
    `task_closed`), opened by POST /v1/tasks or by a turn; a
    client retrying a creation that landed before the cancel still gets the task it made."""
    http.post("/v1/tasks", json={"task_id": "root"}, headers=A)
    kid = {"task_id": "kid", "parent_task_id": "root"}
    assert http.post("/v1/tasks", json=kid, headers=A).status_code == 201
    assert http.post("/v1/tasks/root/cancel", headers=A).json() == {"cancelled": ["root", "kid"]}
    for parent in ("root", "kid"):
        r = http.post(
            "/v1/tasks", json={"task_id": f"{parent}-2", "parent_task_id": parent}, headers=A
        )
        assert (r.status_code, r.json()["error"]["code"]) == (409, "task_closed"), r.text
        assert f"parent task {parent} is cancelled" in r.json()["error"]["message"]
        turn = {"model": "m", "prompt": "hi", "max_tokens": 1}
        heads = {"X-Task-ID": f"{parent}-3", "X-Parent-Task-ID": parent}
        r = http.post("/v1/completions", json=turn, headers=A | heads)
        assert (r.status_code, r.json()["error"]["code"]) == (409, "task_closed"), r.text
    assert rows(http, "SELECT count(*) FROM tasks WHERE task_id LIKE 'a/%-_'") == [(0,)]
    again = http.post("/v1/tasks", json=kid, headers=A)
    assert (again.status_code, again.json()["status"]) == (200, "cancelled")
    # Another tenant's task of the same name is another tree.
    assert http.post("/v1/tasks", json={"task_id": "root"}, headers=B).status_code == 201
    r = http.post("/v1/tasks", json={"task_id": "kid2", "parent_task_id": "root"}, headers=B)
    assert r.status_code == 201, r.text
